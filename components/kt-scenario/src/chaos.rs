//! The chaos soak (`kt-scenario chaos`, `make chaos`): for a while, a
//! seeded workload of puts, local puts, gets, broadcasts and tensor
//! transfers (`kt tensor put --hold` in one pod, `kt tensor get` verified
//! in another) runs against a testbed while faults are injected at random:
//! the store and the metadata server killed (KILL or TERM) and started
//! again; the store, the metadata server and pods' agents frozen (STOP)
//! and thawed; pods' agents killed and started again; getters killed
//! midway (their get is then run again, mirroring); and (where the target
//! can cut links: netns) a pod's or the store's link cut for up to 5 s and
//! restored.
//!
//! Invariants, checked as it goes and at the end; a violation names the
//! seed and the operation that broke it:
//! - every get that succeeds holds exactly one version that was put under
//!   the key, verified by hash (no mixed or half-written tree), also when it
//!   runs again into what a killed get left;
//! - every put and get of a store key succeeds (the store restarting or
//!   freezing is waited for within the transfer's deadline);
//! - local puts and gets and tensor transfers fail only as a fault explains
//!   and no more often than a bound: [`rules`] names, per kind, the error
//!   codes that are tolerated; anything else (a 403, a 500, no code, a
//!   hang) is a violation;
//! - a tensor get that succeeds holds the bytes its key was put with
//!   (every put of a tensor key uses the same seed, so any version is
//!   right and a mix is caught);
//! - once the workload stops, source leases return to zero;
//! - no server or agent grows past a memory bound;
//! - the store's data directory holds no more than its keys need (staging
//!   leftovers are cleaned).
//!
//! The choice of operations and faults is reproducible from the seed; their
//! interleaving follows the machine's timing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub mod rules;

use crate::data::{Digest, Rng};
use crate::fault::{Fault, Hit};
use crate::format::{DataSpec, Signal};
use crate::target::{
    Component, ExecRequest, Plan, PodPlan, PodProcess, Program, Target, TargetError,
};

/// How a soak runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub seed: u64,
    pub duration: Duration,
    /// Pods that put and get.
    pub pods: usize,
    /// Operations in flight at once.
    pub workers: usize,
    /// The memory bound of every server and agent (resident set).
    pub max_rss: u64,
    pub work_dir: PathBuf,
    pub bin_dir: PathBuf,
}

/// What a soak did.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub elapsed: Duration,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Operations that succeeded, by kind.
    pub ok: BTreeMap<String, u64>,
    /// Operations that failed as a fault explains ([`rules`]), by kind and
    /// error code.
    pub tolerated: BTreeMap<(String, &'static str), u64>,
    /// What they said: the first few distinct messages of each kind and code.
    pub why: BTreeMap<(String, &'static str), BTreeSet<String>>,
    /// Largest resident set seen, by program.
    pub max_rss: BTreeMap<String, u64>,
    pub violations: Vec<String>,
}

impl Report {
    /// The summary `kt-scenario chaos` prints.
    pub fn render(&self) -> String {
        let line = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                return "none".to_owned();
            }
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let tolerated: BTreeMap<String, u64> = (self.tolerated.iter())
            .map(|((kind, code), n)| (format!("{kind} ({code})"), *n))
            .collect();
        let rss: BTreeMap<String, u64> = self
            .max_rss
            .iter()
            .map(|(k, v)| (k.clone(), v >> 20))
            .collect();
        let mut out = format!(
            "chaos: seed {} ran {:.0}s\n  faults:     {} ({} in all)\n  operations: {} ({} in all)\n  tolerated:  {}\n  max RSS MiB: {}\n  violations: {}\n",
            self.seed,
            self.elapsed.as_secs_f64(),
            line(&self.faults),
            self.faults.values().sum::<u64>(),
            line(&self.ok),
            self.ok.values().sum::<u64>(),
            line(&tolerated),
            line(&rss),
            self.violations.len(),
        );
        for ((kind, code), whys) in &self.why {
            for w in whys {
                out.push_str(&format!("  tolerated {kind} ({code}): {w}\n"));
            }
        }
        for v in &self.violations {
            out.push_str(&format!("  VIOLATION: {v}\n"));
        }
        out
    }
}

const STORE_KEYS: usize = 3;
const LOCAL_KEYS: usize = 2;
/// Keys only broadcast (put once, never again: a group's version is fixed,
/// so a put during a broadcast would fail its late joiners by design).
const BROADCAST_KEYS: usize = 2;
/// Every transfer's deadline: long enough for any injected outage.
const DEADLINE: &str = "60s";
/// Tensor keys, each held by one `kt tensor put --hold` at a time.
const TENSOR_KEYS: u64 = 2;
/// Their layout (0.5 MiB, CPU tensors over the host backend).
const TENSOR_LAYOUT: &str = "w=f32[256,256];b=f32[256]";
/// How long a tensor put or get may take before it counts as hung.
const TENSOR_WITHIN: Duration = Duration::from_secs(120);

/// The seed every put of tensor key `k` uses.
fn tensor_seed(k: u64) -> String {
    (31 + k).to_string()
}

/// The data sets the workload puts (small trees, chunked files, a mix).
fn data_specs() -> Vec<(&'static str, DataSpec)> {
    let spec = |yaml: &str| -> DataSpec {
        serde_yaml_ng::from_str(yaml).expect("a valid built-in data set")
    };
    vec![
        ("tree-a", spec("{ seed: 901, files: 60, dirs: 4 }")),
        (
            "tree-b",
            spec("{ seed: 902, files: 40, dirs: 3, large: [24MiB] }"),
        ),
        ("big", spec("{ seed: 903, large: [64MiB] }")),
        // Trees only: a get into a standing copy (a mirror) is exact for
        // trees, but a single-file key lands inside an existing directory.
        ("tree-c", spec("{ seed: 904, files: 5, large: [3MiB] }")),
    ]
}

/// Runs the soak on `target` (brought up and down here).
pub async fn run(mut target: Box<dyn Target>, opts: Options) -> Result<Report, TargetError> {
    if let Some(why) = target.unavailable() {
        return Err(TargetError::Unavailable(why));
    }
    let token = format!("chaos-{:016x}", opts.seed);
    let pods: Vec<PodPlan> = (0..opts.pods.max(2))
        .map(|i| PodPlan {
            name: format!("pod-{i}"),
            group: "pod".to_owned(),
            index: i,
            service: None,
            labels: BTreeMap::new(),
            gpu: false,
            link_bps: None,
            node: None,
        })
        .collect();
    let plan = Plan {
        run_id: format!("chaos{:x}", opts.seed & 0xffff_ffff),
        scenario: "chaos".to_owned(),
        work_dir: opts.work_dir.clone(),
        bin_dir: opts.bin_dir.clone(),
        token: token.clone(),
        chunk_size: Some(1 << 20),
        store_link_bps: None,
        metadata_flags: vec![
            "--agent-ttl".into(),
            "5s".into(),
            "--lease-ttl".into(),
            "5s".into(),
        ],
        pods: pods.clone(),
        python: None,
        nodes: None,
        s3: None,
    };
    // The data sets, generated once and digested.
    let data_dir = opts.work_dir.join("data");
    let mut sets = Vec::new();
    for (name, spec) in data_specs() {
        let path = data_dir.join(name);
        let (p, s) = (path.clone(), spec.clone());
        kt_sync::task::spawn(move || crate::data::generate(&s, None, &p))
            .await
            .map_err(|e| TargetError::Failed(e.0))?
            .map_err(|e| TargetError::Failed(format!("generating {name}: {e}")))?;
        let digest = digest(&path).await?;
        let size = kt_sync::du::disk_bytes(&path);
        sets.push(DataSet {
            name,
            path,
            digest,
            size,
        });
    }
    target.up(&plan).await?;
    let uses: Vec<(String, PathBuf)> = pods
        .iter()
        .flat_map(|p| sets.iter().map(|s| (p.name.clone(), s.path.clone())))
        .collect();
    let outcome = async {
        target.stage_data(&uses).await?;
        let target: &dyn Target = target.as_ref();
        soak(target, &opts, &plan, &token, &sets).await
    }
    .await;
    let down = target.down().await;
    let report = outcome?;
    down?;
    Ok(report)
}

struct DataSet {
    name: &'static str,
    path: PathBuf,
    digest: Digest,
    size: u64,
}

/// A held tensor put: its pod and its process.
type Holder = (String, Box<dyn PodProcess>);

/// The pods where a `kt tensor put` of each tensor key may be alive: from
/// the moment one is chosen to start there until its process has ended
/// (it failed, or it held and was replaced and stopped). In one pod the
/// agent refuses a key to a second process while the first lives
/// (`conflict`, by design), so a new put goes to a pod free of the key;
/// a `conflict` then stays a violation.
#[derive(Debug, Default)]
struct Putters(BTreeMap<String, BTreeSet<String>>);

impl Putters {
    /// Claims for a put of `key` one of `pods` where no process of it may
    /// be alive, picked by `rng`; None when every pod has one.
    fn claim(&mut self, rng: &mut Rng, key: &str, pods: &[String]) -> Option<String> {
        let alive = self.0.entry(key.to_owned()).or_default();
        let free: Vec<String> = pods
            .iter()
            .filter(|p| !alive.contains(*p))
            .cloned()
            .collect();
        if free.is_empty() {
            return None;
        }
        let pod = pick(rng, &free).to_owned();
        alive.insert(pod.clone());
        Some(pod)
    }

    /// The put of `key` in `pod` has ended (its process was waited for).
    fn release(&mut self, key: &str, pod: &str) {
        if let Some(alive) = self.0.get_mut(key) {
            alive.remove(pod);
        }
    }
}

/// Stops a holder (TERM, then KILL after 30 s): true when it ended by TERM.
async fn stop(mut p: Box<dyn PodProcess>) -> bool {
    let _ = p.signal(Signal::TERM).await;
    match tokio::time::timeout(Duration::from_secs(30), p.wait()).await {
        Ok(_) => true,
        Err(_) => {
            let _ = p.signal(Signal::KILL).await;
            let _ = p.wait().await;
            false
        }
    }
}

/// What every worker shares.
struct Shared<'a> {
    target: &'a dyn Target,
    token: String,
    pods: Vec<String>,
    sets: &'a [DataSet],
    /// Key → the data sets ever put under it (a get must hold one).
    attempted: Mutex<BTreeMap<String, BTreeSet<usize>>>,
    report: Mutex<Report>,
    /// Standing copies (`pod:key`) a get is writing now.
    busy: Mutex<BTreeSet<String>>,
    /// Numbered operations, for violations.
    op: std::sync::atomic::AtomicU64,
    until: Instant,
    /// The `kt tensor put --hold` holding each tensor key now.
    holders: tokio::sync::Mutex<BTreeMap<String, Holder>>,
    /// Where a put of each tensor key may be alive now.
    putters: Mutex<Putters>,
}

impl Shared<'_> {
    fn count(&self, which: fn(&mut Report) -> &mut BTreeMap<String, u64>, kind: &str) {
        let mut r = self.report.lock().unwrap_or_else(|p| p.into_inner());
        *which(&mut r).entry(kind.to_owned()).or_default() += 1;
    }

    /// A `kt` call of `kind` that exited with `status`: tolerated (with,
    /// the first few of each kind and code, what it said) when [`rules`]
    /// says a fault explains it, else a violation that names `what`.
    fn failed(&self, kind: &str, what: impl FnOnce() -> String, status: i32, stderr: &str) {
        let line = stderr.trim().lines().last().unwrap_or("").trim();
        let line: String = line.chars().take(300).collect();
        let code = match rules::judge(kind, rules::Failure::of(status, stderr)) {
            Ok(code) => code,
            Err(why) => {
                return self.violation(format!("{} (exit {status}): {why}: {line}", what()));
            }
        };
        let mut r = self.report.lock().unwrap_or_else(|p| p.into_inner());
        let at = (kind.to_owned(), code.as_str());
        *r.tolerated.entry(at.clone()).or_default() += 1;
        let whys = r.why.entry(at).or_default();
        if whys.len() < 3 {
            whys.insert(line);
        }
    }

    fn violation(&self, what: String) {
        let mut r = self.report.lock().unwrap_or_else(|p| p.into_inner());
        tracing::error!(%what, "chaos: invariant violated");
        r.violations.push(what);
    }

    async fn kt(
        &self,
        pod: &str,
        args: Vec<String>,
    ) -> Result<crate::target::ExecOutput, TargetError> {
        self.target
            .exec(ExecRequest {
                pod: pod.to_owned(),
                program: Program::Kt,
                args,
                env: ride_through(),
                token: Some(self.token.clone()),
            })
            .await
    }
}

async fn soak(
    target: &dyn Target,
    opts: &Options,
    plan: &Plan,
    token: &str,
    sets: &[DataSet],
) -> Result<Report, TargetError> {
    let started = Instant::now();
    let shared = Shared {
        target,
        token: token.to_owned(),
        pods: plan.pods.iter().map(|p| p.name.clone()).collect(),
        sets,
        attempted: Mutex::new(BTreeMap::new()),
        busy: Mutex::new(BTreeSet::new()),
        report: Mutex::new(Report {
            seed: opts.seed,
            ..Report::default()
        }),
        op: Default::default(),
        until: started + opts.duration,
        holders: Default::default(),
        putters: Default::default(),
    };
    // Every store key exists before the first fault: a get of a store key
    // must then always succeed.
    let mut rng = Rng::new(opts.seed ^ 0x5eed);
    for k in 0..STORE_KEYS {
        put(&shared, &mut rng, &format!("chaos/s{k}"), false).await;
    }
    for k in 0..BROADCAST_KEYS {
        put(&shared, &mut rng, &format!("chaos/b{k}"), false).await;
    }
    let workers = (0..opts.workers.max(1)).map(|w| {
        let shared = &shared;
        let seed = opts.seed.wrapping_add(1 + w as u64);
        async move {
            let mut rng = Rng::new(seed);
            while Instant::now() < shared.until {
                operation(shared, &mut rng).await;
            }
        }
    });
    let faults = inject(&shared, opts);
    futures::future::join(futures::future::join_all(workers), faults).await;
    // The tensor holders let go (their keys are dropped with them).
    for (key, (pod, h)) in std::mem::take(&mut *shared.holders.lock().await) {
        if !stop(h).await {
            shared.violation(format!(
                "the holder of {key} in {pod} did not end within 30 s of TERM"
            ));
        }
    }
    // Faults explain some failures of some kinds, not many of them.
    let over = {
        let r = shared.report.lock().unwrap_or_else(|p| p.into_inner());
        rules::over_bound(&r.ok, &r.tolerated)
    };
    for v in over {
        shared.violation(v);
    }
    // Quiet now: what must have returned to rest.
    let meta = kt_api::Api::new(kt_api::client(), &target.metadata_url(), token);
    let waited = Instant::now();
    loop {
        let list: Result<kt_types::api::LeaseList, _> =
            meta.get(&kt_types::paths::leases()).fetch().await;
        match list {
            Ok(l) if l.leases.is_empty() => break,
            Ok(l) if waited.elapsed() > Duration::from_secs(30) => {
                shared.violation(format!(
                    "{} source lease(s) still held 30 s after the workload stopped",
                    l.leases.len()
                ));
                break;
            }
            Err(e) if waited.elapsed() > Duration::from_secs(30) => {
                shared.violation(format!("the metadata server does not list leases: {e}"));
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    sample_rss(&shared, &plan.work_dir);
    check_rss(&shared, opts.max_rss);
    let store_dir = plan.work_dir.join("store");
    if store_dir.is_dir() {
        let used = kt_sync::du::disk_bytes(&store_dir);
        // Every key's current version, and one superseded version each that
        // may still be on its way out.
        let largest = sets.iter().map(|s| s.size).max().unwrap_or(0);
        let keys = (STORE_KEYS + BROADCAST_KEYS) as u64;
        let bound = 2 * keys * largest + (16 << 20);
        if used > bound {
            shared.violation(format!(
                "the store's data directory holds {}, more than its {keys} keys need ({}): staging leftovers?",
                kt_types::size::human(used),
                kt_types::size::human(bound)
            ));
        }
    }
    let mut report = shared
        .report
        .into_inner()
        .unwrap_or_else(|p| p.into_inner());
    report.elapsed = started.elapsed();
    Ok(report)
}

/// One random operation of the workload.
async fn operation(s: &Shared<'_>, rng: &mut Rng) {
    match rng.below(100) {
        0..=26 => {
            let k = rng.below(STORE_KEYS as u64);
            put(s, rng, &format!("chaos/s{k}"), false).await
        }
        27..=35 => {
            let k = rng.below(LOCAL_KEYS as u64);
            put(s, rng, &format!("chaos/l{k}"), true).await
        }
        36..=76 => {
            let (k, local) = if rng.below(4) == 0 {
                (format!("chaos/l{}", rng.below(LOCAL_KEYS as u64)), true)
            } else {
                (format!("chaos/s{}", rng.below(STORE_KEYS as u64)), false)
            };
            get(s, rng, &k, local).await
        }
        77..=85 => broadcast(s, rng).await,
        86..=91 => tensor_put(s, rng).await,
        _ => tensor_get(s, rng).await,
    }
}

fn pick<'a>(rng: &mut Rng, from: &'a [String]) -> &'a str {
    &from[rng.below(from.len() as u64) as usize]
}

async fn put(s: &Shared<'_>, rng: &mut Rng, key: &str, local: bool) {
    let n = s.op.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let set = rng.below(s.sets.len() as u64) as usize;
    let pod = pick(rng, &s.pods).to_owned();
    let src = match s.target.data_path(&pod, &s.sets[set].path) {
        Ok(p) => p,
        Err(e) => return s.violation(format!("op {n}: no data path: {e}")),
    };
    s.attempted
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key.to_owned())
        .or_default()
        .insert(set);
    let mut args = vec![
        "put".to_owned(),
        key.to_owned(),
        "--src".to_owned(),
        src,
        "--deadline".to_owned(),
        DEADLINE.to_owned(),
    ];
    if local {
        args.extend(["--locale".to_owned(), "local".to_owned()]);
    }
    let kind = if local { "local-put" } else { "put" };
    match s.kt(&pod, args).await {
        Ok(o) if o.status == 0 => s.count(|r| &mut r.ok, kind),
        // A local put needs the pod's own agent, which a fault may have
        // taken down for a moment ([`rules`]); a store put may not fail.
        Ok(o) => s.failed(
            kind,
            || {
                format!(
                    "op {n}: {kind} of {} under {key} from {pod} failed",
                    s.sets[set].name
                )
            },
            o.status,
            &o.stderr,
        ),
        Err(e) => s.violation(format!("op {n}: put under {key}: {e}")),
    }
}

/// Checks what a successful get wrote against the versions put under
/// `key`; the copy's path on this host.
async fn check_copy(s: &Shared<'_>, n: u64, key: &str, pod: &str, rel: &str) -> Option<PathBuf> {
    if let Err(e) = s.target.fetch(pod, Path::new(rel)).await {
        s.violation(format!("op {n}: fetching {rel} from {pod}: {e}"));
        return None;
    }
    let path = s.target.pod_dir(pod).join(rel);
    let got = match digest(&path).await {
        Ok(d) => d,
        Err(e) => {
            s.violation(format!("op {n}: {e}"));
            return Some(path);
        }
    };
    let attempted = s
        .attempted
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(key)
        .cloned()
        .unwrap_or_default();
    if !attempted.iter().any(|&i| s.sets[i].digest.hex == got.hex) {
        let names: Vec<&str> = attempted.iter().map(|&i| s.sets[i].name).collect();
        s.violation(format!(
            "op {n}: the copy of {key} in {pod} ({} files, {} bytes) is none of the versions put under it ({}): a mixed or half-written tree",
            got.files,
            got.bytes,
            names.join(", ")
        ));
    }
    Some(path)
}

/// Removes a copy that was checked (a file or a tree).
fn discard(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

/// A get: one in four into the pod's standing copy of the key (a mirror,
/// served by its agent afterwards: getters become sources), the others
/// into a fresh directory that is removed once checked.
async fn get(s: &Shared<'_>, rng: &mut Rng, key: &str, local: bool) {
    let n = s.op.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let pod = pick(rng, &s.pods).to_owned();
    // One get at a time into a standing copy (two into one directory at
    // once would be the user's race, not kt's).
    let standing = format!("{pod}:{key}");
    let serve = rng.below(4) == 0
        && s.busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(standing.clone());
    let rel = if serve {
        format!("chaos-serve/{key}")
    } else {
        format!("chaos-get/{n}")
    };
    let mut args = vec![
        "get".to_owned(),
        key.to_owned(),
        "--dest".to_owned(),
        rel.clone(),
        "--deadline".to_owned(),
        DEADLINE.to_owned(),
    ];
    args.push(if serve { "--delete" } else { "--no-serve" }.to_owned());
    let mut kind = if local { "local-get" } else { "get" };
    if !serve && rng.below(8) == 0 {
        // A getter killed midway (an OOM kill, a preempted pod); the same
        // get again, mirroring, must finish and hold exactly one version:
        // what the killed one left is resumed from or removed.
        let delay = Duration::from_millis(20 + rng.below(480));
        kill_a_get(s, n, &pod, args.clone(), delay).await;
        args.push("--delete".to_owned());
        kind = if local {
            "local-get-after-kill"
        } else {
            "get-after-kill"
        };
    }
    match s.kt(&pod, args).await {
        Ok(o) if o.status == 0 => {
            if let Some(copy) = check_copy(s, n, key, &pod, &rel).await
                && !serve
            {
                discard(&copy);
            }
            s.count(|r| &mut r.ok, kind);
        }
        // A local key never put yet, or its producer's agent down
        // ([`rules`]); a store key's get may not fail.
        Ok(o) => s.failed(
            kind,
            || format!("op {n}: {kind} of {key} into {pod} failed"),
            o.status,
            &o.stderr,
        ),
        Err(e) => s.violation(format!("op {n}: get of {key}: {e}")),
    }
    if serve {
        s.busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&standing);
    }
}

/// Starts `kt get ARGS` in `pod` and SIGKILLs it after `delay` (or lets it
/// be, if it ended first).
async fn kill_a_get(s: &Shared<'_>, n: u64, pod: &str, args: Vec<String>, delay: Duration) {
    let req = ExecRequest {
        pod: pod.to_owned(),
        program: Program::Kt,
        args,
        env: ride_through(),
        token: Some(s.token.clone()),
    };
    let killed = async {
        let mut p = s.target.spawn(req).await?;
        tokio::time::sleep(delay).await;
        // It may have ended by itself meanwhile: nothing to kill then.
        let _ = p.signal(Signal::KILL).await;
        p.wait().await
    }
    .await;
    match killed {
        Ok(_) => s.count(|r| &mut r.faults, "getter KILL"),
        Err(e) => s.violation(format!("op {n}: starting or killing a get in {pod}: {e}")),
    }
}

async fn broadcast(s: &Shared<'_>, rng: &mut Rng) {
    let n = s.op.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let key = format!("chaos/b{}", rng.below(BROADCAST_KEYS as u64));
    let group = format!("chaos-bc-{n}");
    let members = s
        .pods
        .len()
        .min(2 + rng.below(s.pods.len() as u64) as usize);
    let runs = s.pods.iter().take(members).map(|pod| {
        let (group, key) = (group.clone(), key.clone());
        let rel = format!("chaos-bc/{n}");
        async move {
            let args = vec![
                "get".to_owned(),
                key.clone(),
                "--dest".to_owned(),
                rel.clone(),
                "--broadcast".to_owned(),
                "--group".to_owned(),
                group,
                "--fanout".to_owned(),
                "1".to_owned(),
                "--no-serve".to_owned(),
                "--deadline".to_owned(),
                DEADLINE.to_owned(),
            ];
            (pod.clone(), rel, s.kt(pod, args).await)
        }
    });
    for (pod, rel, out) in futures::future::join_all(runs).await {
        match out {
            Ok(o) if o.status == 0 => {
                if let Some(copy) = check_copy(s, n, &key, &pod, &rel).await {
                    discard(&copy);
                }
                s.count(|r| &mut r.ok, "broadcast-member");
            }
            Ok(o) => s.violation(format!(
                "op {n}: broadcast of {key} into {pod} failed (exit {}): {}",
                o.status,
                o.stderr.trim()
            )),
            Err(e) => s.violation(format!("op {n}: broadcast of {key}: {e}")),
        }
    }
}

/// `kt tensor put --hold` of a tensor key in a random pod free of it
/// ([`Putters`]): once it holds, it replaces the key's previous holder
/// (which is then stopped). When every pod still runs a put of the key,
/// there is nothing to do.
async fn tensor_put(s: &Shared<'_>, rng: &mut Rng) {
    let n = s.op.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let k = rng.below(TENSOR_KEYS);
    let key = format!("chaos/t{k}");
    let claimed = (s.putters.lock().unwrap_or_else(|p| p.into_inner())).claim(rng, &key, &s.pods);
    let Some(pod) = claimed else {
        return;
    };
    let release = |pod: &str| {
        (s.putters.lock().unwrap_or_else(|p| p.into_inner())).release(&key, pod);
    };
    let args = [
        "tensor",
        "put",
        &key,
        "--layout",
        TENSOR_LAYOUT,
        "--seed",
        &tensor_seed(k),
        "--hold",
        "-o",
        "json",
    ];
    let req = ExecRequest {
        pod: pod.clone(),
        program: Program::Kt,
        args: args.map(String::from).to_vec(),
        env: ride_through(),
        token: Some(s.token.clone()),
    };
    let mut p = match s.target.spawn(req).await {
        Ok(p) => p,
        Err(e) => {
            release(&pod);
            return s.violation(format!("op {n}: starting a tensor put in {pod}: {e}"));
        }
    };
    let held = tokio::time::timeout(TENSOR_WITHIN, async {
        while let Some(line) = p.line().await {
            if crate::tensor::is_holding(&line) {
                return true;
            }
        }
        false
    })
    .await;
    match held {
        Ok(true) => {
            s.count(|r| &mut r.ok, "tensor-put");
            let old = s.holders.lock().await.insert(key.clone(), (pod, p));
            if let Some((old_pod, old)) = old {
                if !stop(old).await {
                    s.violation(format!(
                        "op {n}: the previous holder of {key} in {old_pod} did not end within 30 s of TERM"
                    ));
                }
                release(&old_pod);
            }
        }
        // It ended without holding: its agent is down, say ([`rules`]).
        Ok(false) => {
            let ended = p.wait().await;
            release(&pod);
            match ended {
                Ok(o) if o.status != 0 => s.failed(
                    "tensor-put",
                    || format!("op {n}: tensor put of {key} in {pod}"),
                    o.status,
                    &o.stderr,
                ),
                Ok(o) => s.violation(format!(
                    "op {n}: tensor put of {key} in {pod} ended (exit {}) without holding or saying why",
                    o.status
                )),
                Err(e) => s.violation(format!("op {n}: tensor put of {key} in {pod}: {e}")),
            }
        }
        Err(_) => {
            let _ = p.signal(Signal::KILL).await;
            let _ = p.wait().await;
            release(&pod);
            s.violation(format!(
                "op {n}: tensor put of {key} in {pod} neither held nor failed within {TENSOR_WITHIN:?}"
            ));
        }
    }
}

/// `kt tensor get` of a tensor key in a random pod, verified against the
/// key's seed by `kt` itself.
async fn tensor_get(s: &Shared<'_>, rng: &mut Rng) {
    let n = s.op.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let k = rng.below(TENSOR_KEYS);
    let key = format!("chaos/t{k}");
    let pod = pick(rng, &s.pods).to_owned();
    let args = [
        "tensor",
        "get",
        &key,
        "--layout",
        TENSOR_LAYOUT,
        "--seed",
        &tensor_seed(k),
        "-o",
        "json",
    ];
    let out =
        tokio::time::timeout(TENSOR_WITHIN, s.kt(&pod, args.map(String::from).to_vec())).await;
    match out {
        Ok(Ok(o)) if o.status == 0 => s.count(|r| &mut r.ok, "tensor-get"),
        Ok(Ok(o)) if o.stderr.contains("differs from seed") => s.violation(format!(
            "op {n}: tensor get of {key} into {pod} received other bytes: {}",
            o.stderr.trim()
        )),
        // Not held now (never put, its holder's agent down or restarting),
        // or a transfer cut by a fault ([`rules`]).
        Ok(Ok(o)) => s.failed(
            "tensor-get",
            || format!("op {n}: tensor get of {key} into {pod} failed"),
            o.status,
            &o.stderr,
        ),
        Ok(Err(e)) => s.violation(format!("op {n}: tensor get of {key}: {e}")),
        Err(_) => s.violation(format!(
            "op {n}: tensor get of {key} into {pod} did not end within {TENSOR_WITHIN:?}"
        )),
    }
}

/// The environment of the workload's `kt` calls: a call waits up to 60 s
/// for the metadata server's first answer (the default, 4 s, fails a call
/// that starts while it restarts or is frozen: right for a user at a
/// terminal, not for the soak's invariant that store puts and gets ride
/// through these faults, which is what a job setting it asks for).
fn ride_through() -> Vec<(String, String)> {
    vec![(kt_types::env::CONNECT_TIMEOUT.to_owned(), "60s".to_owned())]
}

/// The faults the soak picks from, one entry per chance: an agent's
/// restart is listed twice (twice as likely as each other entry); freezes
/// of the metadata server or an agent, and link cuts, only where the target
/// can ([`Target::freezes`], [`Target::cuts_links`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    StoreKill,
    StoreTerm,
    MetadataKill,
    StoreFreeze,
    AgentRestart,
    /// The metadata server or a pod's agent frozen.
    Freeze,
    /// A pod's or the store's link cut.
    LinkCut,
}

/// The soak's menu on `t`, in the order the seed indexes it.
fn menu(t: &dyn Target) -> Vec<Pick> {
    use Pick::*;
    let mut m = vec![
        StoreKill,
        StoreTerm,
        MetadataKill,
        StoreFreeze,
        AgentRestart,
        AgentRestart,
    ];
    if t.freezes() {
        m.push(Freeze);
    }
    if t.cuts_links() {
        m.push(LinkCut);
    }
    m
}

/// The fault a pick makes, and how long it lasts before its
/// [`Fault::undo`] (None: it is over once injected).
fn plan(choice: Pick, rng: &mut Rng, pods: &[String]) -> (Fault, Option<Duration>) {
    let store = Hit::Component(Component::Store);
    let metadata = Hit::Component(Component::Metadata);
    match choice {
        Pick::StoreKill => (Fault::Restart(store, Signal::KILL), None),
        Pick::StoreTerm => (Fault::Restart(store, Signal::TERM), None),
        Pick::MetadataKill => (Fault::Restart(metadata, Signal::KILL), None),
        Pick::StoreFreeze => {
            let frozen = Duration::from_millis(500 + rng.below(2500));
            (Fault::Signal(store, Signal::STOP), Some(frozen))
        }
        Pick::AgentRestart => {
            let pod = pick(rng, pods).to_owned();
            (Fault::Restart(Hit::Agent(pod), Signal::KILL), None)
        }
        Pick::Freeze => {
            // It neither answers nor closes its connections.
            let frozen = Duration::from_millis(500 + rng.below(2500));
            let hit = match rng.below(2) {
                0 => Hit::Agent(pick(rng, pods).to_owned()),
                _ => metadata,
            };
            (Fault::Signal(hit, Signal::STOP), Some(frozen))
        }
        Pick::LinkCut => {
            // It drops off the network for a while: its transfers stall,
            // nothing is refused.
            let c = match rng.below(4) {
                0 => Component::Store,
                _ => Component::Pod(pick(rng, pods).to_owned()),
            };
            let cut = Duration::from_millis(500 + rng.below(4500));
            (Fault::Link(c, false), Some(cut))
        }
    }
}

/// How the report counts a fault that lasted a while: `store STOP/CONT`,
/// `link cut`.
fn label(fault: &Fault, undo: Option<&Fault>) -> String {
    match (fault, undo) {
        (Fault::Signal(..), Some(Fault::Signal(_, thaw))) => {
            format!("{}/{}", fault.kind(), thaw.name())
        }
        _ => fault.kind(),
    }
}

/// Injects faults until the soak's end.
async fn inject(s: &Shared<'_>, opts: &Options) {
    let mut rng = Rng::new(opts.seed ^ 0xfa17);
    let t = s.target;
    let menu = menu(t);
    loop {
        let pause = Duration::from_millis(1500 + rng.below(3500));
        if Instant::now() + pause >= s.until {
            return;
        }
        tokio::time::sleep(pause).await;
        sample_rss(s, &opts.work_dir);
        let pick = menu[rng.below(menu.len() as u64) as usize];
        let (fault, lasts) = plan(pick, &mut rng, &s.pods);
        let undo = lasts.and(fault.undo());
        let kind = label(&fault, undo.as_ref());
        let result = async {
            fault.inject(t).await?;
            if let (Some(d), Some(u)) = (lasts, &undo) {
                tokio::time::sleep(d).await;
                u.inject(t).await?;
            }
            Ok::<(), TargetError>(())
        }
        .await;
        match result {
            Ok(()) => s.count(|r| &mut r.faults, &kind),
            Err(e) => s.violation(format!("injecting {kind}: {e}")),
        }
    }
}

async fn digest(path: &Path) -> Result<Digest, TargetError> {
    let p = path.to_owned();
    kt_sync::task::spawn(move || crate::data::digest(&p))
        .await
        .map_err(|e| TargetError::Failed(e.0))?
        .map_err(|e| TargetError::Failed(e.to_string()))
}

/// Records the resident set of the testbed's processes (those whose command
/// line names the soak's work directory: local and netns run them on this
/// host).
fn sample_rss(s: &Shared<'_>, work_dir: &Path) {
    let needle = work_dir.display().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let dir = p.path();
        let Ok(cmdline) = std::fs::read(dir.join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.iter().any(|a| a.contains(&needle)) {
            continue;
        }
        let program = args
            .first()
            .and_then(|a| Path::new(a).file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !program.starts_with("kt-") {
            continue;
        }
        let rss = std::fs::read_to_string(dir.join("status"))
            .ok()
            .and_then(|st| {
                st.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .map(|kib| kib * 1024)
            .unwrap_or(0);
        let mut r = s.report.lock().unwrap_or_else(|p| p.into_inner());
        let seen = r.max_rss.entry(program).or_default();
        *seen = (*seen).max(rss);
    }
}

/// A violation for every program whose largest resident set passed `bound`.
fn check_rss(s: &Shared<'_>, bound: u64) {
    let over: Vec<(String, u64)> = {
        let r = s.report.lock().unwrap_or_else(|p| p.into_inner());
        r.max_rss
            .iter()
            .filter(|&(_, &v)| v > bound)
            .map(|(k, &v)| (k.clone(), v))
            .collect()
    };
    for (program, rss) in over {
        s.violation(format!(
            "{program} held {} at its peak, above the bound of {}",
            kt_types::size::human(rss),
            kt_types::size::human(bound)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_put_never_goes_where_a_putter_of_its_key_may_be_alive() {
        let pods: Vec<String> = (0..4).map(|i| format!("pod-{i}")).collect();
        for seed in 0..64 {
            let mut rng = Rng::new(seed);
            let mut putters = Putters::default();
            // The soak's op 2534: pod-0 held chaos/t0, a put in pod-1
            // replaced it and pod-0's holder is still being stopped.
            let first = putters.claim(&mut rng, "chaos/t0", &pods[..1]);
            assert_eq!(first.as_deref(), Some("pod-0"));
            let second = putters.claim(&mut rng, "chaos/t0", &pods[..2]);
            assert_eq!(second.as_deref(), Some("pod-1"));
            // Neither pod-0 (stopping) nor pod-1 (holding) is chosen again
            // until its process ended; another key is free everywhere.
            let mut seen = BTreeSet::new();
            for _ in 0..2 {
                let pod = putters
                    .claim(&mut rng, "chaos/t0", &pods)
                    .expect("a free pod");
                assert!(pod != "pod-0" && pod != "pod-1", "seed {seed}: {pod}");
                assert!(seen.insert(pod));
            }
            assert_eq!(putters.claim(&mut rng, "chaos/t0", &pods), None);
            assert!(putters.claim(&mut rng, "chaos/t1", &pods).is_some());
            // pod-0's holder ended: pod-0, and only it, is free again.
            putters.release("chaos/t0", "pod-0");
            let again = putters.claim(&mut rng, "chaos/t0", &pods);
            assert_eq!(again.as_deref(), Some("pod-0"), "seed {seed}");
            assert_eq!(putters.claim(&mut rng, "chaos/t0", &pods), None);
        }
    }

    #[test]
    fn concurrent_tensor_puts_of_a_key_take_distinct_pods() {
        let pods: Vec<String> = (0..4).map(|i| format!("pod-{i}")).collect();
        let mut rng = Rng::new(331_604_955);
        let mut putters = Putters::default();
        // Puts of one key started before any holds (none is a holder yet):
        // each its own pod.
        let all: BTreeSet<String> = (0..4)
            .map(|_| {
                putters
                    .claim(&mut rng, "chaos/t0", &pods)
                    .expect("a free pod")
            })
            .collect();
        assert_eq!(all.len(), 4);
        // Releasing a pod that runs nothing of the key changes nothing.
        putters.release("chaos/t1", "pod-2");
        assert_eq!(putters.claim(&mut rng, "chaos/t0", &pods), None);
    }

    #[test]
    fn every_pick_makes_a_fault_the_report_names_as_before() {
        let pods = vec!["pod-0".to_owned(), "pod-1".to_owned()];
        let mut rng = Rng::new(7);
        let mut seen = BTreeSet::new();
        for _ in 0..64 {
            for pick in [
                Pick::StoreKill,
                Pick::StoreTerm,
                Pick::MetadataKill,
                Pick::StoreFreeze,
                Pick::AgentRestart,
                Pick::Freeze,
                Pick::LinkCut,
            ] {
                let (fault, lasts) = plan(pick, &mut rng, &pods);
                let undo = lasts.and(fault.undo());
                // What lasts a while is undone; the rest is over at once.
                assert_eq!(lasts.is_some(), undo.is_some(), "{fault:?}");
                seen.insert(label(&fault, undo.as_ref()));
            }
        }
        let kinds: Vec<&str> = seen.iter().map(String::as_str).collect();
        assert_eq!(
            kinds,
            [
                "agent KILL+start",
                "agent STOP/CONT",
                "link cut",
                "metadata KILL+start",
                "metadata STOP/CONT",
                "store KILL+start",
                "store STOP/CONT",
                "store TERM+start",
            ]
        );
    }
}
