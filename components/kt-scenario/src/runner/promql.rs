//! Topology `prometheus` and the `promql` step ([`crate::prometheus`]):
//! Prometheus is started before the first step, scraping the metadata
//! server, the store and every pod's agent; a `promql` step waits for a
//! scrape of every target that began after it did, then bounds one
//! instant query's answer.

use std::time::{Duration, SystemTime};

use serde_json::json;

use super::{Scn, StepError, StepResult};
use crate::prometheus::{Prometheus, PromqlStep, ScrapeTarget};
use crate::target::Component;

/// How long Prometheus may take to be ready and to scrape every target.
const START: Duration = Duration::from_secs(60);

impl Scn<'_> {
    /// Starts the topology's Prometheus, if it has one.
    pub(super) async fn start_prometheus(&self) -> Result<(), StepError> {
        let Some(spec) = &self.loaded.scenario.topology.prometheus else {
            return Ok(());
        };
        let mut targets = Vec::new();
        for (job, c) in [
            ("metadata", Component::Metadata),
            ("store", Component::Store),
        ] {
            let url = self.target.component_url(&c).ok_or_else(|| {
                StepError::Input(format!(
                    "the {} target gives no URL of the {c} to scrape",
                    self.target.name()
                ))
            })?;
            targets.push(ScrapeTarget {
                job,
                url,
                pod: None,
            });
        }
        for p in &self.pods {
            if let Some(url) = self.target.component_url(&Component::Pod(p.name.clone())) {
                targets.push(ScrapeTarget {
                    job: "agent",
                    url,
                    pod: Some(p.name.clone()),
                });
            }
        }
        let dir = self.work.join("prometheus");
        let p = Prometheus::start(spec, targets, &self.token, &dir, START)
            .await
            .map_err(StepError::Probe)?;
        self.runner.live.line(&format!(
            "prometheus {} scrapes {} targets every {:?}",
            p.url, p.targets, spec.scrape_interval
        ));
        *self.prometheus.lock().await = Some(p);
        Ok(())
    }

    /// `promql`: a scrape of every target after the step began, then the
    /// query, its answer bounded.
    pub(super) async fn promql(
        &self,
        q: &PromqlStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let began = SystemTime::now();
        let guard = self.prometheus.lock().await;
        let p = guard.as_ref().ok_or_else(|| {
            StepError::Input("promql steps need topology `prometheus`".to_owned())
        })?;
        let failed = |why: String, answer: String| {
            StepError::Check(format!(
                "PromQL {:?}: {why} (at_least {}, at_most {}; answer {answer})",
                q.query,
                q.at_least.map_or("-".into(), |b| b.0.to_string()),
                q.at_most.map_or("-".into(), |b| b.0.to_string()),
            ))
        };
        p.scraped_since(began)
            .await
            .map_err(|e| failed(format!("waiting for a fresh scrape: {e}"), "none".into()))?;
        let data = p.query_raw(&q.query).await;
        result.context.push_str(&format!(
            "PromQL: {}\nanswer: {}\nprometheus {} (log {}):\n{}\n",
            q.query,
            data.as_ref().map_or_else(|e| e.clone(), |d| d.to_string()),
            p.url,
            p.log.display(),
            p.log_tail()
        ));
        let data = data.map_err(|e| failed(e, "none".into()))?;
        let value =
            crate::prometheus::one_number(&data).map_err(|e| failed(e, data.to_string()))?;
        self.runner
            .live
            .line(&format!("promql {} = {value}", q.query));
        if let Some(why) = q.violation(value) {
            return Err(failed(why, value.to_string()));
        }
        result.record = Some(json!({
            "query": q.query,
            "at_least": q.at_least.map(|b| b.0),
            "at_most": q.at_most.map(|b| b.0),
            "within": true,
        }));
        Ok(())
    }
}
