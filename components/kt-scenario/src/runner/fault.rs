//! Fault steps: `kill` and `restart` of components and agents, and `stop`
//! of held processes (and of those left at the scenario's end).

use std::time::{Duration, Instant};

use futures::future::{FutureExt, join_all};

use super::exec::PodRun;
use super::{Scn, StepError, StepResult};
use crate::format::{KillStep, LinkState, LinkStep, RestartStep, Signal, Step, StopStep, Victim};
use crate::target::Component;

/// How long a holder left at the scenario's end gets after TERM.
const HOLDER_GRACE: Duration = Duration::from_secs(10);

impl Scn<'_> {
    /// `kill`: signals a component or a pod's agent.
    pub(super) async fn kill(&self, step: &Step, k: &KillStep) -> Result<(), StepError> {
        let outcome = match k.victim() {
            Ok(Victim::Component(name)) => {
                self.each_component(
                    name,
                    |c| async move { self.target.kill(&c, k.signal).await },
                )
                .await
            }
            Ok(Victim::Agent(pod)) => {
                self.each_agent(pod, |p| async move {
                    self.target.kill_agent(&p, k.signal).await
                })
                .await
            }
            Err(e) => Err(StepError::Input(e.to_owned())),
        };
        self.expect_plain(step, outcome)
    }

    /// `restart`: signals a component or a pod's agent and starts it again.
    pub(super) async fn restart(&self, step: &Step, r: &RestartStep) -> Result<(), StepError> {
        let sig = r.signal.unwrap_or(Signal::TERM);
        let outcome = match r.victim() {
            Ok(Victim::Component(name)) => {
                self.each_component(name, |c| async move {
                    self.target.kill(&c, sig).await?;
                    self.target.start(&c).await
                })
                .await
            }
            Ok(Victim::Agent(pod)) => {
                self.each_agent(pod, |p| async move {
                    self.target.kill_agent(&p, sig).await?;
                    self.target.start(&Component::Pod(p)).await
                })
                .await
            }
            Err(e) => Err(StepError::Input(e.to_owned())),
        };
        self.expect_plain(step, outcome)
    }

    /// `link`: cuts or restores the links of a server or a pod group.
    pub(super) async fn link(&self, step: &Step, l: &LinkStep) -> Result<(), StepError> {
        let up = l.state == LinkState::Up;
        let outcome = self
            .each_component(&l.component, |c| async move {
                self.target.set_link(&c, up).await
            })
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

    /// Runs `f` on every component `name` selects, all at once.
    async fn each_component<F, Fut>(&self, name: &str, f: F) -> Result<(), StepError>
    where
        F: Fn(Component) -> Fut,
        Fut: std::future::Future<Output = Result<(), crate::target::TargetError>>,
    {
        let comps = self.components(name);
        if comps.is_empty() {
            return Err(StepError::Input(format!("no component named {name}")));
        }
        all_at_once(comps, Component::to_string, f).await
    }

    /// Runs `f` on the agent of every pod `name` selects, all at once.
    async fn each_agent<F, Fut>(&self, name: &str, f: F) -> Result<(), StepError>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<(), crate::target::TargetError>>,
    {
        let pods: Vec<String> = self.select(name).iter().map(|p| p.name.clone()).collect();
        if pods.is_empty() {
            return Err(StepError::Input(format!("no pod named {name}")));
        }
        all_at_once(pods, |p| format!("the agent of pod {p}"), f).await
    }
}

/// Runs `f` on every item at once: a kill or restart of a pod group hits
/// its pods together, as a node failure would, rather than one after
/// another (on slow targets a group's last pod would otherwise be hit long
/// after its first). Every run finishes; the first error, named by `what`,
/// is the outcome.
async fn all_at_once<T, F, Fut>(
    items: Vec<T>,
    what: impl Fn(&T) -> String,
    f: F,
) -> Result<(), StepError>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Result<(), crate::target::TargetError>>,
{
    let runs = items.into_iter().map(|item| {
        let what = what(&item);
        f(item).map(move |r| r.map_err(|e| StepError::at(what, e)))
    });
    join_all(runs).await.into_iter().collect()
}
