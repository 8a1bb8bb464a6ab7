//! W3C Trace Context: the `traceparent` every call between kt's components
//! carries, so one operation's calls can be followed through the client,
//! the metadata server, the store, node agents and relays.
//!
//! A [`TraceParent`] is version `00`: a 16-byte trace id (the operation's),
//! an 8-byte parent id (the span of the caller that sent it) and the
//! sampled flag. The client starts one per operation ([`TraceParent::new`]);
//! a server reads the header of each request ([`TraceParent::parse`], which
//! accepts only a well-formed value), runs the request as a child
//! ([`TraceParent::child`]: same trace, its own span id) and carries that
//! on the calls it makes in turn.
//!
//! The trace of the running task is a task-local ([`scope`], [`current`]);
//! [`crate::Api`] adds it to every request (or the trace an `Api` was given
//! with [`crate::Api::traced`]). A task spawned while handling a request
//! keeps the trace only if wrapped in [`carry`].
//!
//! Cost: one header of 55 bytes per call; nothing per chunk.

use std::fmt;
use std::future::Future;

/// The header's name.
pub const HEADER: &str = "traceparent";

/// A `traceparent` of version `00`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: u128,
    span_id: u64,
    flags: u8,
}

/// A trace id: 32 lowercase hex digits when shown.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub u128);

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl TraceParent {
    /// Flag bit 0: the caller records this trace.
    pub const SAMPLED: u8 = 1;

    /// A new trace (random trace and span ids), sampled.
    pub fn new() -> TraceParent {
        TraceParent {
            trace_id: nonzero(|| {
                (u128::from(crate::random_u64()) << 64) | u128::from(crate::random_u64())
            }),
            span_id: nonzero(crate::random_u64),
            flags: Self::SAMPLED,
        }
    }

    /// A trace with these ids (an OpenTelemetry span's); `None` when either
    /// is zero (invalid in W3C Trace Context).
    pub fn from_parts(trace_id: u128, span_id: u64, sampled: bool) -> Option<TraceParent> {
        (trace_id != 0 && span_id != 0).then_some(TraceParent {
            trace_id,
            span_id,
            flags: u8::from(sampled),
        })
    }

    /// The same trace with a new span id: what a server runs a request as,
    /// and what it sends on the calls it makes for it.
    pub fn child(&self) -> TraceParent {
        TraceParent {
            span_id: nonzero(crate::random_u64),
            ..*self
        }
    }

    /// The same trace as the span `span_id`.
    pub fn with_span(&self, span_id: u64) -> TraceParent {
        TraceParent {
            span_id: if span_id == 0 { self.span_id } else { span_id },
            ..*self
        }
    }

    pub fn trace_id(&self) -> TraceId {
        TraceId(self.trace_id)
    }

    pub fn span_id(&self) -> u64 {
        self.span_id
    }

    pub fn sampled(&self) -> bool {
        self.flags & Self::SAMPLED != 0
    }

    /// A header value, or `None` unless it is well formed (W3C Trace
    /// Context, level 1): `00-<32 hex>-<16 hex>-<2 hex>`, lowercase, ids
    /// not all zero. A later version is read for its first four fields
    /// (and must then be followed by nothing or by `-`); version `ff` is
    /// invalid.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let b = value.as_bytes();
        if b.len() < 55 {
            return None;
        }
        let version = hex_field(&b[0..2])?;
        let well_cut = match version {
            0 => b.len() == 55,
            0xff => false,
            _ => b.len() == 55 || b[55] == b'-',
        };
        if !well_cut || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let trace_id = hex_field(&b[3..35])?;
        let span_id = u64::try_from(hex_field(&b[36..52])?).ok()?;
        let flags = u8::try_from(hex_field(&b[53..55])?).ok()?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }
}

impl Default for TraceParent {
    fn default() -> Self {
        Self::new()
    }
}

/// The header value.
impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Lowercase hex only (W3C: uppercase is invalid), at most 32 digits.
fn hex_field(b: &[u8]) -> Option<u128> {
    let mut v = 0u128;
    for &c in b {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        v = (v << 4) | u128::from(d);
    }
    Some(v)
}

fn nonzero<T: Default + PartialEq>(mut draw: impl FnMut() -> T) -> T {
    loop {
        let v = draw();
        if v != T::default() {
            return v;
        }
    }
}

tokio::task_local! {
    static CURRENT: Option<TraceParent>;
}

/// The trace of the running task, if it runs inside [`scope`].
pub fn current() -> Option<TraceParent> {
    CURRENT.try_with(|t| *t).ok().flatten()
}

/// Runs `fut` with `trace` as its task's trace ([`current`]).
pub async fn scope<F: Future>(trace: Option<TraceParent>, fut: F) -> F::Output {
    CURRENT.scope(trace, fut).await
}

/// Runs `f` (synchronous) with `trace` as the trace ([`current`]).
pub fn sync_scope<R>(trace: Option<TraceParent>, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(trace, f)
}

/// `fut` with the trace of the task that calls this (for `tokio::spawn`,
/// which starts a task without it).
pub fn carry<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(current(), fut)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_the_spec_example() {
        let t = TraceParent::parse(SAMPLE).unwrap();
        assert_eq!(t.to_string(), SAMPLE);
        assert_eq!(t.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_id(), 0x00f0_67aa_0ba9_02b7);
        assert!(t.sampled());
        assert!(
            !TraceParent::parse(&SAMPLE.replace("-01", "-00"))
                .unwrap()
                .sampled()
        );
    }

    #[test]
    fn refuses_what_is_not_well_formed() {
        let bad = [
            "",
            "00",
            // Uppercase, zero ids, version ff, wrong separators, length.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ];
        for b in bad {
            assert_eq!(TraceParent::parse(b), None, "{b:?}");
        }
        // A later version is read for its first fields.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        assert_eq!(
            TraceParent::parse(later).unwrap().to_string(),
            SAMPLE,
            "version 00 is what is sent on"
        );
    }

    #[test]
    fn new_traces_differ_and_children_keep_the_trace() {
        let a = TraceParent::new();
        let b = TraceParent::new();
        assert_ne!(a.trace_id(), b.trace_id());
        assert_eq!(TraceParent::parse(&a.to_string()), Some(a));
        let c = a.child();
        assert_eq!(c.trace_id(), a.trace_id());
        assert_ne!(c.span_id(), a.span_id());
        assert!(TraceParent::from_parts(0, 1, true).is_none());
    }

    #[tokio::test]
    async fn the_task_local_is_scoped_and_carried() {
        assert_eq!(current(), None);
        let t = TraceParent::new();
        let inner = scope(Some(t), async {
            let spawned = tokio::spawn(carry(async { current() }));
            let lost = tokio::spawn(async { current() });
            (current(), spawned.await.unwrap(), lost.await.unwrap())
        })
        .await;
        assert_eq!(inner, (Some(t), Some(t), None));
        assert_eq!(sync_scope(Some(t), current), Some(t));
    }
}
