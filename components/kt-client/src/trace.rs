//! One traced operation of the client (a put, a get, an `ls`, a tensor
//! call): a new W3C trace ([`kt_api::trace`]) that every call it makes
//! carries (metadata server, store, sources, the node agent's control
//! socket), a span naming its `trace_id` for the client's own log lines,
//! and a `debug` line when it ends.

use std::future::Future;
use std::time::Instant;

pub use kt_api::trace::TraceParent;
use tracing::Instrument;

/// Runs `fut` as operation `op` of trace `trace`: calls made from its task
/// carry it (spawned tasks too where they use a [`crate::Client`] made
/// with [`crate::Client::traced`]).
pub fn operation<F: Future>(
    op: &str,
    trace: TraceParent,
    fut: F,
) -> impl Future<Output = F::Output> + use<F> {
    // At error level, so that the default filter (`warn`) keeps it and
    // the warnings logged inside it carry the trace id.
    let span = tracing::error_span!("op", op, trace_id = %trace.trace_id());
    async move {
        let started = Instant::now();
        let out = kt_api::trace::scope(Some(trace), fut)
            .instrument(span.clone())
            .await;
        span.in_scope(|| {
            tracing::debug!(elapsed_ms = started.elapsed().as_secs_f64() * 1e3, "done");
        });
        out
    }
}
