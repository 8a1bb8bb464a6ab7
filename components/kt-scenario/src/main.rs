//! `kt-scenario`: validate and run YAML scenarios against a testbed target.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use kt_scenario::live::Live;
use kt_scenario::report::terminal;
use kt_scenario::runner::{Options, Runner};
use kt_scenario::snapshot::{Mode, Snapshots, quiet_snapshot_panics};
use kt_scenario::target::Target;
use kt_scenario::target::bundle::Bundle;
use kt_scenario::target::cluster::{self, Cluster, Flavor, Session, shell::Real};
use kt_scenario::target::docker::Docker;
use kt_scenario::target::k3d::K3d;
use kt_scenario::target::kind::Kind;
use kt_scenario::target::local::Local;
use kt_scenario::target::netns::Netns;
use kt_scenario::validate::{self, Diagnostic, Loaded};

/// Runs kt scenarios: brings up a testbed, drives put/get/ls/rm and faults,
/// asserts on snapshots and timing budgets, writes reports.
#[derive(Debug, Parser)]
#[command(name = "kt-scenario", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum TargetKind {
    /// Processes on loopback (no root).
    Local,
    /// A network namespace per pod on a bridge, links shaped with tc (root).
    Netns,
    /// Containers from kt's images on a network of their own (make images).
    Docker,
    /// The production install's pods (kubectl kustomize of
    /// overlays/production) run as a kubelet would on the Docker engine,
    /// with a scripted Kubernetes API (make images; root).
    Bundle,
    /// Real pods in a kind cluster from kustomize/overlays/kind (make images).
    Kind,
    /// Real pods in a k3d cluster from kustomize/overlays/k3d (make images).
    K3d,
}

/// What manages the cluster of a cluster target.
fn cluster_flavor(t: TargetKind) -> Option<Box<dyn Flavor>> {
    match t {
        TargetKind::Kind => Some(Box::new(Kind)),
        TargetKind::K3d => Some(Box::new(K3d)),
        _ => None,
    }
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Check scenario files; errors are printed as file:line:column.
    Validate {
        /// Files or directories (default: scenarios).
        paths: Vec<PathBuf>,
    },
    /// List scenarios with their tags.
    List { paths: Vec<PathBuf> },
    /// Run scenarios.
    Run {
        /// Files or directories (default: scenarios).
        paths: Vec<PathBuf>,
        #[arg(long, env = kt_types::env::SCENARIO_TARGET, default_value = "local")]
        target: TargetKind,
        /// Run only scenarios with one of these tags.
        #[arg(long, value_delimiter = ',', env = kt_types::env::SCENARIO_TAGS)]
        tags: Vec<String>,
        /// Skip scenarios with any of these tags.
        #[arg(long, value_delimiter = ',', env = kt_types::env::SCENARIO_EXCLUDE_TAGS)]
        exclude_tags: Vec<String>,
        /// Where report.json, junit.xml, report.html and failure dumps go.
        #[arg(
            long,
            env = kt_types::env::SCENARIO_REPORT,
            default_value = "target/scenario-report"
        )]
        report: PathBuf,
        /// Snapshot directory (default: `snapshots` beside the first scenario file).
        #[arg(long, env = kt_types::env::SCENARIO_SNAPSHOTS)]
        snapshots: Option<PathBuf>,
        /// CI mode: write no pending snapshots; unreferenced snapshots fail the run.
        #[arg(long, conflicts_with = "accept")]
        check: bool,
        /// Accept new and changed snapshots (and remove unreferenced ones on a full run).
        #[arg(long)]
        accept: bool,
        /// Keep a failed scenario's testbed up until Ctrl-C.
        #[arg(long)]
        keep: bool,
        /// Where kt, kt-metadata and kt-store are (default: beside this binary).
        #[arg(long, env = kt_types::env::SCENARIO_BIN_DIR)]
        bin_dir: Option<PathBuf>,
        /// The Python interpreter with the `kt` package that `python` steps
        /// run (default: the venv `make python` builds, `BIN_DIR/../python`).
        #[arg(long, env = kt_types::env::SCENARIO_PYTHON)]
        python: Option<PathBuf>,
        /// Parent of the per-scenario work directories.
        #[arg(long, env = kt_types::env::SCENARIO_WORK_DIR)]
        work_dir: Option<PathBuf>,
        /// kind/k3d: print each scenario's plan (commands in order, the
        /// generated manifests) and touch no cluster.
        #[arg(long)]
        dry_run: bool,
        /// kind/k3d: keep a cluster this run created (one that existed is kept anyway).
        #[arg(long, env = kt_types::env::KEEP_CLUSTER, value_parser = clap::builder::BoolishValueParser::new())]
        keep_cluster: bool,
    },
    /// The chaos soak: a seeded workload of puts, gets and broadcasts while
    /// the store, the metadata server and agents are killed, frozen and
    /// restarted at random; fails on any broken invariant, with the seed.
    Chaos(ChaosArgs),
}

#[derive(Debug, clap::Args)]
struct ChaosArgs {
    /// local or netns (the soak signals processes on this host).
    #[arg(long, env = kt_types::env::SCENARIO_TARGET, default_value = "local")]
    target: TargetKind,
    /// How long the workload runs, e.g. 2m.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    duration: std::time::Duration,
    /// The seed (default: a random one, printed): the same seed makes
    /// the same choices of operations and faults.
    #[arg(long, env = kt_types::env::CHAOS_SEED)]
    seed: Option<u64>,
    /// Pods that put and get.
    #[arg(long, default_value_t = 4)]
    pods: usize,
    /// Operations in flight at once.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Memory bound of every server and agent, in MiB (resident set).
    #[arg(long, default_value_t = 1024)]
    max_rss_mib: u64,
    /// Where kt, kt-metadata and kt-store are (default: beside this binary).
    #[arg(long, env = kt_types::env::SCENARIO_BIN_DIR)]
    bin_dir: Option<PathBuf>,
    /// The soak's work directory (default: a new one under the temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

/// Scenario files below `paths` (directories are searched recursively,
/// skipping `snapshots`), sorted, and whether every path was a directory.
fn files(paths: &[PathBuf]) -> anyhow::Result<(Vec<PathBuf>, bool)> {
    let paths = if paths.is_empty() {
        vec![PathBuf::from("scenarios")]
    } else {
        paths.to_vec()
    };
    let mut out = Vec::new();
    let mut all_dirs = true;
    for p in &paths {
        if p.is_dir() {
            walk(p, &mut out).with_context(|| format!("reading {}", p.display()))?;
        } else if p.is_file() {
            all_dirs = false;
            out.push(p.clone());
        } else {
            anyhow::bail!("{}: no such file or directory", p.display());
        }
    }
    out.sort();
    out.dedup();
    Ok((out, all_dirs))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "snapshots") {
                walk(&p, out)?;
            }
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
    Ok(())
}

/// Loads every file; on any error prints all diagnostics.
fn load_all(files: &[PathBuf]) -> Result<Vec<Loaded>, Vec<Diagnostic>> {
    let mut loaded = Vec::new();
    let mut diags = Vec::new();
    for f in files {
        match validate::load(f) {
            Ok(l) => loaded.push(l),
            Err(d) => diags.extend(d),
        }
    }
    // Names key snapshots, so they must be unique across the run.
    let mut seen = std::collections::BTreeMap::new();
    for l in &loaded {
        if let Some(prev) = seen.insert(l.name.clone(), l.file.clone()) {
            diags.push(Diagnostic {
                file: l.file.clone(),
                pos: kt_scenario::locate::Pos { line: 1, col: 1 },
                message: format!(
                    "scenario name `{}` is also used by {}",
                    l.name,
                    prev.display()
                ),
            });
        }
    }
    if diags.is_empty() {
        Ok(loaded)
    } else {
        Err(diags)
    }
}

fn print_diags(d: &[Diagnostic]) {
    for d in d {
        eprintln!("{d}");
    }
    eprintln!("{} error(s)", d.len());
}

/// Sets insta's environment for this process: `INSTA_UPDATE` (`--check`:
/// write nothing, `--accept`: write new and changed snapshots) and, unless
/// given, `INSTA_WORKSPACE_ROOT` (the current directory, so insta never runs
/// `cargo metadata` to find it). insta reads only its environment for these.
#[allow(unsafe_code)]
fn set_insta_env(update: Option<&str>) {
    // SAFETY: called at the start of `main`, before the runtime or any other
    // thread exists, so nothing can read the environment concurrently.
    unsafe {
        if let Some(v) = update {
            std::env::set_var("INSTA_UPDATE", v);
        }
        if std::env::var_os("INSTA_WORKSPACE_ROOT").is_none()
            && let Ok(cwd) = std::env::current_dir()
        {
            std::env::set_var("INSTA_WORKSPACE_ROOT", cwd);
        }
    }
}

/// Exit status of an interrupted run (128 + SIGINT).
const INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Cmd::Run { check, accept, .. } = &cli.cmd {
        set_insta_env(match (check, accept) {
            (true, _) => Some("no"),
            (_, true) => Some("always"),
            _ => None,
        });
    }
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kt-scenario: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Chaos(args) => chaos(args),
        Cmd::Validate { paths } => {
            let (files, _) = files(&paths)?;
            match load_all(&files) {
                Ok(l) => {
                    println!("{} scenario file(s) valid", l.len());
                    Ok(ExitCode::SUCCESS)
                }
                Err(d) => {
                    print_diags(&d);
                    Ok(ExitCode::from(2))
                }
            }
        }
        Cmd::List { paths } => {
            let (files, _) = files(&paths)?;
            let loaded = match load_all(&files) {
                Ok(l) => l,
                Err(d) => {
                    print_diags(&d);
                    return Ok(ExitCode::from(2));
                }
            };
            for l in loaded {
                println!(
                    "{:<28} [{}] {}",
                    l.name,
                    l.scenario.tags.join(","),
                    l.file.display()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            paths,
            target,
            tags,
            exclude_tags,
            report,
            snapshots,
            check,
            accept,
            keep,
            bin_dir,
            python,
            work_dir,
            dry_run,
            keep_cluster,
        } => {
            let (files, full) = files(&paths)?;
            let loaded = match load_all(&files) {
                Ok(l) => l,
                Err(d) => {
                    print_diags(&d);
                    return Ok(ExitCode::from(2));
                }
            };
            // Absolute: pod commands run with the pod's directory as cwd.
            let bin_dir = match bin_dir {
                Some(d) => std::path::absolute(&d).unwrap_or(d),
                None => std::env::current_exe()
                    .context("locating this binary")?
                    .parent()
                    .map(Path::to_owned)
                    .context("locating the binary directory")?,
            };
            let python = match python {
                Some(p) => Some(std::path::absolute(&p).unwrap_or(p)),
                None => Some(bin_dir.join("../python/bin/python")).filter(|p| p.exists()),
            };
            let snap_dir = snapshots.unwrap_or_else(|| {
                files
                    .first()
                    .and_then(|f| f.parent())
                    .unwrap_or(Path::new("scenarios"))
                    .join("snapshots")
            });
            let snap_dir = std::path::absolute(&snap_dir).unwrap_or(snap_dir);
            let mode = if accept {
                Mode::Accept
            } else if check {
                Mode::Check
            } else {
                Mode::Auto
            };
            let opts = Options {
                bin_dir,
                work_root: work_dir.unwrap_or_else(|| std::env::temp_dir().join("kt-scenario")),
                report_dir: report.clone(),
                keep,
                tags: tags.clone(),
                exclude_tags,
                python,
            };
            quiet_snapshot_panics();
            let runner = Runner::new(opts, Snapshots::new(snap_dir, mode), Live::default());
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            let cluster_cfg = cluster::config_from_env(&runner.opts.work_root, keep_cluster);
            if dry_run {
                if cluster_flavor(target).is_none() {
                    anyhow::bail!("--dry-run plans the kind and k3d targets only");
                }
                for l in loaded.iter().filter(|l| runner.selected(l)) {
                    let flavor = cluster_flavor(target).context("a cluster target")?;
                    println!(
                        "{}",
                        rt.block_on(cluster::plan_scenario(
                            flavor,
                            cluster_cfg.clone(),
                            true,
                            l,
                            &runner.run_id,
                            &runner.opts.work_root,
                            &runner.opts.bin_dir,
                            "dry-run-token",
                        ))
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            // One cluster for the whole run, shared by every scenario's target.
            let session = cluster_flavor(target).map(|f| {
                std::sync::Arc::new(Session::new(f, std::sync::Arc::new(Real), cluster_cfg))
            });
            let shared = session.clone();
            let factory = move || -> Box<dyn Target> {
                if let Some(s) = &shared {
                    return Box::new(Cluster::new(s.clone()));
                }
                match target {
                    TargetKind::Local => Box::new(Local::new()),
                    TargetKind::Netns => Box::new(Netns::new()),
                    TargetKind::Docker => Box::new(Docker::new()),
                    TargetKind::Bundle => Box::new(Bundle::new()),
                    TargetKind::Kind | TargetKind::K3d => {
                        unreachable!("cluster targets have a session")
                    }
                }
            };
            let mut result = rt.block_on(async {
                let cancel = runner.cancel.clone();
                tokio::spawn(async move {
                    // The first SIGINT/SIGTERM/SIGHUP cancels the run (the
                    // current testbed is torn down); a second one ends the
                    // process at once.
                    use tokio::signal::unix::{SignalKind, signal};
                    let mut sigs: Vec<_> = [SignalKind::interrupt(), SignalKind::terminate(), SignalKind::hangup()]
                        .into_iter()
                        .filter_map(|k| signal(k).ok())
                        .collect();
                    for n in 0.. {
                        let any = futures::future::select_all(sigs.iter_mut().map(|s| Box::pin(s.recv())));
                        any.await;
                        if n == 0 {
                            eprintln!("kt-scenario: interrupted; tearing the testbed down (again to quit at once)");
                            cancel.cancel();
                        } else {
                            std::process::exit(i32::from(INTERRUPTED));
                        }
                    }
                });
                runner.run(&loaded, &factory).await
            });
            if let Some(s) = &session {
                if let Some(kept) = rt.block_on(s.kept()) {
                    eprintln!("{kept}");
                }
                if let Err(e) = rt.block_on(s.finish()) {
                    eprintln!("kt-scenario: warning: deleting the cluster: {e}");
                }
            }
            // Every loaded scenario owns its snapshot, run or skipped.
            for l in &loaded {
                runner.snapshots.reference(&l.name);
            }
            let full_run = full && tags.is_empty();
            if full_run {
                result.unreferenced_snapshots = runner
                    .snapshots
                    .unreferenced()
                    .into_iter()
                    .map(|p| p.display().to_string())
                    .collect();
            }
            for change in runner.snapshots.finish(full_run)? {
                eprintln!("{change}");
            }
            if mode == Mode::Accept {
                result.unreferenced_snapshots.clear();
            }
            result
                .write_all(&report)
                .with_context(|| format!("writing reports to {}", report.display()))?;
            eprint!(
                "{}",
                terminal::render(&result, kt_service::telemetry::stderr_color())
            );
            eprintln!("reports: {}", report.join("report.html").display());
            Ok(if runner.cancel.is_cancelled() {
                ExitCode::from(INTERRUPTED)
            } else if result.is_failure(check) {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}

/// `kt-scenario chaos`.
fn chaos(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    let ChaosArgs {
        target,
        duration,
        seed,
        pods,
        workers,
        max_rss_mib,
        bin_dir,
        work_dir,
    } = args;
    let t: Box<dyn Target> = match target {
        TargetKind::Local => Box::new(Local::new()),
        TargetKind::Netns => Box::new(Netns::new()),
        other => anyhow::bail!("the chaos soak runs on the local and netns targets, not {other:?}"),
    };
    let seed = seed.unwrap_or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish() % 1_000_000_000
    });
    let bin_dir = match bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .context("the binary's directory")?
            .to_owned(),
    };
    // A directory of our own is removed after a clean run; one given must
    // be empty (nothing of the user's is ever removed).
    let (work_dir, ours) = match work_dir {
        Some(d) => {
            if std::fs::read_dir(&d).is_ok_and(|mut e| e.next().is_some()) {
                anyhow::bail!("--work-dir {} is not empty", d.display());
            }
            (d, false)
        }
        None => {
            let d = std::env::temp_dir().join(format!("kt-chaos-{seed}"));
            let _ = std::fs::remove_dir_all(&d);
            (d, true)
        }
    };
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("creating {}", work_dir.display()))?;
    eprintln!(
        "kt-scenario chaos: seed {seed} (rerun with --seed {seed}), {} on the {target:?} target, work dir {}",
        humantime::format_duration(duration),
        work_dir.display()
    );
    let opts = kt_scenario::chaos::Options {
        seed,
        duration,
        pods,
        workers,
        max_rss: max_rss_mib << 20,
        work_dir: work_dir.clone(),
        bin_dir,
    };
    let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
    let report = rt.block_on(kt_scenario::chaos::run(t, opts))?;
    print!("{}", report.render());
    if report.violations.is_empty() {
        if ours {
            let _ = std::fs::remove_dir_all(&work_dir);
        }
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "kt-scenario chaos: {} violation(s) with seed {seed}; logs kept in {}",
            report.violations.len(),
            work_dir.join("logs").display()
        );
        Ok(ExitCode::from(1))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Cli>();
    }
}
