//! Tensor steps: `tensor_put` (held or not), `tensor_get` and `tensor_ls`,
//! a broadcast's quorum, and the records of `kt tensor`'s summaries. (Not
//! [`crate::tensor`], which builds the commands and reads their output.)

use std::time::Instant;

use futures::future::join_all;
use serde_json::Value;

use super::exec::{Invocation, PodRun};
use super::{Scn, StepError, StepResult};
use crate::format::{Auth, Step, TensorBroadcast, TensorGetStep, TensorLsStep, TensorPutStep};
use crate::target::{ExecOutput, ExecRequest, PodPlan, PodProcess, Program};
use crate::template::Context;
use crate::tensor;

/// What [`tensor::Resolved`] borrows, made by [`Scn::resolve`].
struct Expanded {
    layout: String,
    group: Option<String>,
    ips: Vec<String>,
}

impl Expanded {
    fn resolved(&self) -> tensor::Resolved<'_> {
        tensor::Resolved {
            layout: &self.layout,
            group: self.group.as_deref(),
            ips: &self.ips,
        }
    }
}

/// A process left running in a pod (a `kt tensor put --hold`).
pub(super) struct Holder {
    pub(super) pod: String,
    pub(super) args: Vec<String>,
    pub(super) proc: Box<dyn PodProcess>,
}

impl Scn<'_> {
    /// `tensor_put`: `kt tensor put` in every pod named, left running when
    /// it holds.
    pub(super) async fn tensor_put(
        &self,
        step: &Step,
        p: &TensorPutStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pods = self.select(&p.pod);
        let expanded = self.resolve(p.broadcast.as_ref(), &p.layout).await?;
        let resolved = expanded.resolved();
        let args = |_: &PodPlan, ctx: &Context| -> Result<Vec<String>, StepError> {
            let key = ctx.expand(&p.key)?;
            Ok(tensor::put_args(p, &key, resolved))
        };
        let runs = if p.hold {
            let held = join_all(pods.iter().map(|pod| {
                let ctx = self.ctx.for_pod(&pod.name, pod.index);
                self.hold(pod, args(pod, &ctx), p.auth, started)
            }))
            .await;
            let mut runs = Vec::new();
            let mut holders = Vec::new();
            for (run, holder) in held {
                runs.push(run);
                holders.extend(holder);
            }
            if !holders.is_empty() {
                let name = p.name.clone().unwrap_or_else(|| result.index.clone());
                self.holders
                    .lock()
                    .await
                    .entry(name)
                    .or_default()
                    .extend(holders);
            }
            runs
        } else {
            self.in_pods(&pods, Invocation::kt(p.auth), args, started, &result.index)
                .await
        };
        self.settle_summaries(step, &runs, result, tensor::put_record)
    }

    /// `tensor_get`: `kt tensor get` in every pod named.
    pub(super) async fn tensor_get(
        &self,
        step: &Step,
        g: &TensorGetStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pods = self.select(&g.pod);
        let expanded = self.resolve(g.broadcast.as_ref(), &g.layout).await?;
        let resolved = expanded.resolved();
        let runs = self
            .in_pods(
                &pods,
                Invocation::kt(g.auth),
                |_, ctx| {
                    let keys = (g.all_keys().into_iter())
                        .map(|k| ctx.expand(k))
                        .collect::<Result<Vec<String>, _>>()?;
                    Ok(tensor::get_args(g, &keys, resolved))
                },
                started,
                &result.index,
            )
            .await;
        self.settle_summaries(step, &runs, result, tensor::get_record)
    }

    /// `tensor_ls`: `kt tensor ls` in every pod named.
    pub(super) async fn tensor_ls(
        &self,
        step: &Step,
        t: &TensorLsStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pods = self.select(&t.pod);
        let args = ["tensor", "ls", "-o", "json"].map(String::from).to_vec();
        let runs = self
            .kt_in(step, &pods, t.auth, args, started, result)
            .await?;
        let mut by_pod = serde_json::Map::new();
        for (pod, o) in ok_outputs(&runs) {
            let regs = tensor::ls_record(&o.stdout)
                .map_err(|e| StepError::at(pod, StepError::Command(e)))?;
            by_pod.insert(pod.to_owned(), regs);
        }
        result.record = match (pods.len(), by_pod.len()) {
            (_, 0) => None,
            (1, _) => by_pod.into_iter().next().map(|(_, v)| v),
            _ => Some(Value::Object(by_pod)),
        };
        Ok(())
    }

    /// A tensor step's `layout` (expanded), its broadcast's group
    /// (expanded) and the addresses of the pods the broadcast's `ips`
    /// names.
    async fn resolve(
        &self,
        b: Option<&TensorBroadcast>,
        layout: &str,
    ) -> Result<Expanded, StepError> {
        let mut e = Expanded {
            layout: self.expand(layout)?,
            group: None,
            ips: Vec::new(),
        };
        let Some(b) = b else {
            return Ok(e);
        };
        e.group = b.group.as_deref().map(|g| self.expand(g)).transpose()?;
        for name in &b.ips {
            let pods = self.select(name);
            if pods.is_empty() {
                return Err(StepError::Input(format!("no pod named {name}")));
            }
            for p in pods {
                let ip = self.target.pod_ip(&p.name).await?;
                e.ips.push(ip);
            }
        }
        Ok(e)
    }

    /// Starts `args` (a `kt tensor put --hold`) in `pod` and waits for its
    /// `holding` line: the run, and the process when it holds.
    async fn hold(
        &self,
        pod: &PodPlan,
        args: Result<Vec<String>, StepError>,
        auth: Auth,
        started: Instant,
    ) -> (PodRun, Option<Holder>) {
        let t = Instant::now();
        let run = |args: Vec<String>, out| PodRun {
            pod: pod.name.clone(),
            args,
            out,
            finished: started.elapsed(),
        };
        let args = match args {
            Ok(a) => a,
            Err(e) => return (run(vec![], Err(e)), None),
        };
        let req = ExecRequest {
            pod: pod.name.clone(),
            program: Program::Kt,
            args: args.clone(),
            env: Vec::new(),
            token: self.token_for(auth),
        };
        let mut proc = match self.target.spawn(req).await {
            Ok(p) => p,
            Err(e) => return (run(args, Err(e.into())), None),
        };
        let mut stdout = String::new();
        while let Some(line) = proc.line().await {
            if tensor::is_holding(&line) {
                let out = ExecOutput {
                    status: 0,
                    stdout,
                    stderr: String::new(),
                    duration: t.elapsed(),
                };
                let holder = Holder {
                    pod: pod.name.clone(),
                    args: args.clone(),
                    proc,
                };
                return (run(args, Ok(out)), Some(holder));
            }
            stdout.push_str(&line);
            stdout.push('\n');
        }
        // It ended without holding: its status says why.
        let out = proc.wait().await.map_err(StepError::from).and_then(|o| {
            if o.status == 0 {
                Err(StepError::Command(format!(
                    "kt exited (0) without printing its `holding` line: {}",
                    o.stdout.trim()
                )))
            } else {
                Ok(o)
            }
        });
        (run(args, out), None)
    }
}

/// The pods and outputs of the runs that exited 0.
fn ok_outputs(runs: &[PodRun]) -> impl Iterator<Item = (&str, &ExecOutput)> {
    runs.iter().filter_map(|r| match &r.out {
        Ok(o) if o.status == 0 => Some((r.pod.as_str(), o)),
        _ => None,
    })
}

impl Scn<'_> {
    /// Settles the runs of a `kt tensor` step ([`Scn::settle`]), then
    /// records what `record` makes of the JSON summaries its successful
    /// runs printed (nothing when no run succeeded).
    fn settle_summaries<T: serde::de::DeserializeOwned>(
        &self,
        step: &Step,
        runs: &[PodRun],
        result: &mut StepResult,
        record: impl FnOnce(&[T]) -> Value,
    ) -> Result<(), StepError> {
        self.settle(step, runs, result)?;
        let outs = ok_outputs(runs)
            .map(|(pod, o)| {
                tensor::summary(&o.stdout).map_err(|e| StepError::at(pod, StepError::Command(e)))
            })
            .collect::<Result<Vec<T>, _>>()?;
        if !outs.is_empty() {
            result.record = Some(record(&outs));
        }
        Ok(())
    }
}
