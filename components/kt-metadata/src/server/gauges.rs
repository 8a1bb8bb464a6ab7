//! What the registry holds, summed once per scrape or `GET /api/v1/status`
//! ([`ClusterStatus`]): keys and bytes by service and locale, agents by
//! service and liveness, leases by kind of source, broadcast groups and
//! members by state, quorums by state.
//!
//! Label cardinality: services are bounded per cluster (one per workload
//! service, the first segment of a key); past
//! [`kt_service::metrics::MAX_SERVICE_LABELS`] the rest are summed under
//! [`ServiceLabels::OVERFLOW`] (the one cap of `kt_service`). No key, pod or
//! agent id is ever a label.
//!
//! The registry's lock is held only to count keys and agents per distinct
//! service (one hash lookup a record); labels are bounded after it is
//! released. Teardowns
//! are counted by the request counter (`kt_http_requests_total{route=
//! "/api/v1/services/{name}",method="DELETE"}`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};

use axum::Json;
use axum::extract::State;
use kt_service::metrics::{Collect, ServiceLabels, Snapshot};
use kt_types::broadcast::MemberState;
use kt_types::status::{
    AgentCount, BroadcastSummary, ClusterStatus, LeaseCount, QuorumSummary, ServiceUsage,
};
use kt_types::{Locale, STORE_HOLDER};

use super::{AppState, Inner, now_ms};
use crate::quorum::Quorums;

/// Keys and bytes per service (`[store, local]`), agents per service
/// (`(live, stale)`).
type ByService<T> = BTreeMap<String, T>;
/// Keys and bytes per (service label, locale).
type Usage = BTreeMap<(String, &'static str), (u64, u64)>;

/// The counts per service under bounded labels ([`ServiceLabels`]), given
/// in name order so the same services keep their label from one scrape to
/// the next.
fn label(
    by_service: &ByService<[(u64, u64); 2]>,
    by_agent_service: &ByService<(u64, u64)>,
) -> (Usage, BTreeMap<String, (u64, u64)>) {
    let mut labels = ServiceLabels::default();
    let mut usage = Usage::new();
    for (service, counts) in by_service {
        let label = labels.label(service);
        for (locale, (keys, bytes)) in ["store", "local"].into_iter().zip(counts) {
            if *keys == 0 {
                continue;
            }
            let u = usage.entry((label.to_owned(), locale)).or_default();
            u.0 += keys;
            u.1 = u.1.saturating_add(*bytes);
        }
    }
    let mut agents: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (service, (live, stale)) in by_agent_service {
        let c = agents.entry(labels.label(service).to_owned()).or_default();
        c.0 += live;
        c.1 += stale;
    }
    (usage, agents)
}

/// `m` with its borrowed names copied (to release what they borrow).
fn owned<T>(m: HashMap<&str, T>) -> ByService<T> {
    m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// The summary of what `s` holds now (quorums from `quorums`).
pub(super) async fn summarize(s: &Inner, quorums: Option<&Quorums>) -> ClusterStatus {
    let now = now_ms();
    // Under the registry's lock: counts per distinct service, borrowed
    // names copied once each.
    let (by_service, by_agent_service) = {
        let registry = s.registry.lock().await;
        let mut records: HashMap<&str, [(u64, u64); 2]> = HashMap::new();
        for r in registry.all_records() {
            if registry.get(&r.key, now).is_none() {
                continue;
            }
            let locale = match r.locale {
                Locale::Store => 0,
                Locale::Local => 1,
            };
            let u = &mut records.entry(r.service.as_str()).or_default()[locale];
            u.0 += 1;
            u.1 = u.1.saturating_add(r.size);
        }
        let mut agents: HashMap<&str, (u64, u64)> = HashMap::new();
        for a in registry.known_agents() {
            let c = agents
                .entry(a.service.as_deref().unwrap_or(""))
                .or_default();
            if registry.is_live(&a.id, now) {
                c.0 += 1;
            } else {
                c.1 += 1;
            }
        }
        (owned(records), owned(agents))
    };
    let (usage, agents) = label(&by_service, &by_agent_service);
    let mut leases: BTreeMap<&'static str, u64> = [("store", 0), ("agent", 0)].into();
    for l in s.leases.lock().await.list(now) {
        let kind = if l.source == STORE_HOLDER {
            "store"
        } else {
            "agent"
        };
        *leases.entry(kind).or_default() += 1;
    }
    let broadcasts = {
        let b = s.broadcasts.lock().unwrap_or_else(|e| e.into_inner());
        b.groups()
            .iter()
            .map(|g| {
                let mut summary = BroadcastSummary {
                    group: g.id.clone(),
                    key: g.key.to_string(),
                    open: g.is_open(now),
                    ..BroadcastSummary::default()
                };
                for m in g.members() {
                    match m.state {
                        MemberState::Active => summary.active += 1,
                        MemberState::Done => summary.done += 1,
                        MemberState::Gone => summary.gone += 1,
                    }
                }
                summary
            })
            .collect()
    };
    let quorums = quorums
        .map(|q| {
            let c = q.counts();
            QuorumSummary {
                open: c.open as u64,
                transferring: c.transferring as u64,
                complete: c.complete as u64,
                failed: c.failed as u64,
            }
        })
        .unwrap_or_default();
    ClusterStatus {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        store_url: s.store_url.lock().await.clone(),
        usage: usage
            .into_iter()
            .map(|((service, locale), (keys, bytes))| ServiceUsage {
                service,
                locale: locale.to_owned(),
                keys,
                bytes,
            })
            .collect(),
        agents: agents
            .into_iter()
            .map(|(service, (live, stale))| AgentCount {
                service,
                live,
                stale,
            })
            .collect(),
        leases: leases
            .into_iter()
            .map(|(source, leases)| LeaseCount {
                source: source.to_owned(),
                leases,
            })
            .collect(),
        broadcasts,
        quorums,
    }
}

/// The gauges of a summary.
pub(super) fn gauges(st: &ClusterStatus) -> Snapshot {
    let mut snap = Snapshot::default();
    snap.describe("registry_keys", "Live keys, by owning service and locale");
    snap.describe(
        "registry_bytes",
        "Bytes of the live keys' current versions, by owning service and locale",
    );
    for u in &st.usage {
        let labels = [
            ("service", u.service.as_str()),
            ("locale", u.locale.as_str()),
        ];
        snap.gauge(
            "registry_keys",
            "Live keys, by owning service and locale",
            &labels,
            u.keys as f64,
        );
        snap.gauge(
            "registry_bytes",
            "Bytes of the live keys' current versions, by owning service and locale",
            &labels,
            u.bytes as f64,
        );
    }
    const AGENTS: &str = "Node agents known, by the service they announced and liveness (live: heard from within the agent TTL)";
    snap.describe("registry_agents", AGENTS);
    for a in &st.agents {
        for (state, n) in [("live", a.live), ("stale", a.stale)] {
            let labels = [("service", a.service.as_str()), ("state", state)];
            snap.gauge("registry_agents", AGENTS, &labels, n as f64);
        }
    }
    const LEASES: &str = "Read leases in flight (getters reading now), by kind of source";
    for l in &st.leases {
        snap.gauge(
            "leases",
            LEASES,
            &[("source", l.source.as_str())],
            l.leases as f64,
        );
    }
    const GROUPS: &str = "Broadcast groups held, by state (open: still taking joins)";
    const MEMBERS: &str = "Members of the broadcast groups held, by state";
    let open = st.broadcasts.iter().filter(|b| b.open).count();
    snap.gauge(
        "broadcast_groups",
        GROUPS,
        &[("state", "open")],
        open as f64,
    );
    let closed = st.broadcasts.len() - open;
    snap.gauge(
        "broadcast_groups",
        GROUPS,
        &[("state", "closed")],
        closed as f64,
    );
    let sum = |f: fn(&BroadcastSummary) -> u64| st.broadcasts.iter().map(f).sum::<u64>() as f64;
    snap.gauge(
        "broadcast_members",
        MEMBERS,
        &[("state", "active")],
        sum(|b| b.active),
    );
    snap.gauge(
        "broadcast_members",
        MEMBERS,
        &[("state", "done")],
        sum(|b| b.done),
    );
    snap.gauge(
        "broadcast_members",
        MEMBERS,
        &[("state", "gone")],
        sum(|b| b.gone),
    );
    const QUORUMS: &str = "GPU quorums, by state (complete and failed: transfers still kept)";
    let q = st.quorums;
    for (state, n) in [
        ("open", q.open),
        ("transferring", q.transferring),
        ("complete", q.complete),
        ("failed", q.failed),
    ] {
        snap.gauge("quorums", QUORUMS, &[("state", state)], n as f64);
    }
    snap
}

/// The registry's gauges, read at each scrape. Weak: the state holds the
/// metrics that hold this.
#[derive(Debug)]
pub(super) struct RegistryGauges {
    pub(super) state: Weak<Inner>,
    pub(super) quorums: Weak<Quorums>,
}

impl Collect for RegistryGauges {
    fn collect(&self) -> std::pin::Pin<Box<dyn Future<Output = Snapshot> + Send + '_>> {
        Box::pin(async move {
            let Some(state) = self.state.upgrade() else {
                return Snapshot::default();
            };
            let quorums = self.quorums.upgrade();
            gauges(&summarize(&state, quorums.as_deref()).await)
        })
    }
}

/// `GET /api/v1/status`: the summary (`kt status`).
pub(super) async fn status(
    State((s, quorums)): State<(AppState, Arc<Quorums>)>,
) -> Json<ClusterStatus> {
    Json(summarize(&s, Some(&quorums)).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the cap, services share the overflow label, which a real
    /// service named `other` does not fall into.
    #[test]
    fn services_past_the_cap_share_the_overflow_label() {
        use kt_service::metrics::MAX_SERVICE_LABELS;
        let mut by_service = ByService::new();
        for i in 0..MAX_SERVICE_LABELS {
            by_service.insert(format!("a{i:03}"), [(1, 10), (0, 0)]);
        }
        by_service.insert("other".into(), [(2, 20), (1, 5)]);
        by_service.insert("zz".into(), [(1, 1), (0, 0)]);
        let agents = ByService::from([("zzz".to_owned(), (1, 0))]);
        let (usage, agents) = label(&by_service, &agents);
        assert_eq!(usage[&("a000".to_owned(), "store")], (1, 10));
        assert!(!usage.contains_key(&("a000".to_owned(), "local")));
        let over = ServiceLabels::OVERFLOW.to_owned();
        assert_eq!(usage[&(over.clone(), "store")], (3, 21));
        assert_eq!(usage[&(over.clone(), "local")], (1, 5));
        assert!(!usage.keys().any(|(s, _)| s == "other"));
        assert_eq!(agents[&over], (1, 0));
    }

    #[test]
    fn a_summary_becomes_gauges_by_state() {
        let st = ClusterStatus {
            usage: vec![ServiceUsage {
                service: "team".into(),
                locale: "store".into(),
                keys: 2,
                bytes: 300,
            }],
            agents: vec![AgentCount {
                service: "svc".into(),
                live: 0,
                stale: 1,
            }],
            broadcasts: vec![BroadcastSummary {
                group: "g".into(),
                key: "team/k".into(),
                open: true,
                active: 2,
                done: 3,
                gone: 0,
            }],
            ..ClusterStatus::default()
        };
        let g = gauges(&st);
        let labels = [("service", "team"), ("locale", "store")];
        assert_eq!(g.value("registry_bytes", &labels), Some(300.0));
        let live = [("service", "svc"), ("state", "live")];
        assert_eq!(g.value("registry_agents", &live), Some(0.0));
        assert_eq!(
            g.value("broadcast_members", &[("state", "done")]),
            Some(3.0)
        );
        assert_eq!(
            g.value("broadcast_groups", &[("state", "closed")]),
            Some(0.0)
        );
        assert_eq!(g.value("quorums", &[("state", "open")]), Some(0.0));
    }
}
