//! `wait` steps: polling a condition of the testbed until it holds.

use std::time::Duration;

use kt_types::Key;

use super::{Scn, StepError, StepResult, metric_sum};
use crate::format::{Condition, Step, WaitStep};

const WAIT_POLL: Duration = Duration::from_millis(20);

impl Scn<'_> {
    /// `wait`: polls the condition until it holds (the step's timeout ends
    /// it otherwise).
    pub(super) async fn wait(
        &self,
        step: &Step,
        w: &WaitStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let outcome = loop {
            match self.condition(&w.condition).await {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                // A wait on an unreachable server keeps waiting; the
                // step's timeout ends it with the last error.
                Err(e) => result.context = format!("last check: {e}"),
            }
            tokio::time::sleep(WAIT_POLL).await;
        };
        self.expect_plain(step, outcome)
    }

    async fn condition(&self, c: &Condition) -> Result<bool, StepError> {
        match c {
            Condition::Ready(name) => {
                for comp in self.components(name) {
                    if !self.ready(&comp).await? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
            Condition::Key(k) | Condition::NoKey(k) => {
                let (_, exists) = self.key_exists(k).await?;
                Ok(exists == matches!(c, Condition::Key(_)))
            }
            Condition::Metric(m) => {
                let comp = self
                    .components(&m.component)
                    .into_iter()
                    .next()
                    .ok_or_else(|| {
                        StepError::Input(format!("no component named {}", m.component))
                    })?;
                let text = self.metrics_of(&comp).await?;
                Ok(metric_sum(&text, &m.name) >= m.at_least.0 as f64)
            }
            Condition::Leases(n) => {
                let list: kt_types::api::LeaseList =
                    self.meta_json(&kt_types::paths::leases()).await?;
                Ok(list.leases.len() <= *n)
            }
            Condition::Peers(p) => {
                let key = Key::parse(&self.expand(&p.key)?)?;
                let r = self.client()?.stat(&key).await?;
                Ok(r.peers.len() >= p.at_least)
            }
            Condition::Members(m) => {
                let group = self.expand(&m.group)?;
                // A group nobody joined yet is unknown: not there yet.
                Ok(self
                    .group_info(&group)
                    .await
                    .is_ok_and(|g| g.members.len() >= m.at_least))
            }
        }
    }
}
