//! `kt status`: one screen of what the cluster holds and does — servers and
//! versions, agents, keys and bytes by service, transfers in flight with
//! their rate — or the same as JSON (`-o json`).
//!
//! The metadata server's summary (`GET /api/v1/status`) says what is held;
//! the store's `/metrics`, read twice `interval` apart, says its version,
//! disk, uploads and reads open, and the bytes it moves per second. A store
//! that cannot be read is reported, not fatal.

use std::time::{Duration, Instant};

use kt_types::paths;
use kt_types::status::{ClusterStatus, Samples};
use serde::{Deserialize, Serialize};

use crate::{Client, ClientError};

/// What `kt status` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The metadata server's summary.
    pub metadata: ClusterStatus,
    /// The store, read from its `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreStatus>,
    /// Why the store could not be read, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_error: Option<String>,
}

/// The store as its metrics show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoreStatus {
    pub url: String,
    pub version: Option<String>,
    pub disk_free_bytes: Option<u64>,
    pub disk_size_bytes: Option<u64>,
    /// Uploads in progress.
    pub put_sessions: u64,
    /// Reads (leases) open on the store.
    pub read_leases: u64,
    /// Bytes per second sent (gets) and received (puts) over the interval.
    pub sent_bytes_per_second: f64,
    pub received_bytes_per_second: f64,
}

impl Client {
    /// The metadata server's summary ([`ClusterStatus`]; admin only).
    pub async fn cluster_status(&self) -> Result<ClusterStatus, ClientError> {
        self.ask_meta(
            || "status".to_owned(),
            self.cfg.stall,
            |m| m.get(&paths::status()),
        )
        .await
    }

    /// The summary and the store's figures, its rates over `interval`.
    pub async fn status(&self, interval: Duration) -> Result<StatusReport, ClientError> {
        let metadata = self.cluster_status().await?;
        let (store, store_error) = match &metadata.store_url {
            None => (None, Some("no store has registered".to_owned())),
            Some(url) => match self.store_status(url, interval).await {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e.to_string())),
            },
        };
        Ok(StatusReport {
            metadata,
            store,
            store_error,
        })
    }

    async fn store_status(
        &self,
        url: &str,
        interval: Duration,
    ) -> Result<StoreStatus, ClientError> {
        let api = self.server(url)?;
        let read = || async {
            let text = api.get("/metrics").timeout(self.cfg.stall).bytes().await?;
            Ok::<_, ClientError>((
                Instant::now(),
                Samples::parse(&String::from_utf8_lossy(&text)),
            ))
        };
        let (t0, first) = read().await?;
        tokio::time::sleep(interval).await;
        let (t1, now) = read().await?;
        let secs = t1.duration_since(t0).as_secs_f64().max(1e-3);
        let rate = |name: &str| ((now.sum(name) - first.sum(name)) / secs).max(0.0);
        let gauge = |name: &str| now.has(name).then(|| now.sum(name) as u64);
        Ok(StoreStatus {
            url: url.to_owned(),
            version: now.label("kt_build_info", "version").map(str::to_owned),
            disk_free_bytes: gauge("kt_store_disk_free_bytes"),
            disk_size_bytes: gauge("kt_store_disk_size_bytes"),
            put_sessions: gauge("kt_store_put_sessions").unwrap_or(0),
            read_leases: gauge("kt_read_leases").unwrap_or(0),
            sent_bytes_per_second: rate("kt_bytes_sent_total"),
            received_bytes_per_second: rate("kt_bytes_received_total"),
        })
    }
}

/// The report as one screen of text (byte counts as [`kt_types::size::human`]).
pub fn render(r: &StatusReport) -> String {
    use kt_types::size::human as human_bytes;
    let m = &r.metadata;
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!("metadata    version {}", m.version));
    match (&r.store, &r.store_error) {
        (Some(s), _) => {
            let disk = match (s.disk_free_bytes, s.disk_size_bytes) {
                (Some(free), Some(size)) if size > 0 => format!(
                    ", disk {} free of {} ({:.0}% used)",
                    human_bytes(free),
                    human_bytes(size),
                    100.0 * (size - free.min(size)) as f64 / size as f64
                ),
                _ => String::new(),
            };
            line(format!(
                "store       {} version {}{disk}",
                s.url,
                s.version.as_deref().unwrap_or("?")
            ));
        }
        (None, e) => line(format!(
            "store       {} (not read: {})",
            m.store_url.as_deref().unwrap_or("-"),
            e.as_deref().unwrap_or("unknown")
        )),
    }
    let (live, stale) = m
        .agents
        .iter()
        .fold((0, 0), |(l, s), a| (l + a.live, s + a.stale));
    let by_service: Vec<String> = m
        .agents
        .iter()
        .map(|a| {
            let name = if a.service.is_empty() {
                "(no service)"
            } else {
                &a.service
            };
            format!("{name} {}/{}", a.live, a.live + a.stale)
        })
        .collect();
    let detail = if by_service.is_empty() {
        String::new()
    } else {
        format!(" — live/known by service: {}", by_service.join(", "))
    };
    line(format!("agents      {live} live, {stale} stale{detail}"));
    let leases: Vec<String> = m
        .leases
        .iter()
        .map(|l| format!("{} from the {}", l.leases, l.source))
        .collect();
    let rates = r.store.as_ref().map_or(String::new(), |s| {
        format!(
            "; store sending {}/s, receiving {}/s, {} upload(s) open",
            human_bytes(s.sent_bytes_per_second as u64),
            human_bytes(s.received_bytes_per_second as u64),
            s.put_sessions
        )
    });
    line(format!("transfers   reads: {}{rates}", leases.join(", ")));
    let q = m.quorums;
    line(format!(
        "quorums     {} open, {} transferring, {} complete, {} failed",
        q.open, q.transferring, q.complete, q.failed
    ));
    line(String::new());
    line(format!(
        "{:<24} {:<7} {:>8} {:>12}",
        "SERVICE", "LOCALE", "KEYS", "BYTES"
    ));
    for u in &m.usage {
        line(format!(
            "{:<24} {:<7} {:>8} {:>12}",
            u.service,
            u.locale,
            u.keys,
            human_bytes(u.bytes)
        ));
    }
    if !m.broadcasts.is_empty() {
        line(String::new());
        line(format!(
            "{:<24} {:<32} {:<6} {:>6} {:>6} {:>6}",
            "BROADCAST", "KEY", "OPEN", "ACTIVE", "DONE", "GONE"
        ));
        for b in &m.broadcasts {
            line(format!(
                "{:<24} {:<32} {:<6} {:>6} {:>6} {:>6}",
                b.group,
                b.key,
                if b.open { "yes" } else { "no" },
                b.active,
                b.done,
                b.gone
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use kt_types::status::{AgentCount, LeaseCount, ServiceUsage};

    use super::*;

    #[test]
    fn one_screen_names_servers_agents_keys_and_rates() {
        let r = StatusReport {
            metadata: ClusterStatus {
                version: "0.1.0".into(),
                store_url: Some("http://s:1".into()),
                usage: vec![ServiceUsage {
                    service: "team".into(),
                    locale: "store".into(),
                    keys: 3,
                    bytes: 2048,
                }],
                agents: vec![AgentCount {
                    service: "svc".into(),
                    live: 2,
                    stale: 1,
                }],
                leases: vec![LeaseCount {
                    source: "store".into(),
                    leases: 1,
                }],
                ..ClusterStatus::default()
            },
            store: Some(StoreStatus {
                url: "http://s:1".into(),
                version: Some("0.1.0".into()),
                disk_free_bytes: Some(25),
                disk_size_bytes: Some(100),
                put_sessions: 0,
                read_leases: 1,
                sent_bytes_per_second: 4096.0,
                received_bytes_per_second: 0.0,
            }),
            store_error: None,
        };
        let text = render(&r);
        assert!(
            text.contains(
                "store       http://s:1 version 0.1.0, disk 25 B free of 100 B (75% used)"
            ),
            "{text}"
        );
        assert!(
            text.contains("agents      2 live, 1 stale — live/known by service: svc 2/3"),
            "{text}"
        );
        assert!(
            text.contains("reads: 1 from the store; store sending 4.00 KiB/s"),
            "{text}"
        );
        assert!(text.contains("team"), "{text}");
        let json = serde_json::to_string(&r).unwrap();
        let back: StatusReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
    }
}
