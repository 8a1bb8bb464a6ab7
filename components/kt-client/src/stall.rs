//! Progress timeouts for data requests: a source that neither answers nor
//! resets (a frozen process, a cut link that drops packets) is detected
//! within [`crate::ClientConfig::stall`] rather than the client's 1 h
//! request limit. The time counts between bytes, not for the whole body,
//! so a slow link is never mistaken for a stall.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use kt_sync::SyncError;

use crate::error::ClientError;

fn stalled(url: &str, stall: Duration) -> ClientError {
    ClientError::Sync(SyncError::Stream(format!(
        "{url}: nothing received for {} (stalled; --stall-timeout or KT_STALL_TIMEOUT)",
        humantime::format_duration(stall)
    )))
}

/// Bytes of data-request bodies (manifests, batch streams, chunk ranges)
/// this process received, including those of requests that failed midway.
static RECEIVED: AtomicU64 = AtomicU64::new(0);

/// How many bytes this process's gets received from sources so far (every
/// client in the process together). Less the bytes the gets needed, it is
/// what failures made them fetch twice: benchmarks of recovery read it.
pub fn bytes_received() -> u64 {
    RECEIVED.load(Ordering::Relaxed)
}

/// Sends `call` and waits at most `stall` for its answer to start.
pub(crate) async fn send(
    call: kt_api::Call,
    stall: Duration,
) -> Result<reqwest::Response, ClientError> {
    let url = call.url().to_owned();
    match tokio::time::timeout(stall, call.send()).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(stalled(&url, stall)),
    }
}

/// The body of `resp` as a stream that fails once nothing arrived for
/// `stall`.
///
/// As with a timeout around each wait for the next frame, the time counts
/// from when the reader asks and nothing is there (a reader busy elsewhere
/// is never a stalled source), but the deadline is checked lazily: a wait
/// only notes when it began, and the one timer fires at most once per
/// `stall`, moved on if frames came meanwhile. A body of many frames thus
/// costs no timer work per frame.
pub(crate) fn body(
    resp: reqwest::Response,
    stall: Duration,
) -> impl Stream<Item = Result<Bytes, String>> + Unpin + Send {
    let url = resp.url().to_string();
    Watchdog::new(resp.bytes_stream(), url, stall)
}

/// A body stream and its stall deadline (see [`body`]).
struct Watchdog<S> {
    inner: Option<S>,
    url: String,
    stall: Duration,
    /// When the reader began waiting, if it is.
    since: Option<Instant>,
    /// Due `stall` after the current wait began, or earlier (then moved
    /// on when it fires); only polled while the body has nothing to give.
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<S> Watchdog<S> {
    fn new(inner: S, url: String, stall: Duration) -> Self {
        Watchdog {
            inner: Some(inner),
            url,
            stall,
            since: None,
            timer: Box::pin(tokio::time::sleep(stall)),
        }
    }
}

impl<S, E> Stream for Watchdog<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    type Item = Result<Bytes, String>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(b))) => {
                RECEIVED.fetch_add(b.len() as u64, Ordering::Relaxed);
                this.since = None;
                return Poll::Ready(Some(Ok(b)));
            }
            Poll::Ready(Some(Err(e))) => {
                this.inner = None;
                return Poll::Ready(Some(Err(format!("{}: {e}", this.url))));
            }
            Poll::Ready(None) => {
                this.inner = None;
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        // Nothing to give: the deadline counts from now on.
        let since = *this.since.get_or_insert_with(Instant::now);
        while this.timer.as_mut().poll(cx).is_ready() {
            let due = since + this.stall;
            if Instant::now() >= due {
                this.inner = None;
                return Poll::Ready(Some(Err(stalled(&this.url, this.stall).to_string())));
            }
            // Frames came since it was armed: due `stall` after this wait began.
            this.timer.as_mut().reset(due.into());
        }
        Poll::Pending
    }
}

/// A request body handed to the HTTP stack piece by piece, remembering
/// whether the stack holds a piece it has not come back for yet (it comes
/// back once the piece is on its way: a server that stops reading stops it).
struct Watched<S> {
    inner: S,
    clock: Arc<Clock>,
}

/// The state of an upload's body, in one word so that it is read whole:
/// [`DONE`], or the ms (since `start`) the last piece was handed over,
/// shifted left by one, with the low bit set while the stack holds it.
struct Clock {
    start: Instant,
    state: AtomicU64,
    /// Bytes handed over so far.
    bytes: AtomicU64,
}

const DONE: u64 = u64::MAX;

/// What may still be on its way once the whole body was handed over (the
/// HTTP stack's buffer and the socket's), at most.
const IN_FLIGHT: u64 = 8 << 20;
/// The rate at which that is assumed to drain, at the least (bytes/s):
/// buffers that large build up on fast links only (socket buffers grow
/// with the bandwidth-delay product).
const DRAIN_BPS: u64 = 1 << 20;

impl Clock {
    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
}

impl<S, E> Stream for Watched<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        // Asked for more: the last piece is on its way.
        let state = self.clock.state.load(Ordering::Relaxed);
        if state != DONE {
            self.clock.state.store(state & !1, Ordering::Relaxed);
        }
        let next = self.inner.poll_next_unpin(cx);
        match &next {
            std::task::Poll::Ready(Some(Ok(b))) => {
                self.clock
                    .bytes
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                let now = self.clock.now();
                self.clock.state.store((now << 1) | 1, Ordering::Relaxed);
            }
            std::task::Poll::Ready(_) => self.clock.state.store(DONE, Ordering::Relaxed),
            std::task::Poll::Pending => {}
        }
        next
    }
}

/// Uploads `body` with `call` and decodes the JSON answer, failing once the
/// server took nothing for `stall` (the HTTP stack held a piece that long:
/// pieces are at most [`UPLOAD_PIECE`], so a link slower than about
/// `UPLOAD_PIECE / stall` would count as stalled) or, the body sent, did
/// not answer within `stall` plus the time what may still be buffered takes
/// to drain (at [`DRAIN_BPS`]). The time a slow source of the body takes (a
/// disk) never counts.
pub(crate) async fn upload<T, S, E>(
    call: kt_api::Call,
    body: S,
    stall: Duration,
) -> Result<T, ClientError>
where
    T: serde::de::DeserializeOwned,
    S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let url = call.url().to_owned();
    let clock = Arc::new(Clock {
        start: Instant::now(),
        state: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
    });
    let watched = Watched {
        inner: sliced(body),
        clock: clock.clone(),
    };
    let mut sent: Option<(u64, u64)> = None;
    let request = call.body(reqwest::Body::wrap_stream(watched)).fetch::<T>();
    tokio::pin!(request);
    let stall_ms = stall.as_millis() as u64;
    let tick = (stall / 4).max(Duration::from_millis(5));
    loop {
        tokio::select! {
            r = request.as_mut() => return Ok(r?),
            _ = tokio::time::sleep(tick) => {}
        }
        let now = clock.now();
        let state = clock.state.load(Ordering::Relaxed);
        let (since, allowed) = if state == DONE {
            // The body is handed over: the answer is due once what may be
            // buffered had time to drain at the rate seen so far.
            *sent.get_or_insert_with(|| {
                let buffered = clock.bytes.load(Ordering::Relaxed).min(IN_FLIGHT);
                (now, stall_ms + buffered * 1000 / DRAIN_BPS)
            })
        } else if state & 1 == 1 {
            (state >> 1, stall_ms)
        } else {
            continue;
        };
        if now.saturating_sub(since) >= allowed {
            return Err(stalled(&url, stall));
        }
    }
}

/// Largest piece an upload hands the HTTP stack at once.
pub(crate) const UPLOAD_PIECE: usize = 256 << 10;

/// `body` with every item cut into pieces of at most [`UPLOAD_PIECE`].
fn sliced<S, E>(body: S) -> impl Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
    E: Send + 'static,
{
    body.flat_map(|item| {
        let parts: Vec<Result<Bytes, E>> = match item {
            Ok(b) => (0..b.len())
                .step_by(UPLOAD_PIECE)
                .map(|at| Ok(b.slice(at..(at + UPLOAD_PIECE).min(b.len()))))
                .collect(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(parts)
    })
}

/// Sends `call` and decodes its JSON answer, failing when none came within
/// `limit` (requests the server works on before it answers).
pub(crate) async fn answer<T: serde::de::DeserializeOwned>(
    call: kt_api::Call,
    limit: Duration,
) -> Result<T, ClientError> {
    let url = call.url().to_owned();
    match tokio::time::timeout(limit, call.fetch::<T>()).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ClientError::Sync(SyncError::Stream(format!(
            "{url}: no answer within {} (--deadline or KT_DEADLINE)",
            humantime::format_duration(limit)
        )))),
    }
}

/// Sends `call` and reads its whole answer, failing on a stall.
pub(crate) async fn bytes(call: kt_api::Call, stall: Duration) -> Result<Bytes, ClientError> {
    let resp = send(call, stall).await?;
    let mut out = BytesMut::with_capacity(resp.content_length().unwrap_or(0).min(1 << 30) as usize);
    let mut s = body(resp, stall);
    while let Some(b) = s.next().await {
        out.extend_from_slice(&b.map_err(|e| ClientError::Sync(SyncError::Stream(e)))?);
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that sends a response head and part of a body, then
    /// neither sends nor closes: a frozen source.
    async fn frozen_server() -> (String, tokio::task::JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf).await;
            let _ = c
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhello")
                .await;
            // Hold the connection open without a byte more.
            let _ = c.read(&mut buf).await;
        });
        (url, task)
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_fails_as_a_transient_stall() {
        let (url, task) = frozen_server().await;
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        let started = std::time::Instant::now();
        let before = bytes_received();
        let e = bytes(api.get("/x"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
        assert!(e.is_transient(), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        // What arrived before the stall counts as received.
        assert!(bytes_received() - before >= "hello".len() as u64);
        task.abort();
    }

    #[tokio::test]
    async fn an_answer_that_never_starts_fails_as_a_stall() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        // Accepted by the kernel's backlog, never answered.
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        let e = send(api.get("/x"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
        drop(l);
    }

    /// A server that reads the request head and `read` body bytes, then
    /// neither reads nor answers nor closes: a store frozen mid-upload.
    async fn frozen_reader(read: usize) -> (String, tokio::task::JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut left = read;
            let mut buf = vec![0u8; 64 << 10];
            while left > 0 {
                match c.read(&mut buf[..left.min(64 << 10)]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => left -= n,
                }
            }
            std::future::pending::<()>().await;
        });
        (url, task)
    }

    #[tokio::test]
    async fn an_upload_the_server_stops_reading_fails_as_a_transient_stall() {
        let (url, task) = frozen_reader(1 << 20).await;
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        // Far more than socket buffers hold.
        let body =
            futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from(vec![7u8; 64 << 20]))]);
        let started = std::time::Instant::now();
        let e = upload::<serde_json::Value, _, _>(api.put("/x"), body, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
        assert!(e.is_transient(), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        task.abort();
    }

    #[tokio::test]
    async fn an_upload_whose_answer_never_comes_fails_as_a_stall() {
        let size = 100 << 10;
        let (url, task) = frozen_reader(size + 200).await;
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        let body = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from(vec![7u8; size]))]);
        let e = upload::<serde_json::Value, _, _>(api.put("/x"), body, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
        task.abort();
    }

    #[tokio::test]
    async fn an_upload_from_a_slow_source_is_not_a_stall() {
        // The server answers once it has the whole body.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.ends_with(b"0\r\n\r\n") {
                let n = c.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\ntrue")
                .await
                .unwrap();
        });
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        // Each piece takes longer to produce than the stall timeout.
        let body = Box::pin(futures::stream::iter(0..3).then(|i| async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            Ok::<_, std::io::Error>(Bytes::from(vec![i as u8; 10]))
        }));
        let answer: serde_json::Value = upload(api.put("/x"), body, Duration::from_millis(100))
            .await
            .unwrap();
        assert_eq!(answer, serde_json::Value::Bool(true));
        task.abort();
    }

    #[tokio::test]
    async fn an_upload_over_a_slow_but_steady_link_is_not_a_stall() {
        // Reads at about 2 MiB/s, whatever each read returns, then answers.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut tail = Vec::new();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = c.read(&mut buf).await.unwrap();
                assert!(n > 0);
                tail.extend_from_slice(&buf[..n]);
                if tail.ends_with(b"0\r\n\r\n") {
                    break;
                }
                let keep = tail.len().saturating_sub(8);
                tail.drain(..keep);
                tokio::time::sleep(Duration::from_micros(n as u64 / 2)).await;
            }
            c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\ntrue")
                .await
                .unwrap();
        });
        let api = kt_api::Api::new(kt_api::client(), &url, "t");
        let body =
            futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from(vec![1u8; 4 << 20]))]);
        let answer: serde_json::Value = upload(api.put("/x"), body, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(answer, serde_json::Value::Bool(true));
        task.abort();
    }
}
