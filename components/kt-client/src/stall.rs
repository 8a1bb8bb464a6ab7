//! Progress timeouts for data requests: a source that neither answers nor
//! resets (a frozen process, a cut link that drops packets) is detected
//! within [`crate::ClientConfig::stall`] rather than the client's 1 h
//! request limit. The time counts between bytes, not for the whole body,
//! so a slow link is never mistaken for a stall.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
pub(crate) fn body(
    resp: reqwest::Response,
    stall: Duration,
) -> impl Stream<Item = Result<Bytes, String>> + Unpin + Send {
    let url = resp.url().to_string();
    let stream = resp.bytes_stream();
    Box::pin(futures::stream::unfold(Some(stream), move |state| {
        let url = url.clone();
        async move {
            let mut s = state?;
            match tokio::time::timeout(stall, s.next()).await {
                Ok(Some(Ok(b))) => {
                    RECEIVED.fetch_add(b.len() as u64, Ordering::Relaxed);
                    Some((Ok(b), Some(s)))
                }
                Ok(Some(Err(e))) => Some((Err(format!("{url}: {e}")), None)),
                Ok(None) => None,
                Err(_) => Some((Err(stalled(&url, stall).to_string()), None)),
            }
        }
    }))
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
        let api = kt_api::Api::new(reqwest::Client::new(), &url, "t");
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
        let api = kt_api::Api::new(reqwest::Client::new(), &url, "t");
        let e = send(api.get("/x"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
        drop(l);
    }
}
