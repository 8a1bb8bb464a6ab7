//! Prometheus metrics shared by the servers: requests, bytes in/out, transfer durations.

use std::sync::atomic::AtomicU64;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    pub kind: String,
}

/// Counters of one server. Tests read the byte counters directly.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    bytes_in: Counter<u64, AtomicU64>,
    bytes_out: Counter<u64, AtomicU64>,
    pub transfers: Family<TransferLabels, Histogram>,
    /// The process's peak resident set (VmHWM), read at each scrape.
    peak_resident: Gauge<u64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kt");
        let requests = Family::<RequestLabels, Counter>::default();
        let bytes_in = Counter::<u64, AtomicU64>::default();
        let bytes_out = Counter::<u64, AtomicU64>::default();
        let transfers = Family::<TransferLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 20))
        });
        registry.register("http_requests", "HTTP requests served", requests.clone());
        registry.register(
            "bytes_received",
            "File content bytes received",
            bytes_in.clone(),
        );
        registry.register("bytes_sent", "File content bytes sent", bytes_out.clone());
        registry.register(
            "transfer_duration_seconds",
            "Duration of whole transfers (puts, gets)",
            transfers.clone(),
        );
        let peak_resident = Gauge::<u64, AtomicU64>::default();
        registry.register(
            "process_peak_resident_bytes",
            "Peak resident memory of this process (VmHWM)",
            peak_resident.clone(),
        );
        Metrics {
            registry,
            requests,
            bytes_in,
            bytes_out,
            transfers,
            peak_resident,
        }
    }

    /// The shared metrics and a server's own: `register` adds them to the
    /// same registry (names get the `kt_` prefix), encoded on `/metrics`.
    pub fn with(register: impl FnOnce(&mut Registry)) -> Self {
        let mut m = Self::new();
        register(&mut m.registry);
        m
    }

    pub fn add_bytes_in(&self, n: u64) {
        self.bytes_in.inc_by(n);
    }
    pub fn add_bytes_out(&self, n: u64) {
        self.bytes_out.inc_by(n);
    }
    pub fn bytes_in(&self) -> u64 {
        self.bytes_in.get()
    }
    pub fn bytes_out(&self) -> u64 {
        self.bytes_out.get()
    }
    pub fn observe_transfer(&self, kind: &str, secs: f64) {
        self.transfers
            .get_or_create(&TransferLabels {
                kind: kind.to_owned(),
            })
            .observe(secs);
    }

    pub fn encode(&self) -> String {
        if let Some(bytes) = peak_resident_bytes() {
            self.peak_resident.set(bytes);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// VmHWM of /proc/self/status, in bytes (None off Linux).
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub async fn serve_metrics(State(m): State<Arc<Metrics>>) -> Response {
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
        .into_response()
}

pub async fn count_requests(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let resp = next.run(req).await;
    m.requests
        .get_or_create(&RequestLabels {
            method,
            route,
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_counters() {
        let m = Metrics::new();
        m.add_bytes_in(10);
        m.add_bytes_out(3);
        m.observe_transfer("put", 0.5);
        let text = m.encode();
        assert!(text.contains("kt_bytes_received_total 10"), "{text}");
        assert!(text.contains("kt_bytes_sent_total 3"), "{text}");
        assert!(
            text.contains("kt_transfer_duration_seconds_count{kind=\"put\"} 1"),
            "{text}"
        );
        if cfg!(target_os = "linux") {
            let peak = metric_value(&text, "kt_process_peak_resident_bytes");
            assert!(peak.is_some_and(|b| b > 1024.0 * 1024.0), "{text}");
        }
    }

    fn metric_value(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }
}
