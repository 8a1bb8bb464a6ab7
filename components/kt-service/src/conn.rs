//! The connections a server keeps: each one served by hyper's HTTP/1
//! with a clock, so a request's head has [`Conns::head`] to arrive (and a
//! kept-alive connection may wait that long for its next request), and at
//! most [`Conns::max_open`] open at once. A client that opens connections
//! and never finishes a request head (slowloris) or never sends one holds
//! each for at most `head`, and past the cap a new connection is closed at
//! accept: the server's memory and descriptors stay bounded without a
//! token ever being checked. (axum's own `serve` sets no timer, and hyper
//! then drops its header timeout: such connections were held forever.)
//!
//! Invariants: a connection's slot is held by its task and freed when the
//! task ends, however it ends; on shutdown the listener closes first,
//! open connections finish their request in flight (keep-alive ends), and
//! connections still open after the drain are aborted.

use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Default of [`Conns::head`]: longer than a kt client keeps an idle
/// pooled connection ([`kt_api::POOL_IDLE`]), so the client, not
/// the server, ends an idle one (no request races a server's close).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(60);

/// Default of [`Conns::max_open`]: far above what a cluster's pods keep
/// open to one server (a few pooled connections each), small enough that
/// that many stalled connections fit in a pod's memory.
pub const MAX_OPEN: usize = 4096;

/// What a server allows each connection: see the module docs.
#[derive(Debug, Clone, Copy)]
pub struct Conns {
    /// How long a request head may take to arrive, counted from when the
    /// connection is ready for one (accepted, or its last response sent).
    pub head: Duration,
    /// Connections open at once; past it a new one is closed at accept.
    pub max_open: usize,
}

impl Default for Conns {
    fn default() -> Self {
        Conns {
            head: HEAD_TIMEOUT,
            max_open: MAX_OPEN,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` fires, then lets open
/// connections finish for at most `drain` (see the module docs).
pub(crate) async fn serve_on<L>(
    mut listener: L,
    app: Router,
    shutdown: CancellationToken,
    drain: Duration,
    conns: Conns,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
    L::Io: Unpin,
{
    let open = std::sync::Arc::new(Semaphore::new(conns.max_open.max(1)));
    let mut tasks = JoinSet::new();
    let mut refused: u64 = 0;
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        while tasks.try_join_next().is_some() {}
        let Ok(slot) = open.clone().try_acquire_owned() else {
            // One line per power of two: a flood is visible, not a log storm.
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    ?peer,
                    refused,
                    max_open = conns.max_open,
                    "connection closed at accept: this server has its most connections open"
                );
            }
            drop(io);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let _slot = slot;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(conns.head);
            let conn = http
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            tokio::pin!(conn);
            let served = tokio::select! {
                served = conn.as_mut() => served,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(?peer, "connection ended: {e}");
            }
        });
    }
    drop(listener);
    let drained =
        tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            ?drain,
            open = tasks.len(),
            "in-flight requests did not finish in time; aborting them"
        );
        tasks.abort_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    async fn server(conns: Conns) -> (std::net::SocketAddr, CancellationToken) {
        let app = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve_on(
            listener,
            app,
            stop.clone(),
            Duration::from_secs(1),
            conns,
        ));
        (addr, stop)
    }

    /// Reads until the server closes the connection, within `bound`.
    async fn closed_within(s: &mut TcpStream, bound: Duration) -> Vec<u8> {
        let mut got = Vec::new();
        tokio::time::timeout(bound, s.read_to_end(&mut got))
            .await
            .expect("the server closes the connection")
            .ok();
        got
    }

    async fn health(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        String::from_utf8_lossy(&closed_within(&mut s, Duration::from_secs(30)).await).into_owned()
    }

    #[tokio::test]
    async fn an_unfinished_request_head_is_closed_after_the_head_timeout() {
        let (addr, stop) = server(Conns {
            head: Duration::from_millis(200),
            max_open: 16,
        })
        .await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: aaa")
            .await
            .unwrap();
        closed_within(&mut s, Duration::from_secs(30)).await;
        // A connection that sends nothing at all goes the same way.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        closed_within(&mut idle, Duration::from_secs(30)).await;
        assert!(health(addr).await.ends_with("ok"));
        stop.cancel();
    }

    #[tokio::test]
    async fn past_the_cap_a_connection_is_closed_at_accept_and_freed_slots_serve_again() {
        let (addr, stop) = server(Conns {
            head: Duration::from_secs(600),
            max_open: 2,
        })
        .await;
        // Two stalled heads take both slots.
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
            stalled.push(s);
        }
        // The server may not have accepted them yet: a third connection is
        // closed without an answer once both are held.
        let refused = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let mut s = TcpStream::connect(addr).await.unwrap();
                let _ = s
                    .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                    .await;
                let got = closed_within(&mut s, Duration::from_secs(30)).await;
                if got.is_empty() {
                    return;
                }
            }
        })
        .await;
        assert!(refused.is_ok(), "a third connection was never refused");
        drop(stalled);
        // Their slots come back once the server sees them closed.
        let answered = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if health(addr).await.ends_with("ok") {
                    return;
                }
            }
        })
        .await;
        assert!(answered.is_ok(), "the freed slots never served again");
        stop.cancel();
    }
}
