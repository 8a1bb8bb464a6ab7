//! Fault steps: `kill` and `restart` of components and agents, `link`
//! cuts (each a [`Fault`] per component it hits), and `stop` of held
//! processes (and of those left at the scenario's end).

use std::time::{Duration, Instant};

use futures::future::{FutureExt, join_all};

use super::exec::PodRun;
use super::{Scn, StepError, StepResult};
use crate::fault::{Fault, Hit};
use crate::format::{KillStep, LinkState, LinkStep, RestartStep, Signal, Step, StopStep, Victim};

/// How long a holder left at the scenario's end gets after TERM.
const HOLDER_GRACE: Duration = Duration::from_secs(10);

impl Scn<'_> {
    /// `kill`: signals a component or a pod's agent, or loses a node.
    pub(super) async fn kill(&self, step: &Step, k: &KillStep) -> Result<(), StepError> {
        let outcome = async {
            let faults = match &k.node {
                Some(node) => vec![Fault::LoseNode(node.clone())],
                None => self.faults(k.victim(), |h| Fault::Signal(h, k.signal))?,
            };
            self.inject(faults).await
        }
        .await;
        self.expect_plain(step, outcome)
    }

    /// `restart`: signals a component or a pod's agent and starts it again.
    pub(super) async fn restart(&self, step: &Step, r: &RestartStep) -> Result<(), StepError> {
        let sig = r.signal.unwrap_or(Signal::TERM);
        let outcome = async {
            let faults = self.faults(r.victim(), |h| Fault::Restart(h, sig))?;
            self.inject(faults).await
        }
        .await;
        self.expect_plain(step, outcome)
    }

    /// `link`: cuts or restores the links of a server or a pod group.
    pub(super) async fn link(&self, step: &Step, l: &LinkStep) -> Result<(), StepError> {
        let up = l.state == LinkState::Up;
        let outcome = async {
            let victim = Ok(Victim::Component(&l.component));
            let faults = self.faults(victim, |h| Fault::Link(h.component(), up))?;
            self.inject(faults).await
        }
        .await;
        self.expect_plain(step, outcome)
    }

    /// `stop`: signals the processes held under one name and waits for them.
    pub(super) async fn stop(
        &self,
        step: &Step,
        st: &StopStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let sig = st.signal.unwrap_or(Signal::TERM);
        let held = self
            .holders
            .lock()
            .await
            .remove(&st.holder)
            .ok_or_else(|| {
                StepError::Input(format!("no process is held as `{}` (any more)", st.holder))
            })?;
        let runs = join_all(held.into_iter().map(|mut h| async move {
            let t = Instant::now();
            let out = async {
                h.proc.signal(sig).await?;
                h.proc.wait().await
            }
            .await
            .map(|mut o| {
                // Dying of the KILL asked for is the expected end.
                if sig == Signal::KILL && o.status == 128 + 9 {
                    o.status = 0;
                }
                o.duration = t.elapsed();
                o
            })
            .map_err(StepError::from);
            PodRun {
                pod: h.pod,
                args: h.args,
                out,
                finished: started.elapsed(),
            }
        }))
        .await;
        self.settle(step, &runs, result)
    }

    /// Ends every process still held: TERM, then KILL after a grace period.
    pub(super) async fn stop_holders(&self) {
        let held = std::mem::take(&mut *self.holders.lock().await);
        let stops = held.into_values().flatten().map(|mut h| async move {
            let _ = h.proc.signal(Signal::TERM).await;
            if tokio::time::timeout(HOLDER_GRACE, h.proc.wait())
                .await
                .is_err()
            {
                let _ = h.proc.signal(Signal::KILL).await;
                let _ = tokio::time::timeout(HOLDER_GRACE, h.proc.wait()).await;
            }
        });
        join_all(stops).await;
    }

    /// The fault `make` makes of everything a victim names: every
    /// component (or every pod's agent) it selects.
    fn faults(
        &self,
        victim: Result<Victim<'_>, &'static str>,
        make: impl Fn(Hit) -> Fault,
    ) -> Result<Vec<Fault>, StepError> {
        let victim = victim.map_err(|e| StepError::Input(e.to_owned()))?;
        let hits: Vec<Hit> = match victim {
            Victim::Component(name) => (self.components(name).into_iter())
                .map(Hit::Component)
                .collect(),
            Victim::Agent(name) => (self.select(name).iter())
                .map(|p| Hit::Agent(p.name.clone()))
                .collect(),
        };
        if hits.is_empty() {
            return Err(StepError::Input(match victim {
                Victim::Component(name) => format!("no component named {name}"),
                Victim::Agent(name) => format!("no pod named {name}"),
            }));
        }
        Ok(hits.into_iter().map(make).collect())
    }

    /// Injects every fault at once: a kill or restart of a pod group hits
    /// its pods together, as a node failure would, rather than one after
    /// another (on slow targets a group's last pod would otherwise be hit
    /// long after its first). Every injection finishes; the first error,
    /// named by what it hit, is the outcome.
    async fn inject(&self, faults: Vec<Fault>) -> Result<(), StepError> {
        let runs = faults.iter().map(|f| {
            f.inject(self.target)
                .map(move |r| r.map_err(|e| StepError::at(f.hits(), e)))
        });
        join_all(runs).await.into_iter().collect()
    }
}
