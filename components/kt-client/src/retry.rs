//! Sources that failed a transfer, and when each may be tried again.
//!
//! A failure is **transient** when the source may well answer again soon:
//! it refused or reset the connection, stalled, or answered 5xx /
//! `unavailable` (a store or agent restarting, a link cut for a while).
//! It is **permanent** when the same source would fail the same way: a
//! wrong version, a hash mismatch, a key it does not hold, a refused token.
//! A peer's first answer that it holds another version than its lease
//! named, or none (`conflict`, `not_found`), is tried once more after a
//! backoff: a pod that puts a key locally registers the new version before
//! it serves it, so for a moment its agent answers so although it is the
//! key's origin, or the very source of the version the key moved on to
//! (the next lease names it). A second such answer from it is permanent.
//!
//! A transient source is tried again after a backoff with jitter (other
//! sources first, when there are any); a permanent one never is in this
//! transfer. The store, the durable origin, is transient for anything but
//! corrupt data: what it serves is checked against the metadata server's
//! record on every lease, so retrying it cannot serve a wrong version.
//! A transfer gives up once it has made no progress for its deadline
//! ([`crate::ClientConfig::deadline`]), and says which sources failed, how,
//! and for how long it waited.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kt_api::Backoff;
use kt_types::{ErrorCode, STORE_HOLDER};

use crate::error::ClientError;

/// First and longest wait before a failed source is tried again.
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl ClientError {
    /// True when the source that failed may answer again soon (see the
    /// module documentation). Local failures are never transient.
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Http { .. } => true,
            // `no_source` is an answer about the data (nothing serves the
            // key), not a server away.
            ClientError::Api { status, code, .. } => {
                // A full store stays full until someone frees room.
                !matches!(code, ErrorCode::NoSource | ErrorCode::InsufficientStorage)
                    && (*status >= 500
                        || matches!(
                            code,
                            ErrorCode::Unavailable | ErrorCode::NoStore | ErrorCode::Internal
                        ))
            }
            ClientError::Sync(e) => matches!(
                e,
                kt_sync::SyncError::Truncated | kt_sync::SyncError::Stream(_)
            ),
            ClientError::Manifest(_)
            | ClientError::Key(_)
            | ClientError::Agent(_)
            | ClientError::Local(_)
            | ClientError::Timeout { .. } => false,
        }
    }

    /// Whether `source` failing this way may be tried again later: a
    /// transient failure, or any answer of the store but corrupt data (a
    /// restarted store forgets read leases; a key it no longer holds or a
    /// version it moved past is caught by the next lease).
    pub fn retryable_at(&self, source: &str) -> bool {
        if self.is_transient() {
            return true;
        }
        source == STORE_HOLDER
            && matches!(
                self,
                ClientError::Api {
                    code: ErrorCode::NotFound | ErrorCode::Conflict,
                    ..
                }
            )
    }
}

#[derive(Debug)]
struct Failed {
    retryable: bool,
    /// It answered `conflict` or `not_found` before (its one more try
    /// for that is spent).
    answered_none: bool,
    first: Instant,
    tries: u32,
    retry_at: Instant,
    backoff: Backoff,
    error: String,
}

/// The sources one transfer saw fail, and its deadline.
#[derive(Debug)]
pub(crate) struct Failures {
    deadline: Duration,
    /// When the transfer last made progress (or started).
    progress: Instant,
    sources: BTreeMap<String, Failed>,
}

/// What the transfer should do after a source or the metadata server
/// failed it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Go on at once (another source may be there).
    Now,
    /// Wait this long, then go on.
    Wait(Duration),
    /// Give up: the deadline passed, or nothing is left to retry.
    GiveUp,
}

impl Failures {
    pub fn new(deadline: Duration) -> Failures {
        Failures {
            deadline,
            progress: Instant::now(),
            sources: BTreeMap::new(),
        }
    }

    /// The transfer made progress: its deadline starts again.
    pub fn progressed(&mut self) {
        self.progress = Instant::now();
    }

    /// `source` failed with `e`.
    pub fn record(&mut self, source: &str, e: &ClientError) {
        let now = Instant::now();
        let none = matches!(e.code(), Some(ErrorCode::Conflict | ErrorCode::NotFound));
        let seen = self.sources.get(source).is_some_and(|f| f.answered_none);
        let retryable = e.retryable_at(source) || (none && !seen);
        let f = self
            .sources
            .entry(source.to_owned())
            .or_insert_with(|| Failed {
                retryable,
                answered_none: false,
                first: now,
                tries: 0,
                retry_at: now,
                backoff: Backoff::new(BACKOFF_BASE, BACKOFF_MAX),
                error: String::new(),
            });
        f.retryable = f.retryable && retryable;
        f.answered_none |= none;
        f.tries += 1;
        f.retry_at = now + f.backoff.next_delay();
        f.error = e.to_string();
    }

    /// `source` served the transfer again: its backoff starts over.
    pub fn recovered(&mut self, source: &str) {
        self.sources.remove(source);
    }

    /// Sources not to lease now: the permanent ones, and the transient ones
    /// whose next try is not due yet.
    pub fn exclude(&self) -> Vec<String> {
        let now = Instant::now();
        self.sources
            .iter()
            .filter(|(_, f)| !f.retryable || f.retry_at > now)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Whether any source failed so far.
    pub fn any(&self) -> bool {
        !self.sources.is_empty()
    }

    fn expires_at(&self) -> Instant {
        self.progress + self.deadline
    }

    /// What to do when no source is left to lease now: the metadata server
    /// answered `no_source` to a request that excluded `excluded`. When that
    /// excluded no source worth a retry, the metadata server has none at all
    /// (the sources that failed are gone for it too): give up. Otherwise
    /// wait for the first transient source's next try, within the deadline.
    pub fn when_none_left(&self, excluded: &[String]) -> Next {
        let waiting = excluded
            .iter()
            .any(|id| self.sources.get(id).is_some_and(|f| f.retryable));
        if !waiting {
            return Next::GiveUp;
        }
        let now = Instant::now();
        let next = excluded
            .iter()
            .filter_map(|id| self.sources.get(id))
            .filter(|f| f.retryable)
            .map(|f| f.retry_at)
            .min();
        match next {
            None => Next::GiveUp,
            Some(_) if now >= self.expires_at() => Next::GiveUp,
            Some(at) if at <= now => Next::Now,
            Some(at) => Next::Wait(at.min(self.expires_at()) - now),
        }
    }

    /// What to do after the metadata server itself could not be reached
    /// or answered 5xx: back off within the deadline.
    pub fn when_metadata_failed(&self, backoff: &mut Backoff) -> Next {
        let now = Instant::now();
        if now >= self.expires_at() {
            return Next::GiveUp;
        }
        Next::Wait(backoff.next_delay().min(self.expires_at() - now))
    }

    /// Whether the deadline passed without progress.
    pub fn expired(&self) -> bool {
        Instant::now() >= self.expires_at()
    }

    /// How long the transfer has waited without progress.
    pub fn waited(&self) -> Duration {
        self.progress.elapsed()
    }

    /// Every failed source with how it failed, for the final error:
    /// `store: … (transient, 7 tries over 12.1s)`.
    pub fn describe(&self) -> String {
        let now = Instant::now();
        let parts: Vec<String> = self
            .sources
            .iter()
            .map(|(id, f)| {
                let kind = if f.retryable {
                    "transient"
                } else {
                    "permanent"
                };
                let tries = if f.tries == 1 { "try" } else { "tries" };
                format!(
                    "{id}: {} ({kind}, {} {tries} over {:.1}s)",
                    f.error,
                    f.tries,
                    now.duration_since(f.first).as_secs_f64()
                )
            })
            .collect();
        parts.join("; ")
    }

    /// The error a transfer ends with when it gives up.
    pub fn give_up(&self, what: &str, last: &str) -> ClientError {
        let waited = self.waited();
        let phase = crate::deadline::current()
            .map(|p| format!(" while {p}"))
            .unwrap_or_default();
        let deadline = if waited >= self.deadline {
            format!(
                "no progress for {:.1}s (deadline {}; --deadline or KT_DEADLINE)",
                waited.as_secs_f64(),
                humantime::format_duration(self.deadline)
            )
        } else {
            "no source is left to try".to_owned()
        };
        let failed = if self.sources.is_empty() {
            String::new()
        } else {
            format!("; sources that failed: {}", self.describe())
        };
        let last = if last.is_empty() {
            String::new()
        } else {
            format!("; {last}")
        };
        ClientError::Api {
            status: 503,
            code: ErrorCode::NoSource,
            message: format!("{what} failed{phase}: {deadline}{failed}{last}"),
        }
    }
}

/// Waits `d` (a [`Next::Wait`]).
pub(crate) async fn pause(d: Duration) {
    tokio::time::sleep(d).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(status: u16, code: ErrorCode) -> ClientError {
        ClientError::Api {
            status,
            code,
            message: "m".into(),
        }
    }

    #[test]
    fn transient_and_permanent() {
        assert!(api(503, ErrorCode::Unavailable).is_transient());
        assert!(api(500, ErrorCode::Internal).is_transient());
        assert!(ClientError::Sync(kt_sync::SyncError::Truncated).is_transient());
        assert!(!api(409, ErrorCode::Conflict).is_transient());
        assert!(!api(503, ErrorCode::NoSource).is_transient());
        assert!(!api(404, ErrorCode::NotFound).is_transient());
        assert!(!api(401, ErrorCode::Unauthorized).is_transient());
        let corrupt = ClientError::Sync(kt_sync::SyncError::HashMismatch { path: "a".into() });
        assert!(!corrupt.is_transient());
        assert!(!ClientError::Local("disk full".into()).is_transient());
        // The store: a forgotten lease or a moved version is retried.
        assert!(api(404, ErrorCode::NotFound).retryable_at(STORE_HOLDER));
        assert!(api(409, ErrorCode::Conflict).retryable_at(STORE_HOLDER));
        assert!(!api(404, ErrorCode::NotFound).retryable_at("pod-a"));
        assert!(!corrupt.retryable_at(STORE_HOLDER));
        assert!(!api(401, ErrorCode::Unauthorized).retryable_at(STORE_HOLDER));
    }

    #[test]
    fn permanent_sources_stay_excluded_transient_ones_come_back() {
        let mut f = Failures::new(Duration::from_secs(60));
        f.record("pod-a", &api(401, ErrorCode::Unauthorized));
        f.record(STORE_HOLDER, &api(503, ErrorCode::Unavailable));
        // Both excluded at once; the store's try is due within the backoff.
        let both = vec!["pod-a".to_owned(), STORE_HOLDER.to_owned()];
        assert_eq!(f.exclude(), both);
        match f.when_none_left(&both) {
            Next::Wait(d) => assert!(d <= BACKOFF_BASE, "{d:?}"),
            Next::Now => {}
            Next::GiveUp => panic!("the store is transient"),
        }
        std::thread::sleep(BACKOFF_BASE);
        assert_eq!(f.exclude(), vec!["pod-a".to_owned()]);
        assert_eq!(f.when_none_left(&both), Next::Now);
        // No source left even with the store asked for: it is gone for the
        // metadata server too.
        assert_eq!(f.when_none_left(&f.exclude()), Next::GiveUp);
        f.recovered(STORE_HOLDER);
        assert_eq!(f.exclude(), vec!["pod-a".to_owned()]);
        // Only a permanent failure left: nothing to wait for.
        assert_eq!(f.when_none_left(&both), Next::GiveUp);
    }

    /// The soak's local gets (seeds 359744192, 368456154, 97147130): the
    /// key's origin pod put it again mid-get and answered `conflict` to the
    /// old version's lease, or had registered the key and not served it yet
    /// (`not_found`); the getter excluded it for good and gave up with
    /// `no_source`, though the next lease would have named that pod.
    #[test]
    fn a_peers_first_conflict_or_not_found_is_tried_again_its_second_is_not() {
        let mut f = Failures::new(Duration::from_secs(60));
        let conflict = api(409, ErrorCode::Conflict);
        f.record("pod-a", &conflict);
        // Told to the metadata server as permanent (a peer that moved off
        // the version stops being offered for it) ...
        assert!(!conflict.retryable_at("pod-a"));
        // ... but this getter asks again after a backoff.
        let a = vec!["pod-a".to_owned()];
        assert_eq!(f.exclude(), a);
        match f.when_none_left(&a) {
            Next::Wait(d) => assert!(d <= BACKOFF_BASE, "{d:?}"),
            Next::Now => {}
            Next::GiveUp => panic!("a first conflict is tried again"),
        }
        std::thread::sleep(BACKOFF_BASE);
        assert!(f.exclude().is_empty());
        // The same answer again: this source holds another version for good.
        f.record("pod-a", &conflict);
        assert_eq!(f.exclude(), a);
        assert_eq!(f.when_none_left(&a), Next::GiveUp);
        // A transient failure in between does not buy a conflict another try.
        let mut g = Failures::new(Duration::from_secs(60));
        g.record("pod-b", &conflict);
        g.record("pod-b", &api(503, ErrorCode::Unavailable));
        g.record("pod-b", &conflict);
        assert_eq!(g.when_none_left(&["pod-b".to_owned()]), Next::GiveUp);
        // A key the peer does not hold: the same, once.
        let mut h = Failures::new(Duration::from_secs(60));
        let missing = api(404, ErrorCode::NotFound);
        h.record("pod-c", &missing);
        assert!(!missing.retryable_at("pod-c"));
        assert_ne!(h.when_none_left(&["pod-c".to_owned()]), Next::GiveUp);
        h.record("pod-c", &missing);
        assert_eq!(h.when_none_left(&["pod-c".to_owned()]), Next::GiveUp);
    }

    #[test]
    fn backoff_grows_and_the_deadline_ends_it() {
        let mut f = Failures::new(Duration::from_millis(50));
        for _ in 0..4 {
            f.record(STORE_HOLDER, &api(503, ErrorCode::Unavailable));
        }
        let all = f.exclude();
        let Next::Wait(d) = f.when_none_left(&all) else {
            panic!("a wait is due");
        };
        // The fourth backoff (up to 800 ms) is cut to the deadline.
        assert!(d <= Duration::from_millis(50), "{d:?}");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(f.when_none_left(&all), Next::GiveUp);
        let e = f.give_up("get of a/b", "the last lease: none");
        let msg = e.to_string();
        assert!(msg.contains("no progress for"), "{msg}");
        assert!(msg.contains("store: m"), "{msg}");
        assert!(msg.contains("transient, 4 tries"), "{msg}");
        // Progress restarts the clock.
        f.progressed();
        assert_ne!(f.when_none_left(&all), Next::GiveUp);
    }
}
