//! Commands in pods: `exec` and `python` steps, and running any step's command in every
//! pod it names at once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::json;

use super::{Scn, StepError, StepResult};
use crate::format::{Auth, ErrorClass, ExecStep, PythonStep, Step};
use crate::target::{ExecOutput, ExecRequest, PodPlan, Program};
use crate::template::Context;

/// Which program a pod command runs, with which credentials and extra
/// environment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Invocation<'e> {
    program: Program,
    auth: Auth,
    env: &'e BTreeMap<String, String>,
}

static NO_ENV: BTreeMap<String, String> = BTreeMap::new();

impl Invocation<'static> {
    /// The `kt` CLI with no extra environment.
    pub(super) fn kt(auth: Auth) -> Self {
        Invocation {
            program: Program::Kt,
            auth,
            env: &NO_ENV,
        }
    }
}

/// A command of an `exec` or `python` step: `lead` (as written) then
/// `args` (template-expanded per pod), in every pod `pod` selects.
#[derive(Debug, Clone, Copy)]
struct Command<'c> {
    pod: &'c str,
    lead: &'c [String],
    args: &'c [String],
    /// A regex every pod's stdout must match.
    stdout: Option<&'c str>,
}

/// What one pod's command did.
pub(super) struct PodRun {
    pub(super) pod: String,
    pub(super) args: Vec<String>,
    pub(super) out: Result<ExecOutput, StepError>,
    pub(super) finished: Duration,
}

impl PodRun {
    pub(super) fn class(&self) -> Option<ErrorClass> {
        match &self.out {
            Ok(o) if o.status == 0 => None,
            Ok(o) => Some(ErrorClass::of_exit(o.status)),
            Err(_) => Some(ErrorClass::Failed),
        }
    }

    pub(super) fn message(&self) -> String {
        match &self.out {
            Ok(o) => o.stderr.trim().to_owned(),
            Err(e) => e.to_string(),
        }
    }
}

impl Scn<'_> {
    /// `exec`: a `kt` or `sh` command in every pod named, its stdout checked
    /// against `stdout`.
    pub(super) async fn exec(
        &self,
        step: &Step,
        e: &ExecStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let program = if e.program.as_deref() == Some("sh") {
            Program::Shell
        } else {
            Program::Kt
        };
        let how = Invocation {
            program,
            auth: e.auth,
            env: &e.env,
        };
        let command = Command {
            pod: &e.pod,
            lead: &[],
            args: &e.args,
            stdout: e.stdout.as_deref(),
        };
        self.command(step, how, command, started, result).await
    }

    /// `python`: a script run by the interpreter with the `kt` package in
    /// every pod named (`python -c SCRIPT ARGS...`).
    pub(super) async fn python(
        &self,
        step: &Step,
        p: &PythonStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let how = Invocation {
            program: Program::Python,
            auth: p.auth,
            env: &p.env,
        };
        let lead = ["-c".to_owned(), p.script.clone()];
        let command = Command {
            pod: &p.pod,
            lead: &lead,
            args: &p.args,
            stdout: p.stdout.as_deref(),
        };
        self.command(step, how, command, started, result).await
    }

    /// Runs a command in every pod it names; records the first pod's status
    /// and stdout lines.
    async fn command(
        &self,
        step: &Step,
        how: Invocation<'_>,
        c: Command<'_>,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pods = self.select(c.pod);
        let runs = self
            .in_pods(
                &pods,
                how,
                |_, ctx| {
                    let expanded = c.args.iter().map(|a| Ok(ctx.expand(a)?));
                    c.lead.iter().cloned().map(Ok).chain(expanded).collect()
                },
                started,
                &result.index,
            )
            .await;
        self.settle(step, &runs, result)?;
        if let Some(re) = c.stdout {
            let re = regex::Regex::new(re).map_err(|e| StepError::Input(e.to_string()))?;
            for run in &runs {
                if let Ok(o) = &run.out
                    && !re.is_match(&o.stdout)
                {
                    let why = format!("stdout does not match /{re}/: {}", o.stdout);
                    return Err(StepError::at(&run.pod, StepError::Check(why)));
                }
            }
        }
        if let Some(Ok(o)) = runs.first().map(|r| &r.out) {
            result.record =
                Some(json!({ "status": o.status, "stdout": o.stdout.lines().collect::<Vec<_>>() }));
        }
        Ok(())
    }

    /// `kt ARGS`, the same in every pod of `pods`, settled against the
    /// step's expectation.
    pub(super) async fn kt_in(
        &self,
        step: &Step,
        pods: &[&PodPlan],
        auth: Auth,
        args: Vec<String>,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<Vec<PodRun>, StepError> {
        let runs = self
            .in_pods(
                pods,
                Invocation::kt(auth),
                |_, _| Ok(args.clone()),
                started,
                &result.index,
            )
            .await;
        self.settle(step, &runs, result)?;
        Ok(runs)
    }

    /// Runs `args(pod)` in every selected pod at once.
    pub(super) async fn in_pods(
        &self,
        pods: &[&PodPlan],
        how: Invocation<'_>,
        args: impl Fn(&PodPlan, &Context) -> Result<Vec<String>, StepError>,
        started: Instant,
        index: &str,
    ) -> Vec<PodRun> {
        let live = &self.runner.live;
        let total = pods.len();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let runs = pods.iter().map(|p| {
            let ctx = self.ctx.for_pod(&p.name, p.index);
            let args = args(p, &ctx);
            let env: Vec<(String, String)> = how
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let done = &done;
            async move {
                let (args, out) = match args {
                    Err(e) => (vec![], Err(e)),
                    Ok(args) => {
                        let req = ExecRequest {
                            pod: p.name.clone(),
                            program: how.program,
                            args: args.clone(),
                            env,
                            token: self.token_for(how.auth),
                        };
                        let out = self.target.exec(req).await.map_err(StepError::from);
                        (args, out)
                    }
                };
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if total > 1 {
                    live.pods_done(index, n, total);
                }
                PodRun {
                    pod: p.name.clone(),
                    args,
                    out,
                    finished: started.elapsed(),
                }
            }
        });
        join_all(runs).await
    }
}
