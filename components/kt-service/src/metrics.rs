//! Prometheus metrics shared by the servers: requests and their latency per
//! route ([`crate::route_metrics`]), bytes in/out, transfer durations, the
//! build's version, and gauges a server reads from its state at each scrape
//! ([`Collect`]).
//!
//! `/metrics` answers in the Prometheus text format (0.0.4), whose HELP and
//! TYPE lines name a counter as its samples do (`kt_x_total`), so that
//! `promtool check metrics` finds help for every sample; a scraper that asks
//! for OpenMetrics (`Accept: application/openmetrics-text`) gets that.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::header::{ACCEPT, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

/// The latency histogram's labels: no status (one series per route).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub method: String,
    pub route: String,
}

/// The `direction` label of `kt_service_bytes_total`.
const RECEIVED: &str = "received";
const SENT: &str = "sent";
const SERVICE_DIRECTIONS: [&str; 2] = [RECEIVED, SENT];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceBytesLabels {
    direction: &'static str,
    service: String,
}

/// Most owning services given a label of their own at once; the rest
/// share [`ServiceLabels::OVERFLOW`] until a label is released
/// ([`LABEL_IDLE`]).
pub const MAX_SERVICE_LABELS: usize = 200;

/// Most labels taken from key segments ([`service_of_key`]: a guess any
/// writer picks) at once, a pool of their own: guesses never crowd out
/// the services a server resolved.
pub const MAX_GUESSED_LABELS: usize = 200;

/// How long a label must go uncounted before a new name may take its
/// place in a full pool: long past any scrape interval, so the evicted
/// series' last value has been scraped before it is removed. Services
/// come and go (every training job is one); a long-lived server's labels
/// follow those that move bytes now, not the first ever seen.
pub const LABEL_IDLE: std::time::Duration = std::time::Duration::from_secs(10 * 60);

/// One pool of labels: each name and when it was last counted.
#[derive(Debug, Clone)]
struct Pool {
    cap: usize,
    last_used: std::collections::HashMap<String, std::time::Instant>,
    /// No name was last counted before this (a lower bound on every
    /// `last_used`, which only move later; `None`: unknown): while `now -
    /// idle` is before it, a full pool has nothing to release and is not
    /// scanned.
    oldest: Option<std::time::Instant>,
}

impl Pool {
    fn new(cap: usize) -> Self {
        Pool {
            cap,
            last_used: Default::default(),
            oldest: None,
        }
    }

    /// Counts `name` now if it holds a label.
    fn touch(&mut self, name: &str, now: std::time::Instant) -> bool {
        match self.last_used.get_mut(name) {
            Some(t) => {
                *t = (*t).max(now);
                true
            }
            None => false,
        }
    }

    /// Gives `name` a label: a free one, else the least recently counted,
    /// if it has been idle for `idle` (returned, as `Some(evicted)`).
    /// `Err(())`: the pool is full of names counted within `idle`.
    fn admit(
        &mut self,
        name: &str,
        now: std::time::Instant,
        idle: std::time::Duration,
    ) -> Result<Option<String>, ()> {
        let mut evicted = None;
        if self.last_used.len() >= self.cap {
            let horizon = now.checked_sub(idle).ok_or(())?;
            if self.oldest.is_some_and(|o| o > horizon) {
                return Err(());
            }
            let (lru, at) = self
                .last_used
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(n, t)| (n.clone(), *t))
                .ok_or(())?;
            if at > horizon {
                self.oldest = Some(at);
                return Err(());
            }
            self.last_used.remove(&lru);
            // The next oldest is not known without a scan.
            self.oldest = None;
            evicted = Some(lru);
        }
        if self.last_used.is_empty() {
            self.oldest = Some(now);
        }
        self.last_used.insert(name.to_owned(), now);
        Ok(evicted)
    }
}

/// What [`ServiceLabels::label_at`] gave: the label, and the name whose
/// label was released to make room (its series are to be removed).
#[derive(Debug, PartialEq, Eq)]
pub struct Labelled<'a> {
    pub label: &'a str,
    pub released: Option<String>,
}

/// The values a `service` label takes: an owning service
/// ([`ServiceLabels::label`]) or a key segment
/// ([`ServiceLabels::label_guessed`]) keeps its name while its pool
/// ([`MAX_SERVICE_LABELS`], [`MAX_GUESSED_LABELS`]) has room, or once
/// the pool's least recently counted name has been idle for
/// [`LABEL_IDLE`] (its label is released: the caller removes its
/// series); otherwise it shares [`ServiceLabels::OVERFLOW`]. So the
/// labels follow the services moving bytes now, at most
/// `MAX_SERVICE_LABELS + MAX_GUESSED_LABELS + 1` of them. The one cap
/// every server's service labels go through (the store's and agents'
/// byte counters, the metadata server's registry gauges, which label
/// afresh at each scrape what its registry holds then).
#[derive(Debug, Clone)]
pub struct ServiceLabels {
    owners: Pool,
    guessed: Pool,
    idle: std::time::Duration,
}

impl Default for ServiceLabels {
    fn default() -> Self {
        Self::with_idle(LABEL_IDLE)
    }
}

impl ServiceLabels {
    /// The label past the cap (and of bytes no service is known for): not
    /// a valid key segment, so no real service shares it.
    pub const OVERFLOW: &'static str = "(other)";

    /// Labels released after `idle` uncounted (instead of [`LABEL_IDLE`]).
    pub fn with_idle(idle: std::time::Duration) -> Self {
        ServiceLabels {
            owners: Pool::new(MAX_SERVICE_LABELS),
            guessed: Pool::new(MAX_GUESSED_LABELS),
            idle,
        }
    }

    /// The label of `service`, an owning service the server resolved,
    /// counted now (a label released for it is dropped: for a caller that
    /// keeps no series of its own).
    pub fn label<'a>(&mut self, service: &'a str) -> &'a str {
        self.label_at(Owner::Resolved(service), std::time::Instant::now())
            .label
    }

    /// The label of `segment`, a key's first segment taken for its
    /// service (any writer picks it), counted now; a known owning
    /// service's keeps its label.
    pub fn label_guessed<'a>(&mut self, segment: &'a str) -> &'a str {
        self.label_at(Owner::Guessed(segment), std::time::Instant::now())
            .label
    }

    /// The label of `owner` counted at `now`, and the name whose label
    /// was released for it.
    pub fn label_at<'a>(&mut self, owner: Owner<'a>, now: std::time::Instant) -> Labelled<'a> {
        let (name, pool, other) = match owner {
            Owner::Resolved(s) => (s, &mut self.owners, &mut self.guessed),
            Owner::Guessed(s) => (s, &mut self.guessed, &mut self.owners),
        };
        let kept = |label| Labelled {
            label,
            released: None,
        };
        if name == Self::OVERFLOW || pool.touch(name, now) || other.touch(name, now) {
            return kept(name);
        }
        match pool.admit(name, now, self.idle) {
            Ok(released) => Labelled {
                label: name,
                released,
            },
            Err(()) => kept(Self::OVERFLOW),
        }
    }

    /// The names holding a label now.
    pub fn len(&self) -> usize {
        self.owners.last_used.len() + self.guessed.last_used.len()
    }

    /// No name holds a label.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The service a key's bytes are counted under when the caller has no
/// owning service at hand: the key's first segment, or
/// [`ServiceLabels::OVERFLOW`] for a key of one segment (its whole name,
/// which is never a label).
pub fn service_of_key(key: &kt_types::Key) -> &str {
    match key.as_str().split_once('/') {
        Some((first, _)) => first,
        None => ServiceLabels::OVERFLOW,
    }
}

/// Whose bytes: a service the server resolved, or a key segment.
#[derive(Clone, Copy, Debug)]
pub enum Owner<'a> {
    Resolved(&'a str),
    Guessed(&'a str),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    pub kind: String,
}

/// Counters of one server. Tests read the byte counters directly.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    /// Request durations per route, to the end of the response body.
    pub durations: Family<RouteLabels, Histogram>,
    /// The server's gauges read at scrape time (see [`Metrics::attach`]).
    collectors: std::sync::RwLock<Vec<Arc<dyn Collect>>>,
    bytes_in: Counter<u64, AtomicU64>,
    bytes_out: Counter<u64, AtomicU64>,
    /// The same bytes by the service that owns the key (resolved by the
    /// server, else guessed from its first segment).
    service_bytes: Family<ServiceBytesLabels, Counter>,
    /// The services holding a label of their own now.
    services: std::sync::Mutex<ServiceLabels>,
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
        registry.register(
            "http_requests",
            "HTTP requests served, by method, route template and status",
            requests.clone(),
        );
        let durations = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(crate::route_metrics::latency_buckets())
        });
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's arrival to the end of its response body, by method and route template",
            durations.clone(),
        );
        registry.register(
            "build",
            "The version of the kt server answering",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            }),
        );
        registry.register(
            "bytes_received",
            "File content bytes received",
            bytes_in.clone(),
        );
        registry.register("bytes_sent", "File content bytes sent", bytes_out.clone());
        let service_bytes = Family::<ServiceBytesLabels, Counter>::default();
        registry.register(
            "service_bytes",
            "File content bytes moved, by direction (sent, received) and the service owning the key",
            service_bytes.clone(),
        );
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
            durations,
            collectors: std::sync::RwLock::new(Vec::new()),
            bytes_in,
            bytes_out,
            service_bytes,
            services: Default::default(),
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
    /// [`Metrics::add_bytes_in`], counted for `key`'s owning service too:
    /// `owner` when the server resolved it, else a guess from the key
    /// ([`service_of_key`], in the pool of guesses).
    pub fn add_bytes_in_for(&self, key: &kt_types::Key, owner: Option<&str>, n: u64) {
        self.add_bytes_in(n);
        self.add_service_bytes(RECEIVED, Self::service_label(key, owner), n);
    }
    /// [`Metrics::add_bytes_out`], counted for `key`'s owning service too
    /// (as [`Metrics::add_bytes_in_for`]).
    pub fn add_bytes_out_for(&self, key: &kt_types::Key, owner: Option<&str>, n: u64) {
        self.add_bytes_out(n);
        self.add_service_bytes(SENT, Self::service_label(key, owner), n);
    }
    /// [`Metrics::add_bytes_in`], counted for `service` (the owning
    /// service the put resolved) too.
    pub fn add_bytes_in_for_service(&self, service: &str, n: u64) {
        self.add_bytes_in(n);
        self.add_service_bytes(RECEIVED, Owner::Resolved(service), n);
    }
    /// [`Metrics::add_bytes_out`], counted for `service` (the owning
    /// service the read resolved) too.
    pub fn add_bytes_out_for_service(&self, service: &str, n: u64) {
        self.add_bytes_out(n);
        self.add_service_bytes(SENT, Owner::Resolved(service), n);
    }
    fn service_label<'a>(key: &'a kt_types::Key, owner: Option<&'a str>) -> Owner<'a> {
        match owner {
            Some(service) => Owner::Resolved(service),
            None => Owner::Guessed(service_of_key(key)),
        }
    }
    fn add_service_bytes(&self, direction: &'static str, owner: Owner<'_>, n: u64) {
        self.add_service_bytes_at(direction, owner, n, std::time::Instant::now());
    }
    /// Counts `n` bytes for `owner` at `now`; a label released for it
    /// takes its series with it. Under the labels' lock throughout, so a
    /// series is never created for a name whose label was just released.
    fn add_service_bytes_at(
        &self,
        direction: &'static str,
        owner: Owner<'_>,
        n: u64,
        now: std::time::Instant,
    ) {
        let mut labels = self.services.lock().unwrap_or_else(|e| e.into_inner());
        let Labelled { label, released } = labels.label_at(owner, now);
        if let Some(gone) = released {
            for direction in SERVICE_DIRECTIONS {
                self.service_bytes.remove(&ServiceBytesLabels {
                    direction,
                    service: gone.clone(),
                });
            }
        }
        self.service_bytes
            .get_or_create(&ServiceBytesLabels {
                direction,
                service: label.to_owned(),
            })
            .inc_by(n);
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

    /// Adds gauges read at each scrape (a server's state). A collector
    /// that holds the server's state should hold it weakly: the state
    /// holds these metrics.
    pub fn attach(&self, collector: Arc<dyn Collect>) {
        self.collectors
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(collector);
    }

    /// The registry's metrics (not the attached collectors') in the
    /// Prometheus text format.
    pub fn encode(&self) -> String {
        crate::exposition::to_prometheus_text(&self.encode_openmetrics(&[]))
    }

    /// Everything, the attached collectors' gauges read now, in the format
    /// asked for.
    pub async fn scrape(&self, openmetrics: bool) -> String {
        let collectors = self
            .collectors
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut snapshots = Vec::with_capacity(collectors.len());
        for c in collectors {
            snapshots.push(c.collect().await);
        }
        let text = self.encode_openmetrics(&snapshots);
        if openmetrics {
            text
        } else {
            crate::exposition::to_prometheus_text(&text)
        }
    }

    fn encode_openmetrics(&self, snapshots: &[Snapshot]) -> String {
        use prometheus_client::encoding::text;
        if let Some(bytes) = peak_resident_bytes() {
            self.peak_resident.set(bytes);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = text::encode_registry(&mut out, &self.registry);
        for s in snapshots {
            let mut r = Registry::with_prefix("kt");
            r.register_collector(Box::new(s.clone()));
            let _ = text::encode_registry(&mut out, &r);
        }
        let _ = text::encode_eof(&mut out);
        out
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// A server's gauges read from its state at each scrape.
pub trait Collect: Send + Sync + 'static {
    fn collect(&self) -> Pin<Box<dyn Future<Output = Snapshot> + Send + '_>>;
}

/// One sample: its labels (bounded: services, locales, states, never keys
/// or pod names) and value.
type Sample = (Vec<(&'static str, String)>, f64);

/// Gauges (and counters kept by the state) read at one scrape, in the order
/// first named; names get the `kt_` prefix.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    families: Vec<SnapshotFamily>,
}

#[derive(Clone, Debug)]
struct SnapshotFamily {
    name: &'static str,
    help: &'static str,
    counter: bool,
    samples: Vec<Sample>,
}

impl Snapshot {
    /// Adds a sample of gauge `name` (a family with no samples is still
    /// described: call with `labels` and a value per label set).
    pub fn gauge(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
        value: f64,
    ) {
        self.add(name, help, false, labels, value);
    }

    /// Adds a sample of counter `name` (`_total` is appended).
    pub fn counter(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
        value: f64,
    ) {
        self.add(name, help, true, labels, value);
    }

    /// Describes gauge `name` with no samples yet (a family whose label
    /// sets are all absent now, e.g. no broadcast in flight).
    pub fn describe(&mut self, name: &'static str, help: &'static str) {
        self.family(name, help, false);
    }

    fn family(
        &mut self,
        name: &'static str,
        help: &'static str,
        counter: bool,
    ) -> &mut SnapshotFamily {
        let at = match self.families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.families.push(SnapshotFamily {
                    name,
                    help,
                    counter,
                    samples: Vec::new(),
                });
                self.families.len() - 1
            }
        };
        &mut self.families[at]
    }

    fn add(
        &mut self,
        name: &'static str,
        help: &'static str,
        counter: bool,
        labels: &[(&'static str, &str)],
        value: f64,
    ) {
        let labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        self.family(name, help, counter)
            .samples
            .push((labels, value));
    }

    /// The value of `name`'s sample with exactly `labels` (tests).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let f = self.families.iter().find(|f| f.name == name)?;
        f.samples.iter().find_map(|(l, v)| {
            let same = l.len() == labels.len()
                && l.iter()
                    .zip(labels)
                    .all(|((k, v), (k2, v2))| k == k2 && v == v2);
            same.then_some(*v)
        })
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.families {
            let kind = if f.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut family = encoder.encode_descriptor(f.name, f.help, None, kind)?;
            for (labels, value) in &f.samples {
                let sample = family.encode_family(labels)?;
                if f.counter {
                    ConstCounter::new(*value).encode(sample)?;
                } else {
                    ConstGauge::new(*value).encode(sample)?;
                }
            }
        }
        Ok(())
    }
}

/// VmHWM of /proc/self/status, in bytes (None off Linux).
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `/metrics`: OpenMetrics when the scraper asks for it, the Prometheus
/// text format otherwise.
pub async fn serve_metrics(State(m): State<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let content_type = if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    ([(CONTENT_TYPE, content_type)], m.scrape(openmetrics).await).into_response()
}

pub use crate::route_metrics::count_requests;

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

    /// The first `MAX_SERVICE_LABELS` services keep their name; later
    /// ones share the overflow label, which no key segment can be.
    #[test]
    fn service_labels_are_capped() {
        let mut labels = ServiceLabels::default();
        for i in 0..MAX_SERVICE_LABELS {
            let s = format!("s{i}");
            assert_eq!(labels.label(&s), s);
        }
        assert_eq!(labels.label("s0"), "s0");
        assert_eq!(labels.label("late"), ServiceLabels::OVERFLOW);
        assert_eq!(labels.label("other"), ServiceLabels::OVERFLOW);
        assert!(kt_types::Key::parse(ServiceLabels::OVERFLOW).is_err());
    }

    /// Key segments (which any writer picks) take their own pool: after
    /// more guesses than fit, an owning service seen only now still gets
    /// its label, and a guess that is a known service keeps it.
    #[test]
    fn guessed_labels_never_crowd_out_owning_services() {
        let mut labels = ServiceLabels::default();
        assert_eq!(labels.label("train"), "train");
        for i in 0..MAX_GUESSED_LABELS + 10 {
            let s = format!("junk{i}");
            let want = if i < MAX_GUESSED_LABELS {
                s.as_str()
            } else {
                ServiceLabels::OVERFLOW
            };
            assert_eq!(labels.label_guessed(&s), want);
        }
        assert_eq!(labels.label_guessed("train"), "train");
        assert_eq!(labels.label("eval"), "eval");
        assert_eq!(labels.label_guessed("eval"), "eval");
        assert_eq!(labels.label("junk0"), "junk0");

        let m = Metrics::new();
        for i in 0..MAX_GUESSED_LABELS + 5 {
            let key = kt_types::Key::parse(&format!("zz{i}/x")).unwrap();
            m.add_bytes_in_for(&key, None, 1);
        }
        let key = kt_types::Key::parse("zzz/x").unwrap();
        m.add_bytes_in_for(&key, Some("a"), 9);
        let text = m.encode();
        assert!(text.contains("service=\"a\"} 9"), "{text}");
        assert!(!text.contains("service=\"zzz\""), "{text}");
        assert!(text.contains("service=\"(other)\"} 5"), "{text}");
    }

    /// Every training job is a service: 300 created and torn down in
    /// turn (each counted, then never again) each get a label of their
    /// own, the 300th too, while the labels held stay within the cap.
    #[test]
    fn churned_services_keep_labels_of_their_own() {
        let mut labels = ServiceLabels::default();
        let t0 = std::time::Instant::now();
        let mut released = 0;
        for i in 0..300u32 {
            let now = t0 + LABEL_IDLE * i;
            let s = format!("job{i}");
            let got = labels.label_at(Owner::Resolved(&s), now);
            assert_eq!(got.label, s, "service {i}");
            released += usize::from(got.released.is_some());
            assert!(labels.len() <= MAX_SERVICE_LABELS, "{}", labels.len());
        }
        assert_eq!(labels.len(), MAX_SERVICE_LABELS);
        assert_eq!(released, 300 - MAX_SERVICE_LABELS);
    }

    /// A full pool of services counted within `LABEL_IDLE` keeps its
    /// labels (a newcomer shares the overflow label: no series thrash);
    /// once the least recently counted has idled that long, the
    /// newcomer takes its label, and that one only.
    #[test]
    fn only_an_idle_label_is_released() {
        let idle = std::time::Duration::from_secs(60);
        let mut labels = ServiceLabels::with_idle(idle);
        let t0 = std::time::Instant::now() + idle;
        let second = std::time::Duration::from_secs(1);
        for i in 0..MAX_SERVICE_LABELS as u32 {
            let s = format!("s{i}");
            assert_eq!(
                labels.label_at(Owner::Resolved(&s), t0 + second * i).label,
                s
            );
        }
        let last = t0 + second * (MAX_SERVICE_LABELS as u32);
        // s0 is counted again: s1 is now the least recently counted.
        assert_eq!(labels.label_at(Owner::Resolved("s0"), last).label, "s0");
        let early = labels.label_at(Owner::Resolved("new"), t0 + idle);
        assert_eq!(early.label, ServiceLabels::OVERFLOW);
        assert_eq!(early.released, None);
        let later = labels.label_at(Owner::Resolved("new"), t0 + second + idle);
        assert_eq!(later.label, "new");
        assert_eq!(later.released.as_deref(), Some("s1"));
        let next = labels.label_at(Owner::Resolved("newer"), t0 + second + idle);
        assert_eq!(next.label, ServiceLabels::OVERFLOW);
        assert_eq!(labels.len(), MAX_SERVICE_LABELS);
        // A writer's junk segments fill only the guessed pool, and are
        // released in turn when they idle.
        for i in 0..MAX_GUESSED_LABELS as u32 + 1 {
            let s = format!("junk{i}");
            let want = if (i as usize) < MAX_GUESSED_LABELS {
                s.as_str()
            } else {
                ServiceLabels::OVERFLOW
            };
            assert_eq!(labels.label_at(Owner::Guessed(&s), last).label, want);
        }
        let fresh = labels.label_at(Owner::Guessed("team"), last + idle);
        assert_eq!(fresh.label, "team");
        assert!(fresh.released.is_some_and(|j| j.starts_with("junk")));
        assert_eq!(labels.len(), MAX_SERVICE_LABELS + MAX_GUESSED_LABELS);
    }

    /// The byte counters of 300 services in turn: each counted under its
    /// own label, a released label's series removed, so the series stay
    /// bounded and the 300th service has its own.
    #[test]
    fn released_labels_take_their_series_with_them() {
        let m = Metrics::new();
        let t0 = std::time::Instant::now();
        for i in 0..300u32 {
            let now = t0 + LABEL_IDLE * i;
            let s = format!("job{i}");
            m.add_service_bytes_at(RECEIVED, Owner::Resolved(&s), 2, now);
            m.add_service_bytes_at(SENT, Owner::Resolved(&s), 1, now);
        }
        let text = m.encode();
        let series = text
            .lines()
            .filter(|l| l.starts_with("kt_service_bytes_total{"))
            .count();
        assert_eq!(series, 2 * MAX_SERVICE_LABELS, "{text}");
        assert!(
            text.contains("kt_service_bytes_total{direction=\"received\",service=\"job299\"} 2"),
            "{text}"
        );
        assert!(!text.contains("service=\"job99\""), "{text}");
        assert!(!text.contains("(other)"), "{text}");
        assert_eq!(m.bytes_in(), 0, "only the labelled counters were counted");
    }

    /// A key of one segment never puts its name in a label; bytes are
    /// counted under the service given.
    #[test]
    fn service_bytes_are_labelled_by_service_never_by_key() {
        let m = Metrics::new();
        m.add_bytes_in_for(&kt_types::Key::parse("secretname").unwrap(), None, 5);
        m.add_bytes_in_for(&kt_types::Key::parse("team/a/b").unwrap(), None, 7);
        m.add_bytes_out_for_service("train", 3);
        let text = m.encode();
        assert!(!text.contains("secretname"), "{text}");
        assert!(text.contains("service=\"(other)\"} 5"), "{text}");
        assert!(text.contains("service=\"team\"} 7"), "{text}");
        assert!(text.contains("service=\"train\"} 3"), "{text}");
    }

    fn metric_value(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }
}
