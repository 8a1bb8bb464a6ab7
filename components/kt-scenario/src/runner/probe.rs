//! The runner's own requests to the testbed: metrics, readiness, the
//! metadata server's API and state.

use std::time::Duration;

use futures::StreamExt as _;
use serde_json::{Value, json};

use super::{Scn, StepError};
use crate::format::MetricsStep;
use crate::target::Component;

impl Scn<'_> {
    /// A broadcast group as the metadata server has it.
    pub(super) async fn group_info(
        &self,
        group: &str,
    ) -> Result<kt_types::broadcast::GroupInfo, StepError> {
        self.meta_json(&kt_types::paths::broadcast(group)).await
    }

    /// The metadata server, through kt's client of its API.
    fn meta(&self) -> kt_api::Api {
        kt_api::Api::new(self.http.clone(), &self.target.metadata_url(), &self.token)
    }

    /// `GET` of `path` (from `kt_types::paths`) at the metadata server, as
    /// JSON.
    pub(super) async fn meta_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<T, StepError> {
        self.meta()
            .get(path)
            .fetch()
            .await
            .map_err(|e| StepError::Probe(error_chain(&e)))
    }

    /// A broadcast group's tree as it stands: per rank its parent and
    /// state, in rank order (which pod holds which rank varies from run to
    /// run; the shape does not).
    pub(super) async fn tree(&self, group: &str) -> Result<Value, StepError> {
        let info = self.group_info(group).await?;
        // Small trees rank by rank; large ones as children per parent.
        if info.members.len() > 16 {
            let mut by_parent: std::collections::BTreeMap<u32, usize> = Default::default();
            let mut states: std::collections::BTreeMap<&str, usize> = Default::default();
            for m in &info.members {
                *by_parent.entry(m.parent).or_default() += 1;
                *states.entry(m.state.as_str()).or_default() += 1;
            }
            return Ok(json!({
                "group": info.group,
                "origin": info.origin,
                "fanout": info.fanout,
                "members": info.members.len(),
                "replaced": info.members.iter().filter(|m| !m.replaced.is_empty()).count(),
                "children_per_parent": by_parent,
                "states": states,
            }));
        }
        let ranks: Vec<Value> = info
            .members
            .iter()
            .map(|m| json!(format!("{} <- {} {}", m.rank, m.parent, m.state.as_str())))
            .collect();
        Ok(json!({
            "group": info.group,
            "origin": info.origin,
            "fanout": info.fanout,
            "members": info.members.len(),
            "replaced": info.members.iter().filter(|m| !m.replaced.is_empty()).count(),
            "tree": ranks,
        }))
    }

    /// One metric of every instance of a component: its spread, and the
    /// record of it.
    pub(super) async fn spread(
        &self,
        m: &MetricsStep,
    ) -> Result<(Spread, serde_json::Value), StepError> {
        let comps = self.components(&m.component);
        if comps.is_empty() {
            return Err(StepError::Input(format!(
                "no component named {}",
                m.component
            )));
        }
        let reads: Vec<_> = comps
            .iter()
            .map(|c| async move {
                Ok::<_, StepError>((self.metric_of(c, &m.name).await?, c.to_string()))
            })
            .collect();
        let values: Vec<(f64, String)> = futures::stream::iter(reads)
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let spread = Spread::of(values);
        let record = json!({
            "count": spread.count,
            "min": spread.min,
            "median": spread.median,
            "max": spread.max,
            "largest": spread.largest,
        });
        Ok((spread, record))
    }

    async fn metric_of(&self, c: &Component, name: &str) -> Result<f64, StepError> {
        self.metrics_of(c)
            .await
            .map(|text| metric_sum(&text, name))
            .map_err(|e| StepError::at(c, e))
    }

    /// Whether a component is ready: its `/readyz` over HTTP where the
    /// runner reaches it (unreachable: not ready), else as the target says.
    pub(super) async fn ready(&self, comp: &Component) -> Result<bool, StepError> {
        Ok(match self.target.component_url(comp) {
            Some(url) => self
                .http
                .get(format!("{url}/readyz"))
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false),
            None => self.target.ready(comp).await?,
        })
    }

    /// A component's `/metrics`: over HTTP where the runner reaches it,
    /// else through the target (a cluster's pods).
    pub(super) async fn metrics_of(&self, c: &Component) -> Result<String, StepError> {
        match self.target.component_url(c) {
            Some(url) => self.metrics_text(&url).await,
            None => Ok(self.target.metrics(c).await?),
        }
    }

    /// The text of `url`/metrics; a request that fails is tried twice more
    /// (a busy machine with hundreds of pods drops the odd connection),
    /// after a jittered backoff.
    async fn metrics_text(&self, url: &str) -> Result<String, StepError> {
        let mut backoff = kt_api::Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut attempt = 0;
        loop {
            let res = self.meta().at(url).get("/metrics").send().await;
            let res = match res {
                Ok(resp) => resp.text().await.map_err(|e| error_chain(&e)),
                Err(e) => Err(error_chain(&e)),
            };
            match res {
                Ok(text) => return Ok(text),
                Err(e) if attempt >= 2 => return Err(StepError::Probe(e)),
                Err(_) => {
                    attempt += 1;
                    backoff.wait().await;
                }
            }
        }
    }

    /// The metadata server's state: every key record and the store.
    pub(super) async fn metadata_dump(&self) -> Result<Value, StepError> {
        let records = self.records_below("").await?;
        let store = self.client()?.store_url().await.ok();
        Ok(json!({ "store": store, "keys": records }))
    }
}

/// The sum of every sample of `name` (all label sets) in Prometheus text.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name)
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// An error with its causes: reqwest's own message says little.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        msg.push_str(&format!(": {c}"));
        cause = c.source();
    }
    msg
}

/// The spread of one metric over a component's instances.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Spread {
    pub(super) count: usize,
    pub(super) min: f64,
    pub(super) median: f64,
    pub(super) max: f64,
    /// The instance with the largest value.
    pub(super) largest: String,
}

impl Spread {
    /// Of (value, instance) pairs.
    fn of(mut values: Vec<(f64, String)>) -> Spread {
        values.sort_by(|a, b| a.0.total_cmp(&b.0));
        let at = |i: usize| values.get(i).map(|v| v.0).unwrap_or(0.0);
        let last = values.len().saturating_sub(1);
        Spread {
            count: values.len(),
            min: at(0),
            median: at(last / 2),
            max: at(last),
            largest: values.get(last).map(|v| v.1.clone()).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_add_label_sets() {
        let text = "# HELP x\nkt_bytes_received_total 1024\nkt_http_requests_total{path=\"/a\"} 2\nkt_http_requests_total{path=\"/b\"} 3\n";
        assert_eq!(metric_sum(text, "kt_bytes_received_total"), 1024.0);
        assert_eq!(metric_sum(text, "kt_http_requests_total"), 5.0);
        assert_eq!(metric_sum(text, "missing"), 0.0);
    }

    #[test]
    fn spreads_of_metrics() {
        let v = |x: f64| (x, format!("pod {x}"));
        let s = Spread::of(vec![v(3.0), v(1.0), v(2.0), v(10.0)]);
        assert_eq!((s.count, s.min, s.median, s.max), (4, 1.0, 2.0, 10.0));
        assert_eq!(s.largest, "pod 10");
        assert_eq!(Spread::of(vec![]).count, 0);
    }
}
