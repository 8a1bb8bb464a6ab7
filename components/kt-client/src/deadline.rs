//! Every wait of a call bounded, and a timeout that says what ran out.
//!
//! A call is bounded three ways:
//!
//! - **First contact** ([`ClientConfig::connect_timeout`], default 4 s):
//!   until the metadata server has answered once in this call, its failures
//!   (refused, no route, DNS, a connect that times out, an answer that does
//!   not come within the stall timeout) are retried only until this long
//!   after the call began; then the call fails naming the URL tried and the
//!   cause ([`Phase::Connecting`]). A stopped metadata server fails a call
//!   in seconds, not after the deadline.
//! - **No progress** ([`ClientConfig::deadline`], default 5 min): once it
//!   was reached, transient failures (a store restarting, a source away)
//!   are waited out until the transfer has made no progress for this long;
//!   a data request that receives nothing for [`ClientConfig::stall`]
//!   counts as failed. A long transfer that keeps moving is never cut.
//! - **Overall** ([`ClientConfig::call_timeout`], none by default; what a
//!   Python call's `timeout=` sets through [`Client::with_timeout`]): the
//!   call ends when it runs out, whatever it is doing.
//!
//! The error of each names the [`Phase`] the call was in.
//!
//! [`ClientConfig::connect_timeout`]: crate::ClientConfig::connect_timeout
//! [`ClientConfig::deadline`]: crate::ClientConfig::deadline
//! [`ClientConfig::stall`]: crate::ClientConfig::stall
//! [`ClientConfig::call_timeout`]: crate::ClientConfig::call_timeout
//! [`Client::with_timeout`]: crate::Client::with_timeout

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use kt_api::Backoff;

use crate::error::ClientError;

/// What a call was doing, as its timeout errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Reaching the metadata server for the first time in the call.
    Connecting = 0,
    /// Asking the metadata server (listing, deleting, looking a key up).
    Asking,
    /// Waiting for a source of the key to lease.
    WaitingForSource,
    /// Moving data.
    Transferring,
    /// Publishing a put (the store's commit).
    Committing,
    /// Waiting for a broadcast's quorum or its parent.
    WaitingForQuorum,
    /// Waiting for the pod's node agent.
    WaitingForAgent,
}

impl Phase {
    const ALL: [Phase; 7] = [
        Phase::Connecting,
        Phase::Asking,
        Phase::WaitingForSource,
        Phase::Transferring,
        Phase::Committing,
        Phase::WaitingForQuorum,
        Phase::WaitingForAgent,
    ];
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Connecting => "connecting to the metadata server",
            Phase::Asking => "waiting for the metadata server's answer",
            Phase::WaitingForSource => "waiting for a source",
            Phase::Transferring => "transferring",
            Phase::Committing => "committing",
            Phase::WaitingForQuorum => "waiting for the broadcast's quorum",
            Phase::WaitingForAgent => "waiting for the node agent",
        })
    }
}

tokio::task_local! {
    /// The phase of the call this task runs (see [`track`]).
    static PHASE: Arc<AtomicU8>;
}

/// The call running on this task is now in `phase` (nothing outside a
/// [`track`]ed call).
pub(crate) fn enter(phase: Phase) {
    let _ = PHASE.try_with(|p| p.store(phase as u8, Ordering::Relaxed));
}

/// The phase of the call running on this task, if it is tracked.
pub(crate) fn current() -> Option<Phase> {
    PHASE
        .try_with(|p| Phase::ALL.get(p.load(Ordering::Relaxed) as usize).copied())
        .ok()
        .flatten()
}

/// Runs the call `fut` (`what`: "get of a/b"), its phase tracked, ended
/// after `limit` when one is given with an error naming the phase it was
/// in. A call inside another tracked call keeps the outer one's phase.
pub(crate) async fn track<T>(
    limit: Option<Duration>,
    what: impl FnOnce() -> String,
    fut: impl Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    if PHASE.try_with(|_| ()).is_ok() {
        return match limit {
            None => fut.await,
            Some(l) => match tokio::time::timeout(l, fut).await {
                Ok(r) => r,
                Err(_) => Err(timed_out(&what(), l, current())),
            },
        };
    }
    let phase = Arc::new(AtomicU8::new(Phase::Connecting as u8));
    let scoped = PHASE.scope(phase.clone(), fut);
    match limit {
        None => scoped.await,
        Some(l) => match tokio::time::timeout(l, scoped).await {
            Ok(r) => r,
            Err(_) => {
                let at = Phase::ALL.get(phase.load(Ordering::Relaxed) as usize);
                Err(timed_out(&what(), l, at.copied()))
            }
        },
    }
}

fn timed_out(what: &str, limit: Duration, phase: Option<Phase>) -> ClientError {
    let phase = phase.unwrap_or(Phase::Connecting);
    ClientError::Timeout {
        phase,
        message: format!(
            "{what} timed out after {} while {phase} (the call's timeout)",
            humantime::format_duration(limit)
        ),
    }
}

/// The innermost cause of `e` (for a connection that failed: "Connection
/// refused (os error 111)", "dns error: ..."), or `e` itself.
pub(crate) fn root_cause(e: &ClientError) -> String {
    if let ClientError::Http { source, .. } = e {
        if source.is_timeout() {
            return "timed out".to_owned();
        }
        let mut inner: &dyn std::error::Error = source;
        while let Some(next) = inner.source() {
            inner = next;
        }
        return inner.to_string();
    }
    e.to_string()
}

/// Whether `e` is an answer of the metadata server itself: an API error,
/// but not a 502-504 `unavailable` (what a proxy or port-forward before a
/// server that is away answers).
pub(crate) fn answered(e: &ClientError) -> bool {
    match e {
        ClientError::Api { status, code, .. } => {
            !(matches!(status, 502..=504) && *code == kt_types::ErrorCode::Unavailable)
        }
        _ => false,
    }
}

/// The first contact of one call with its metadata server: how long it
/// may keep failing before the call gives up.
#[derive(Debug)]
pub(crate) struct FirstContact {
    url: String,
    started: Instant,
    budget: Duration,
    backoff: Backoff,
    tries: u32,
}

/// First and longest wait between tries at a metadata server not reached yet.
const CONTACT_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));

impl FirstContact {
    /// Starts counting now: the metadata server at `url` may fail for `budget`.
    pub fn new(url: &str, budget: Duration) -> FirstContact {
        enter(Phase::Connecting);
        FirstContact {
            url: url.to_owned(),
            started: Instant::now(),
            budget,
            backoff: Backoff::new(CONTACT_BACKOFF.0, CONTACT_BACKOFF.1),
            tries: 0,
        }
    }

    /// A request to the metadata server, which never answered before in
    /// this call, failed with `e`: `Ok` after the wait before the next
    /// try, or the error that ends the call. An answer of the server's
    /// ([`answered`]) is returned as it is: the server was reached, and
    /// the caller deals with what it said. A transient failure to get one
    /// (refused, reset, timed out, a proxy saying the server is away) is
    /// tried again until the budget is spent, then fails naming the URL
    /// and the cause.
    pub async fn failed(&mut self, e: ClientError) -> Result<(), ClientError> {
        if answered(&e) || !e.is_transient() {
            self.tries += 1;
            return Err(e);
        }
        self.unanswered(e).await
    }

    /// [`FirstContact::failed`] for a failure that is never an answer of
    /// the server's (a WebSocket that did not open): tried again within
    /// the budget whatever it was.
    pub async fn unanswered(&mut self, e: ClientError) -> Result<(), ClientError> {
        self.tries += 1;
        let left = self.budget.saturating_sub(self.started.elapsed());
        if left.is_zero() {
            return Err(self.unreachable(&e));
        }
        tracing::debug!(url = %self.url, error = %e, "the metadata server is not reached yet");
        tokio::time::sleep(self.backoff.next_delay().min(left)).await;
        Ok(())
    }

    fn unreachable(&self, e: &ClientError) -> ClientError {
        let tries = if self.tries == 1 { "try" } else { "tries" };
        ClientError::Timeout {
            phase: Phase::Connecting,
            message: format!(
                "cannot reach the metadata server at {} ({}): {}; {} {tries} over {:.1}s \
                 (connect timeout {}: --connect-timeout or KT_CONNECT_TIMEOUT)",
                self.url,
                Phase::Connecting,
                root_cause(e),
                self.tries,
                self.started.elapsed().as_secs_f64(),
                humantime::format_duration(self.budget),
            ),
        }
    }
}

/// `call` tried until the metadata server answers it (see
/// [`FirstContact`]); its answer, or why there was none.
pub(crate) async fn first_contact<T, F, Fut>(
    url: &str,
    budget: Duration,
    mut call: F,
) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let mut contact = FirstContact::new(url, budget);
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) => contact.failed(e).await?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::ErrorCode;

    #[tokio::test]
    async fn the_phase_is_named_when_the_call_times_out() {
        let e = track(
            Some(Duration::from_millis(20)),
            || "get of a/b".into(),
            async {
                enter(Phase::Transferring);
                std::future::pending::<Result<(), ClientError>>().await
            },
        )
        .await
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("get of a/b timed out after 20ms while transferring"),
            "{msg}"
        );
        assert_eq!(e.timed_out_in(), Some(Phase::Transferring));
        // Nested: the inner call reports the outer call's phase.
        let r = track(None, || "outer".into(), async {
            enter(Phase::Committing);
            track(Some(Duration::from_millis(10)), || "inner".into(), async {
                std::future::pending::<Result<(), ClientError>>().await
            })
            .await
        })
        .await;
        assert!(r.unwrap_err().to_string().contains("while committing"));
        assert_eq!(current(), None, "outside a call no phase is tracked");
    }

    #[tokio::test]
    async fn a_permanent_failure_ends_the_first_contact_at_once() {
        let mut c = FirstContact::new("http://m", Duration::from_secs(60));
        let e = ClientError::Api {
            status: 401,
            code: ErrorCode::Unauthorized,
            message: "bad token".into(),
        };
        let got = c.failed(e).await.unwrap_err();
        assert_eq!(got.code(), Some(ErrorCode::Unauthorized));
        // So is any answer of the server's, 503 too: it was reached.
        let e = ClientError::Api {
            status: 503,
            code: ErrorCode::NoStore,
            message: "no store yet".into(),
        };
        assert_eq!(
            c.failed(e).await.unwrap_err().code(),
            Some(ErrorCode::NoStore)
        );
        // But not a proxy's word that the server is away.
        let away = || ClientError::Api {
            status: 503,
            code: ErrorCode::Unavailable,
            message: "upstream connect error".into(),
        };
        assert!(!answered(&away()));
        // No answer: tried again within the budget, then an error that
        // names the URL and the cause.
        let mut c = FirstContact::new("http://m", Duration::from_millis(30));
        let stalled = || ClientError::Sync(kt_sync::SyncError::Stream("no answer in 20s".into()));
        c.failed(stalled()).await.unwrap();
        let mut last = Ok(());
        for _ in 0..100 {
            last = c.failed(stalled()).await;
            if last.is_err() {
                break;
            }
        }
        let e = last.unwrap_err();
        assert_eq!(e.timed_out_in(), Some(Phase::Connecting));
        let msg = e.to_string();
        assert!(
            msg.contains("cannot reach the metadata server at http://m"),
            "{msg}"
        );
        assert!(msg.contains("no answer in 20s"), "{msg}");
    }
}
