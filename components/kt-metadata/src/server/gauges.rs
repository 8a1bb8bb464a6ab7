//! What the registry holds, summed once per scrape or `GET /api/v1/status`
//! ([`ClusterStatus`]): keys and bytes by service and locale, agents by
//! service and liveness, leases by kind of source, broadcast groups and
//! members by state, quorums by state.
//!
//! Label cardinality: services are bounded per cluster (one per workload
//! service, the first segment of a key); past [`MAX_SERVICES`] the rest are
//! summed under `other`. No key, pod or agent id is ever a label. Teardowns
//! are counted by the request counter (`kt_http_requests_total{route=
//! "/api/v1/services/{name}",method="DELETE"}`).

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use axum::Json;
use axum::extract::State;
use kt_service::metrics::{Collect, Snapshot};
use kt_types::broadcast::MemberState;
use kt_types::status::{
    AgentCount, BroadcastSummary, ClusterStatus, LeaseCount, QuorumSummary, ServiceUsage,
};
use kt_types::{Locale, STORE_HOLDER};

use super::{AppState, Inner, now_ms};
use crate::quorum::Quorums;

/// Most services given a label of their own; the rest are `other`.
pub const MAX_SERVICES: usize = 200;

/// The label of `service` among those seen so far (`other` past the cap).
fn bounded<'a>(seen: &mut Vec<String>, service: &'a str) -> &'a str {
    if seen.iter().any(|s| s == service) {
        return service;
    }
    if seen.len() < MAX_SERVICES {
        seen.push(service.to_owned());
        return service;
    }
    "other"
}

/// The summary of what `s` holds now (quorums from `quorums`).
pub(super) async fn summarize(s: &Inner, quorums: Option<&Quorums>) -> ClusterStatus {
    let now = now_ms();
    let mut seen = Vec::new();
    let mut usage: BTreeMap<(String, &'static str), (u64, u64)> = BTreeMap::new();
    let mut agents: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    {
        let registry = s.registry.lock().await;
        for r in registry.all_records() {
            if registry.get(&r.key, now).is_none() {
                continue;
            }
            let locale = match r.locale {
                Locale::Store => "store",
                Locale::Local => "local",
            };
            let service = bounded(&mut seen, &r.service).to_owned();
            let u = usage.entry((service, locale)).or_default();
            u.0 += 1;
            u.1 += r.size;
        }
        for a in registry.known_agents() {
            let service = bounded(&mut seen, a.service.as_deref().unwrap_or("")).to_owned();
            let c = agents.entry(service).or_default();
            if registry.is_live(&a.id, now) {
                c.0 += 1;
            } else {
                c.1 += 1;
            }
        }
    }
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

    #[test]
    fn services_past_the_cap_are_other() {
        let mut seen = Vec::new();
        for i in 0..MAX_SERVICES {
            assert_eq!(bounded(&mut seen, &format!("s{i}")), format!("s{i}"));
        }
        assert_eq!(bounded(&mut seen, "s0"), "s0");
        assert_eq!(bounded(&mut seen, "late"), "other");
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
