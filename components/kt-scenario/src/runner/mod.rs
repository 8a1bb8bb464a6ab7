//! Runs scenarios: brings a target up, generates the data sets, executes the
//! steps (with expectations, timeouts and budgets), asserts the snapshot,
//! dumps what a failure needs, and always brings the target down.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, join_all};
use kt_client::{Client, ClientConfig};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::data::{self, Digest};
use crate::format::{Action, Auth, Condition, ErrorClass, Expect, LinkState, Signal, Step, Victim};
use crate::live::Live;
use crate::report::{BudgetCheck, PodResult, RunReport, ScenarioReport, Status, StepReport};
use crate::snapshot::{Redactor, Snapshots};
use crate::target::local::NO_PYTHON;
use crate::target::{Component, Plan, PodPlan, Target, parse_link};
use crate::template::Context;
use crate::validate::Loaded;

mod budget;
mod check;
pub mod cpu;
mod datasets;
mod error;
mod exec;
mod fault;
mod probe;
mod promql;
mod s3;
mod tensors;
mod transfer;
mod wait;

use error::{StepError, check_expect};
use exec::PodRun;
use tensors::Holder;

pub use budget::budget_checks;
pub use probe::metric_sum;

/// Default limit of one step, and of a whole scenario.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);
pub const SCENARIO_TIMEOUT: Duration = Duration::from_secs(300);
/// Limit of the runner's own requests (readiness, metrics, state dumps).
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
const DUMP_TIMEOUT: Duration = Duration::from_secs(10);
#[derive(Debug, Clone)]
pub struct Options {
    /// Where `kt`, `kt-metadata` and `kt-store` are.
    pub bin_dir: PathBuf,
    /// Scenario work dirs go below it (removed after each scenario unless kept).
    pub work_root: PathBuf,
    pub report_dir: PathBuf,
    /// Keep a failed scenario's testbed up until Ctrl-C.
    pub keep: bool,
    /// Run only scenarios with one of these tags (all when empty).
    pub tags: Vec<String>,
    /// Skip scenarios with any of these tags.
    pub exclude_tags: Vec<String>,
    /// The Python interpreter with the `kt` package that `python` steps run
    /// (None: scenarios with one are skipped).
    pub python: Option<PathBuf>,
}

/// Makes a fresh target for each scenario.
pub type TargetFactory = dyn Fn() -> Box<dyn Target> + Send + Sync;

#[derive(Debug)]
pub struct Runner {
    pub opts: Options,
    pub snapshots: Snapshots,
    pub live: Live,
    pub run_id: String,
    pub cancel: CancellationToken,
}

/// Why a selected scenario cannot run on this target here.
fn skip_reason(l: &Loaded, target: &dyn Target, opts: &Options) -> Option<String> {
    unsupported(l, target)
        .or_else(|| needs_gpu(l).then(cuda_missing).flatten())
        .or_else(|| (runs_python(l) && opts.python.is_none()).then(|| NO_PYTHON.to_owned()))
        .or_else(|| {
            (l.scenario.topology.s3.is_some())
                .then(crate::target::s3::unavailable)
                .flatten()
        })
        .or_else(|| {
            (l.scenario.topology.prometheus.is_some())
                .then(crate::prometheus::unavailable)
                .flatten()
        })
        .or_else(|| target.unavailable())
}

/// Why scenario `l` cannot run on `target` on any machine: what the
/// target cannot do that the scenario needs (`--dry-run` says it too).
pub fn unsupported(l: &Loaded, target: &dyn Target) -> Option<String> {
    let tags = &l.scenario.tags;
    if tags.iter().any(|t| t == "netns") && target.name() != "netns" {
        return Some(format!(
            "needs the netns target (this run uses {})",
            target.name()
        ));
    }
    if needs_gpu(l) && !matches!(target.name(), "local" | "netns") {
        return Some(format!(
            "gpu scenarios run on the local and netns targets (the {} target gives its pods no GPU yet)",
            target.name()
        ));
    }
    if l.scenario.topology.pods.iter().any(|p| p.node.is_some())
        && !matches!(target.name(), "local" | "netns")
    {
        return Some(format!(
            "places pods on named nodes (topology `node`: their agents' KT_NODE_NAME), which the local and netns targets do (the {} target's pods are on the nodes it scheduled them to)",
            target.name()
        ));
    }
    if l.scenario.topology.nodes.is_some() && !target.runs_nodes() {
        return Some(format!(
            "runs Kubernetes nodes (topology `nodes`: an API server, node-cache agents, the Dataset controller), which the {} target does not yet (local does)",
            target.name()
        ));
    }
    if l.scenario.topology.s3.is_some() && !target.runs_s3() {
        return Some(format!(
            "runs an S3 server (topology `s3`: moto's), which the {} target does not (local and netns do)",
            target.name()
        ));
    }
    if l.scenario.topology.prometheus.is_some() && !matches!(target.name(), "local" | "netns") {
        return Some(format!(
            "runs Prometheus beside the runner (topology `prometheus`), which scrapes the servers' addresses on the local and netns targets only (this run uses {})",
            target.name()
        ));
    }
    if !target.runs_python() && runs_python(l) {
        return Some(format!(
            "runs Python in its pods, but the {} target's pods run the client image, which has no Python (python steps run on the local and netns targets)",
            target.name()
        ));
    }
    if !target.freezes() && l.scenario.any_step(freezes) {
        return Some(format!(
            "freezes a process (kill -STOP), which the {} target cannot do (local, netns and docker can)",
            target.name()
        ));
    }
    if !target.cuts_links() && l.scenario.any_step(cuts_links) {
        return Some(format!(
            "cuts a network link, which the {} target cannot do (netns can)",
            target.name()
        ));
    }
    if !target.keeps_killed_agents_down() && l.scenario.any_step(kills_an_agent) {
        return Some(format!(
            "kills a pod's agent and expects it down, but on the {} target the kubelet restarts a dead sidecar at once",
            target.name()
        ));
    }
    None
}

/// Does `l` have a `python` step (anywhere, `finally` too)?
pub fn runs_python(l: &Loaded) -> bool {
    l.scenario
        .any_step(|s| matches!(s.action, Action::Python(_)))
}

/// Does this step kill an agent alone?
fn kills_an_agent(step: &Step) -> bool {
    matches!(&step.action, Action::Kill(k) if matches!(k.victim(), Ok(Victim::Agent(_))))
}

/// Does this step cut or restore a link?
fn cuts_links(step: &Step) -> bool {
    matches!(step.action, Action::Link(_))
}

/// Does this step freeze or thaw something?
fn freezes(step: &Step) -> bool {
    matches!(&step.action, Action::Kill(k) if k.signal.freezes())
}

/// Is `l` a CUDA scenario (tag `gpu`, or a pod with `gpu: true`)?
pub fn needs_gpu(l: &Loaded) -> bool {
    l.scenario.tags.iter().any(|t| t == "gpu") || l.scenario.topology.pods.iter().any(|p| p.gpu)
}

/// Why CUDA is not usable here (None: it is). `KT_GPU=1` says it is;
/// otherwise `nvidia-smi -L` must list a device. Asked once per run.
pub fn cuda_missing() -> Option<String> {
    static PROBE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PROBE
        .get_or_init(|| {
            let forced = std::env::var(kt_types::env::GPU).is_ok_and(|v| v == "1");
            let listed = || {
                std::process::Command::new("nvidia-smi")
                    .arg("-L")
                    .stdin(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .output()
                    .is_ok_and(|o| o.status.success() && !o.stdout.trim_ascii().is_empty())
            };
            (!forced && !listed()).then(|| {
                "no CUDA device here (nvidia-smi -L failed); gpu scenarios run on GPU runners (.github/workflows/gpu.yml)"
                    .to_owned()
            })
        })
        .clone()
}

impl Runner {
    pub fn new(opts: Options, snapshots: Snapshots, live: Live) -> Runner {
        let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        Runner {
            opts,
            snapshots,
            live,
            run_id,
            cancel: CancellationToken::new(),
        }
    }

    /// Is `l` selected by the tag filters?
    pub fn selected(&self, l: &Loaded) -> bool {
        let tags = &l.scenario.tags;
        (self.opts.tags.is_empty() || self.opts.tags.iter().any(|t| tags.contains(t)))
            && !self.opts.exclude_tags.iter().any(|t| tags.contains(t))
    }

    pub async fn run(&self, scenarios: &[Loaded], make_target: &TargetFactory) -> RunReport {
        let started = Instant::now();
        let started_at =
            humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
        let mut reports = Vec::new();
        let target_name = make_target().name().to_owned();
        let selected: Vec<&Loaded> = scenarios.iter().filter(|l| self.selected(l)).collect();
        for (i, l) in selected.iter().enumerate() {
            let mut target = make_target();
            let report = if self.cancel.is_cancelled() {
                self.skipped(l, "interrupted".into())
            } else if let Some(why) = skip_reason(l, target.as_ref(), &self.opts) {
                self.live.skipped(&l.name, &why);
                self.skipped(l, why)
            } else {
                self.live.scenario_start(&l.name, i + 1, selected.len());
                let r = self.scenario(l, target.as_mut()).await;
                self.live.scenario_end(&r);
                r
            };
            reports.push(report);
        }
        RunReport {
            run_id: self.run_id.clone(),
            target: target_name,
            started_at,
            duration_ms: ms(started.elapsed()),
            scenarios: reports,
            unreferenced_snapshots: Vec::new(),
        }
    }

    fn skipped(&self, l: &Loaded, why: String) -> ScenarioReport {
        ScenarioReport {
            name: l.name.clone(),
            file: l.file.display().to_string(),
            tags: l.scenario.tags.clone(),
            status: Status::Skipped,
            message: Some(why),
            setup_ms: 0.0,
            pods: 0,
            duration_ms: 0.0,
            steps: vec![],
            snapshot: None,
            snapshot_diff: None,
            dump_dir: None,
        }
    }

    async fn scenario(&self, l: &Loaded, target: &mut dyn Target) -> ScenarioReport {
        let started = Instant::now();
        let mut report = self.skipped(l, String::new());
        report.message = None;
        let work = self
            .opts
            .work_root
            .join(format!("{}-{}", l.name, self.run_id));
        let token = format!("kt-scenario-{}", uuid::Uuid::new_v4().simple());
        let mut plan = scenario_plan(l, &self.run_id, &work, &self.opts.bin_dir, &token);
        plan.python = self.opts.python.clone();
        let pods = plan.pods.clone();
        report.pods = pods.len();
        let mut failure: Option<String> = None;
        let mut scn = None;
        // Data first (not part of the testbed's start-up time).
        let data = match data::generate_all(&l.scenario.data, &work.join("data")) {
            Ok(d) => Some(d),
            Err(e) => {
                failure = Some(format!("generating data: {e}"));
                None
            }
        };
        let dump_dir = self.opts.report_dir.join(&l.name);
        let mut dumped = false;
        if let Some(data) = data {
            let setup = Instant::now();
            // Not raced against Ctrl-C: only once `up` returns does the target
            // know everything it made (its own waits have timeouts), and
            // `down` below removes it.
            let up = target
                .up(&plan)
                .await
                .map_err(|e| format!("bringing up the {} testbed: {e}", target.name()));
            // Where the pods can read the data sets they put.
            let up = match up {
                Ok(()) => target
                    .stage_data(&data_uses(l, &pods, &data))
                    .await
                    .map_err(|e| format!("copying data sets into pods: {e}")),
                Err(e) => Err(e),
            };
            report.setup_ms = ms(setup.elapsed());
            match up {
                Err(e) => failure = Some(e),
                Ok(()) if self.cancel.is_cancelled() => failure = Some("interrupted".into()),
                Ok(()) => {
                    let timeout = l.scenario.timeout.unwrap_or(SCENARIO_TIMEOUT);
                    // A cluster's install takes Kubernetes identities: the
                    // runner is its operator then.
                    let token = target.operator_token().unwrap_or(token);
                    let s = Scn::new(self, l, &*target, pods, data, token, &work);
                    s.set_deadline(Instant::now() + timeout);
                    let body = async {
                        if let Err(e) = s.start_prometheus().await {
                            return Some(format!("starting prometheus: {e}"));
                        }
                        for (i, step) in l.scenario.steps.iter().enumerate() {
                            if let Err(e) = s.step(format!("{}", i + 1), step).await {
                                return Some(e.to_string());
                            }
                        }
                        None
                    };
                    failure = tokio::select! {
                        f = body => f,
                        () = self.cancel.cancelled() => Some("interrupted".to_owned()),
                    };
                    if let Some(f) = &failure {
                        // The state at the failure, before `finally` changes it.
                        self.dump(&dump_dir, target, Some(&s), f).await;
                        dumped = true;
                    }
                    // `finally` runs whatever happened, unless the user
                    // interrupted the run; each of its steps gets a fresh limit.
                    if !self.cancel.is_cancelled() {
                        for (i, step) in l.scenario.finally.iter().enumerate() {
                            s.set_deadline(Instant::now() + STEP_TIMEOUT);
                            if let Err(e) = s.step(format!("finally.{}", i + 1), step).await
                                && failure.is_none()
                            {
                                failure = Some(e.to_string());
                            }
                        }
                    }
                    scn = Some(s);
                }
            }
        }
        if let Some(s) = &scn {
            report.steps = s.steps.lock().map(|v| v.clone()).unwrap_or_default();
            if failure.is_none() {
                let value = s.snapshot_value();
                let outcome = self.snapshots.assert(
                    &l.name,
                    &l.file,
                    l.scenario.description.as_deref().unwrap_or(&l.name),
                    &value,
                );
                report.snapshot = Some(outcome.file.display().to_string());
                if !outcome.ok && self.snapshots.mode() == crate::snapshot::Mode::Accept {
                    self.live.line(&format!(
                        "snapshot {} changed; accepting it:\n{}",
                        outcome.file.display(),
                        outcome.diff.as_deref().unwrap_or_default()
                    ));
                } else if !outcome.ok {
                    failure = Some(format!(
                        "snapshot {} does not match",
                        outcome.file.display()
                    ));
                    report.snapshot_diff = outcome.diff;
                }
            }
        }
        if let Some(f) = &failure {
            report.status = Status::Failed;
            report.message = Some(f.clone());
            if !dumped {
                self.dump(&dump_dir, target, scn.as_ref(), f).await;
            }
            if let Some(d) = &report.snapshot_diff {
                let _ = std::fs::write(dump_dir.join("snapshot.diff"), d);
            }
            report.dump_dir = Some(dump_dir.display().to_string());
            if self.opts.keep {
                self.live.line(&format!(
                    "kept the testbed of {} up: metadata {}  token {}  work {}; Ctrl-C tears it down",
                    l.name,
                    target.metadata_url(),
                    target.operator_token().unwrap_or_else(|| plan.token.clone()),
                    work.display()
                ));
                let _ = tokio::signal::ctrl_c().await;
            }
        } else {
            report.status = Status::Passed;
        }
        // Held processes end before the testbed does (after `--keep`'s
        // pause, which keeps them up too).
        if let Some(s) = &scn {
            s.stop_holders().await;
        }
        if let Err(e) = target.down().await {
            self.live
                .line(&format!("warning: tearing down {}: {e}", l.name));
        }
        if !self.opts.keep || failure.is_none() {
            let _ = std::fs::remove_dir_all(&work);
        }
        report.duration_ms = ms(started.elapsed());
        report
    }

    /// Writes what a failure needs into `dir`: component logs, the metadata
    /// server's state, the failing steps' context and the snapshot diff.
    async fn dump(&self, dir: &Path, target: &dyn Target, scn: Option<&Scn<'_>>, failure: &str) {
        let _ = std::fs::remove_dir_all(dir);
        if let Err(e) = std::fs::create_dir_all(dir) {
            self.live
                .line(&format!("warning: cannot create {}: {e}", dir.display()));
            return;
        }
        let mut notes = vec![format!("failure: {failure}")];
        if let Err(e) = target.collect_logs(&dir.join("logs")).await {
            notes.push(format!("collecting logs: {e}"));
        }
        if let Some(s) = scn {
            // Bounded: the metadata server may be the thing that is wedged.
            let state = tokio::time::timeout(DUMP_TIMEOUT, s.metadata_dump())
                .await
                .unwrap_or_else(|_| Err(StepError::Probe("timed out".into())));
            match state {
                Ok(v) => {
                    let _ = std::fs::write(
                        dir.join("metadata.json"),
                        serde_json::to_vec_pretty(&v).unwrap_or_default(),
                    );
                }
                Err(e) => notes.push(format!("metadata state unavailable: {e}")),
            }
            let context = s.context.lock().map(|c| c.join("\n")).unwrap_or_default();
            notes.push(context);
        }
        let _ = std::fs::write(dir.join("failure.txt"), notes.join("\n\n"));
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// What a target brings up for scenario `l` in the work dir `work`.
pub fn scenario_plan(l: &Loaded, run_id: &str, work: &Path, bin_dir: &Path, token: &str) -> Plan {
    Plan {
        run_id: run_id.to_owned(),
        scenario: l.name.clone(),
        work_dir: work.to_owned(),
        bin_dir: bin_dir.to_owned(),
        token: token.to_owned(),
        chunk_size: l.scenario.topology.store.chunk_size.map(|s| s.0),
        store_link_bps: (l.scenario.topology.store.link.as_deref())
            .and_then(|s| parse_link(s).ok()),
        metadata_flags: l.scenario.topology.metadata.flags(),
        pods: expand_pods(l),
        python: None,
        nodes: l.scenario.topology.nodes.clone(),
        s3: l.scenario.topology.s3.clone(),
    }
}

/// Which pod puts which generated data set (the set's host path in
/// `data`), from every `put` with `data:` in the scenario's steps, in
/// order, without repeats: what [`Target::stage_data`] copies.
pub fn data_uses(
    l: &Loaded,
    pods: &[PodPlan],
    data: &BTreeMap<String, PathBuf>,
) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let mut visit = |_: &str, s: &Step| {
        let Action::Put(p) = &s.action else { return };
        let Some(host) = p.data.as_ref().and_then(|d| data.get(d)) else {
            return;
        };
        let exact = pods.iter().any(|x| x.name == p.pod);
        for x in pods
            .iter()
            .filter(|x| x.name == p.pod || (!exact && x.group == p.pod))
        {
            let u = (x.name.clone(), host.clone());
            if !out.contains(&u) {
                out.push(u);
            }
        }
    };
    for s in l.scenario.steps.iter().chain(&l.scenario.finally) {
        s.walk("", &mut visit);
    }
    out
}

/// Pod instances of a scenario's topology, in order.
pub fn expand_pods(l: &Loaded) -> Vec<PodPlan> {
    let topo = &l.scenario.topology;
    let mut out = Vec::new();
    for p in &topo.pods {
        let link = p
            .link
            .as_ref()
            .or(topo.link.as_ref())
            .and_then(|s| parse_link(s).ok());
        for i in 0..p.replicas {
            out.push(PodPlan {
                name: if p.replicas == 1 {
                    p.name.clone()
                } else {
                    format!("{}-{i}", p.name)
                },
                group: p.name.clone(),
                index: i,
                service: p.service.clone(),
                labels: p.labels.clone(),
                gpu: p.gpu,
                link_bps: link,
                node: p.node.clone(),
            });
        }
    }
    out
}

/// One running scenario.
struct Scn<'a> {
    runner: &'a Runner,
    loaded: &'a Loaded,
    target: &'a dyn Target,
    ctx: Context,
    pods: Vec<PodPlan>,
    data: BTreeMap<String, PathBuf>,
    digests: Mutex<BTreeMap<String, Digest>>,
    token: String,
    client: Option<Client>,
    /// For readiness and metrics polls.
    http: reqwest::Client,
    redactor: Redactor,
    steps: Mutex<Vec<StepReport>>,
    /// Step outcomes and records for the snapshot.
    outcomes: Mutex<Vec<(String, Value)>>,
    records: Mutex<BTreeMap<String, Value>>,
    /// Text about failed steps, for the dump.
    context: Mutex<Vec<String>>,
    /// No step runs past this (the scenario's timeout; then per `finally` step).
    deadline: Mutex<Instant>,
    /// Processes `tensor_put` steps with `hold` left running, by `as` name.
    holders: tokio::sync::Mutex<BTreeMap<String, Vec<Holder>>>,
    /// The version each Dataset (`namespace/name`) had at the last
    /// `wait_dataset` of it (for `new_version`).
    dataset_versions: Mutex<BTreeMap<String, String>>,
    /// The scenario's work directory.
    work: PathBuf,
    /// The topology's Prometheus, once started (`runner::promql`).
    prometheus: tokio::sync::Mutex<Option<crate::prometheus::Prometheus>>,
}

impl<'a> Scn<'a> {
    fn new(
        runner: &'a Runner,
        loaded: &'a Loaded,
        target: &'a dyn Target,
        pods: Vec<PodPlan>,
        data: BTreeMap<String, PathBuf>,
        token: String,
        work: &Path,
    ) -> Scn<'a> {
        let mut cfg = ClientConfig::new(target.metadata_url(), token.clone());
        cfg.timeout = HTTP_TIMEOUT * 6;
        let client = Client::new(cfg).ok();
        let mut literals = vec![
            (work.display().to_string(), "[work]".to_owned()),
            (runner.run_id.clone(), "[run]".to_owned()),
            (token.clone(), "[token]".to_owned()),
        ];
        literals.extend(target.aliases());
        let redactor = Redactor::with(literals);
        let mut ctx = Context::new(&loaded.name, &runner.run_id, &loaded.scenario.vars);
        if let Some(endpoint) = target.s3_endpoint() {
            ctx.values.insert("s3".to_owned(), endpoint);
        }
        Scn {
            runner,
            loaded,
            target,
            ctx,
            pods,
            data,
            digests: Mutex::new(BTreeMap::new()),
            token,
            client,
            http: kt_api::client_builder()
                .timeout(HTTP_TIMEOUT)
                .build()
                .unwrap_or_default(),
            redactor,
            steps: Mutex::new(Vec::new()),
            outcomes: Mutex::new(Vec::new()),
            records: Mutex::new(BTreeMap::new()),
            context: Mutex::new(Vec::new()),
            deadline: Mutex::new(Instant::now() + SCENARIO_TIMEOUT),
            holders: tokio::sync::Mutex::new(BTreeMap::new()),
            dataset_versions: Mutex::new(BTreeMap::new()),
            work: work.to_owned(),
            prometheus: tokio::sync::Mutex::new(None),
        }
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_deadline(&self, at: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    /// Pod instances a name selects (a group or one instance).
    fn select(&self, name: &str) -> Vec<&PodPlan> {
        let exact: Vec<&PodPlan> = self.pods.iter().filter(|p| p.name == name).collect();
        if !exact.is_empty() {
            return exact;
        }
        self.pods.iter().filter(|p| p.group == name).collect()
    }

    fn components(&self, name: &str) -> Vec<Component> {
        match name {
            "metadata" => vec![Component::Metadata],
            "store" => vec![Component::Store],
            pod => self
                .select(pod)
                .into_iter()
                .map(|p| Component::Pod(p.name.clone()))
                .collect(),
        }
    }

    fn expand(&self, s: &str) -> Result<String, StepError> {
        Ok(self.ctx.expand(s)?)
    }

    fn token_for(&self, auth: Auth) -> Option<String> {
        match auth {
            Auth::Valid => Some(self.token.clone()),
            Auth::Missing => None,
            Auth::Wrong => Some("not-the-token".into()),
        }
    }

    /// One step (and, for groups, its children). Err: the step failed.
    fn step(&'a self, index: String, step: &'a Step) -> BoxFuture<'a, Result<(), StepError>> {
        async move {
            let label = self.describe(step);
            self.runner.live.step_start(&index, &label);
            let started = Instant::now();
            let cpu_before = cpu::CpuTimes::now();
            // A step's own limit, capped by the scenario's: a step that runs
            // into the scenario timeout still reports itself.
            let left = self.deadline().saturating_duration_since(started);
            let own = step.timeout.unwrap_or(match step.action {
                Action::Parallel(_) | Action::Sequence(_) => left,
                _ => STEP_TIMEOUT,
            });
            let limit = own.min(left);
            // Groups report their children first, then themselves.
            let mut result = StepResult {
                index: index.clone(),
                ..StepResult::default()
            };
            let run = async {
                match &step.action {
                    Action::Parallel(children) => {
                        let runs = children
                            .iter()
                            .enumerate()
                            .map(|(i, c)| self.step(format!("{index}.{}", i + 1), c));
                        let errs: Vec<StepError> = join_all(runs)
                            .await
                            .into_iter()
                            .filter_map(Result::err)
                            .collect();
                        if errs.is_empty() {
                            Ok(())
                        } else {
                            Err(StepError::Several(errs))
                        }
                    }
                    Action::Sequence(children) => {
                        for (i, c) in children.iter().enumerate() {
                            self.step(format!("{index}.{}", i + 1), c).await?;
                        }
                        Ok(())
                    }
                    _ => self.action(step, started, &mut result).await,
                }
            };
            let r = match tokio::time::timeout(limit, run).await {
                Ok(r) => r,
                Err(_) => Err(StepError::Timeout(limit)),
            };
            let duration = started.elapsed();
            let cpu_busy = cpu_before
                .zip(cpu::CpuTimes::now())
                .and_then(|(a, b)| a.busy_until(&b));
            let mut r = r;
            let mut report = StepReport {
                index: index.clone(),
                name: step.name.clone().unwrap_or_else(|| label.clone()),
                kind: step.action.kind().to_owned(),
                status: Status::Passed,
                error: None,
                duration_ms: ms(duration),
                op_ms: ms(result.op),
                overhead_ms: result
                    .ran_commands
                    .then(|| ms(duration.saturating_sub(result.op + result.verify))),
                budgets: vec![],
                pods: result.pods,
                cpu_busy,
            };
            if let Some(b) = &step.budget {
                let durations: Vec<f64> = if report.pods.is_empty() {
                    vec![report.duration_ms]
                } else {
                    report.pods.iter().map(|p| p.duration_ms).collect()
                };
                report.budgets = budget_checks(b, &durations);
                let broken: Vec<BudgetCheck> =
                    report.budgets.iter().filter(|c| !c.ok).cloned().collect();
                if r.is_ok() && !broken.is_empty() {
                    r = Err(StepError::Budget(broken));
                }
            }
            if let Err(e) = &r {
                report.status = Status::Failed;
                report.error = Some(e.to_string());
                if let Ok(mut c) = self.context.lock() {
                    c.push(format!(
                        "step {index} ({label}) failed: {e}\n{}",
                        result.context
                    ));
                }
            }
            self.runner.live.step_end(&report);
            // The snapshot sees the outcome, not the timing.
            let outcome = match (&r, &step.expect) {
                (Err(e), _) => json!({ "failed": self.redactor.string(&e.to_string()) }),
                (Ok(()), Expect::Ok) => json!("ok"),
                (Ok(()), Expect::Error { code, .. }) => json!({ "error": code }),
            };
            let mut entry =
                json!({ "step": index, "do": self.redactor.string(&label), "outcome": outcome });
            if let Some(n) = &step.name {
                entry["name"] = json!(n);
            }
            if let Ok(mut o) = self.outcomes.lock() {
                o.push((index.clone(), entry));
            }
            if let (Some(name), Some(v)) = (&step.record, result.record)
                && let Ok(mut rec) = self.records.lock()
            {
                rec.insert(name.clone(), v);
            }
            if let Ok(mut s) = self.steps.lock() {
                s.push(report);
            }
            r
        }
        .boxed()
    }

    /// A short description of a step, for the live view and the snapshot.
    fn describe(&self, step: &Step) -> String {
        let x = |s: &str| self.ctx.expand(s).unwrap_or_else(|_| s.to_owned());
        match &step.action {
            Action::Put(p) => format!(
                "put {} from {} ({})",
                x(&p.key),
                p.pod,
                p.data.clone().or(p.src.clone()).unwrap_or_default()
            ),
            Action::Get(g) => format!("get {} into {}", x(&g.key), g.pod),
            Action::Ls(l) => format!("ls {}", x(&l.prefix)),
            Action::Rm(r) => format!("rm {}{}", if r.recursive { "-r " } else { "" }, x(&r.key)),
            Action::Broadcast(g) => format!("broadcast {} into {}", x(&g.key), g.pod),
            Action::Teardown(t) => format!("teardown {}", t.service),
            Action::Kill(k) => match k.victim() {
                _ if k.node.is_some() => {
                    format!("lose node {}", k.node.as_deref().unwrap_or_default())
                }
                Ok(Victim::Agent(p)) => format!("kill -{:?} the agent of {p}", k.signal),
                Ok(Victim::Component(c)) => format!("kill -{:?} {c}", k.signal),
                Err(_) => "kill".to_owned(),
            },
            Action::Link(l) => format!(
                "link of {} {}",
                l.component,
                match l.state {
                    LinkState::Down => "down",
                    LinkState::Up => "up",
                }
            ),
            Action::Restart(r) => match r.victim() {
                Ok(Victim::Agent(p)) => format!("restart the agent of {p}"),
                Ok(Victim::Component(c)) => format!("restart {c}"),
                Err(_) => "restart".to_owned(),
            },
            Action::Wait(w) => match &w.condition {
                Condition::Ready(c) => format!("wait for {c} ready"),
                Condition::Key(k) => format!("wait for key {}", x(k)),
                Condition::NoKey(k) => format!("wait for key {} to go", x(k)),
                Condition::Metric(m) => {
                    format!("wait for {} {} >= {}", m.component, m.name, m.at_least)
                }
                Condition::Leases(n) => format!("wait for at most {n} source leases"),
                Condition::Peers(p) => format!("wait for {} peers of {}", p.at_least, x(&p.key)),
                Condition::Members(m) => {
                    format!("wait for {} members of group {}", m.at_least, x(&m.group))
                }
            },
            Action::Assert(_) => "assert".to_owned(),
            Action::Snapshot(s) => format!("snapshot {}", s.name),
            Action::Exec(e) => format!(
                "exec in {}: {} {}",
                e.pod,
                e.program.as_deref().unwrap_or("kt"),
                e.args.iter().map(|a| x(a)).collect::<Vec<_>>().join(" ")
            ),
            Action::Python(p) => {
                // Its first line that does something, as written (a script
                // is not a template).
                let lines = || p.script.lines().map(str::trim).filter(|l| !l.is_empty());
                let busy = |l: &&str| {
                    !l.starts_with('#') && !l.starts_with("import ") && !l.starts_with("from ")
                };
                let first = lines().find(busy).or_else(|| lines().next());
                let mut line: String = first.unwrap_or("").chars().take(60).collect();
                if first.is_some_and(|l| l.chars().count() > 60) {
                    line.push('…');
                }
                format!("python in {}: {line}", p.pod)
            }
            Action::Metrics(m) => format!("metric {} of {}", m.name, m.component),
            Action::TensorPut(p) => {
                let mut d = format!("tensor put {} from {} ({}", x(&p.key), p.pod, x(&p.layout));
                if let Some(r) = p.repeat {
                    d.push_str(&format!(" x{r}"));
                }
                d.push(')');
                if p.broadcast.is_some() {
                    d.push_str(", broadcast");
                }
                if let Some(n) = p.name.as_ref().filter(|_| p.hold) {
                    d.push_str(&format!(", held as {n}"));
                }
                d
            }
            Action::TensorGet(g) => {
                let keys: Vec<String> = g.all_keys().into_iter().map(x).collect();
                let mut d = format!("tensor get {} into {}", keys.join(","), g.pod);
                if g.broadcast.is_some() {
                    d.push_str(", broadcast");
                } else if !g.pack {
                    d.push_str(", unpacked");
                }
                d
            }
            Action::TensorLs(t) => format!("tensor ls in {}", t.pod),
            Action::Stop(st) => format!(
                "stop -{:?} holder {}",
                st.signal.unwrap_or(Signal::TERM),
                st.holder
            ),
            Action::Dataset(d) => match (&d.apply, &d.delete) {
                (Some(a), _) => format!(
                    "apply dataset {}",
                    a.get("name").and_then(Value::as_str).unwrap_or_default()
                ),
                (None, Some(n)) => format!("delete dataset {n}"),
                (None, None) => "dataset".to_owned(),
            },
            Action::WaitDataset(w) => format!("wait for dataset {} to be {}", w.name, w.phase),
            Action::ReadDataset(r) => format!("read dataset {} in {}", r.dataset, r.pod),
            Action::S3Put(s) => format!("sync {} into s3://{}/{}", s.data, s.bucket, x(&s.prefix)),
            Action::Promql(q) => format!("promql {}", q.query),
            Action::Parallel(c) => format!("parallel ({} steps)", c.len()),
            Action::Sequence(c) => format!("sequence ({} steps)", c.len()),
        }
    }

    /// Checks the commands' outcomes against the step's expectation and
    /// fills the per-pod part of the result.
    fn settle(
        &self,
        step: &Step,
        runs: &[PodRun],
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        result.ran_commands = true;
        let mut failed = Vec::new();
        // The operation spans from the first command's start to the last
        // one's exit: with many pods, their commands compete for the cores
        // and start one after another, which is part of the operation.
        let (mut first_start, mut last_end) = (None::<Duration>, Duration::ZERO);
        for run in runs {
            let d = match &run.out {
                Ok(o) => o.duration,
                Err(_) => Duration::ZERO,
            };
            let start = run.finished.saturating_sub(d);
            first_start = Some(first_start.map_or(start, |f| f.min(start)));
            last_end = last_end.max(run.finished);
            result.op = last_end.saturating_sub(first_start.unwrap_or_default());
            let checked = check_expect(&step.expect, run.class(), &run.message());
            if let Err(e) = &checked {
                failed.push((run.pod.clone(), e.clone()));
                let error;
                let (stdout, stderr) = match &run.out {
                    Ok(o) => (o.stdout.as_str(), o.stderr.as_str()),
                    Err(e) => {
                        error = e.to_string();
                        ("", error.as_str())
                    }
                };
                result.context.push_str(&format!(
                    "--- pod {}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}\n",
                    run.pod,
                    run.args.join(" ")
                ));
            }
            result.pods.push(PodResult {
                pod: run.pod.clone(),
                ok: checked.is_ok(),
                duration_ms: ms(d),
                finished_at_ms: ms(run.finished),
                exit_code: run.out.as_ref().ok().map(|o| o.status),
                error: checked.err().map(|e| e.to_string()),
                stdout: run
                    .out
                    .as_ref()
                    .ok()
                    .filter(|o| !o.stdout.is_empty())
                    .map(|o| o.stdout.chars().take(1024).collect()),
            });
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(StepError::Pods {
                failed,
                pods: runs.len(),
            })
        }
    }

    /// A step's own action (a group's children run in [`Scn::step`]): one
    /// method per step kind, in the module of its family.
    async fn action(
        &self,
        step: &Step,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        match &step.action {
            Action::Put(p) => self.put(step, p, started, result).await,
            Action::Get(g) | Action::Broadcast(g) => self.get(step, g, started, result).await,
            Action::Ls(l) => self.ls(step, l, started, result).await,
            Action::Rm(r) => self.rm(step, r, started, result).await,
            Action::Exec(e) => self.exec(step, e, started, result).await,
            Action::Python(p) => self.python(step, p, started, result).await,
            Action::Kill(k) => self.kill(step, k).await,
            Action::Restart(r) => self.restart(step, r).await,
            Action::Link(l) => self.link(step, l).await,
            Action::TensorPut(p) => self.tensor_put(step, p, started, result).await,
            Action::TensorGet(g) => self.tensor_get(step, g, started, result).await,
            Action::TensorLs(t) => self.tensor_ls(step, t, started, result).await,
            Action::Stop(st) => self.stop(step, st, started, result).await,
            Action::Dataset(d) => self.dataset(step, d).await,
            Action::WaitDataset(w) => self.wait_dataset(step, w, result).await,
            Action::ReadDataset(r) => self.read_dataset(step, r, result).await,
            Action::S3Put(s) => self.s3_put(step, s, result).await,
            Action::Promql(q) => {
                let outcome = self.promql(q, result).await;
                self.expect_plain(step, outcome)
            }
            Action::Wait(w) => self.wait(step, w, result).await,
            Action::Assert(a) => {
                let outcome = self.assert(a).await;
                self.expect_plain(step, outcome)
            }
            Action::Snapshot(s) => self.snapshot(s).await,
            Action::Teardown(t) => self.teardown(step, t, started, result).await,
            Action::Metrics(m) => self.metrics(step, m, result).await,
            Action::Parallel(_) | Action::Sequence(_) => Ok(()),
        }
    }

    /// Checks a non-command outcome against the expectation.
    fn expect_plain(&self, step: &Step, outcome: Result<(), StepError>) -> Result<(), StepError> {
        let msg = outcome
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default();
        check_expect(
            &step.expect,
            outcome.err().map(|_| ErrorClass::Failed),
            &msg,
        )?;
        Ok(())
    }

    fn pod_or_first(&self, name: Option<&str>) -> Result<&PodPlan, StepError> {
        match name {
            Some(n) => self.select(n).into_iter().next(),
            None => self.pods.first(),
        }
        .ok_or_else(|| StepError::Input("the topology has no pod to run kt in".to_owned()))
    }

    fn client(&self) -> Result<&Client, StepError> {
        self.client
            .as_ref()
            .ok_or_else(|| StepError::Probe("no client for the metadata server".to_owned()))
    }

    /// The scenario's snapshot: every step's outcome and what was recorded.
    fn snapshot_value(&self) -> Value {
        let mut outcomes = self.outcomes.lock().map(|o| o.clone()).unwrap_or_default();
        // Execution order differs inside parallel groups; the snapshot must not.
        outcomes.sort_by_key(|a| index_order(&a.0));
        let records = self.records.lock().map(|r| r.clone()).unwrap_or_default();
        // Redacted here, in one deterministic pass, so ids are numbered in
        // the snapshot's order rather than in the order parallel steps ended.
        self.redactor.value(&json!({
            "scenario": self.loaded.name,
            "steps": outcomes.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
            "recorded": records,
        }))
    }
}

/// `3.10` after `3.9`; `finally.1` after every numbered step.
fn index_order(i: &str) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::new();
    for part in i.split('.') {
        match part {
            "finally" => v.push(u64::MAX),
            n => v.push(n.parse().unwrap_or(0)),
        }
    }
    v
}

/// What one step's action produced beside success or failure.
#[derive(Debug, Default)]
struct StepResult {
    /// The step's index (for the live view).
    index: String,
    /// From the first command's start to the last one's exit.
    op: Duration,
    /// Time spent verifying what getters received.
    verify: Duration,
    ran_commands: bool,
    pods: Vec<PodResult>,
    record: Option<Value>,
    context: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_indices_sort_numerically() {
        let mut v = vec!["10", "2", "finally.1", "3.10", "3.9", "3"];
        v.sort_by_key(|i| index_order(i));
        assert_eq!(v, vec!["2", "3", "3.9", "3.10", "10", "finally.1"]);
    }
}
