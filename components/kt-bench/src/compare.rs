//! The kt-vs-rsync cases. Each run times kt and rsync on the same data; a case
//! reports the median of its measured runs, after untimed warm-up runs.
//!
//! - `small_cold`: the small tree into a destination that has nothing (kt: a new
//!   key and an empty scan cache each run; rsync: an emptied module directory);
//! - `small_noop`: the unchanged tree again;
//! - `small_changed`: 1% of the files rewritten (fresh random bytes, same size,
//!   a new mtime), a fresh 1% each run;
//! - `large_cold`: the large file into a destination that has nothing;
//! - `large_get`: the large file out of the store (kt get) and out of the
//!   daemon's module (an rsync pull) into an empty local directory.
//!
//! Besides wall time each run records CPU time: kt's (client, store and
//! metadata server all run in this process: `getrusage` of the process
//! around the step) and rsync's (the client, a child of this process, plus
//! the daemon and the per-connection child it reaps), so the table shows
//! CPU seconds per GiB for the large cases.
//!
//! Setup, checks and clean-up between runs are not timed. Within a run, kt
//! goes first on even runs and rsync on odd ones; each side removes what a
//! cold run wrote right after it, so both start from the same memory state.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, ensure};

use crate::cpu;
use crate::data::{self, SmallTree};
use crate::kt::KtCluster;
use crate::report::CaseResult;
use crate::rsync::{self, RsyncDaemon};
use crate::scratch::{ScratchDir, recreate_dir};
use crate::size::human;

/// What to measure, and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// Parent of the work directory (tmpfs, so neither side waits on a disk).
    pub dir: PathBuf,
    pub files: usize,
    pub large_size: u64,
    pub runs: usize,
    /// Untimed runs before the measured ones, per case (first touches of
    /// memory, connection pools, thread pools).
    pub warmup: usize,
    pub skip_large: bool,
    /// kt's servers serve HTTPS with this certificate and key (the client
    /// trusts `KT_CA_FILE`): the cost of transport security.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Only these cases (by name); empty: every case.
    pub cases: Vec<String>,
}

/// Every case, in the order they run.
pub const CASES: [&str; 5] = [
    "small_cold",
    "small_noop",
    "small_changed",
    "large_cold",
    "large_get",
];

impl Options {
    fn wants(&self, case: &str) -> bool {
        self.cases.is_empty() || self.cases.iter().any(|c| c == case)
    }
}

/// Progress notes go to stderr; results are returned.
fn note(msg: impl AsRef<str>) {
    eprintln!("[kt-bench] {}", msg.as_ref());
}

/// One timed step: wall and CPU seconds.
#[derive(Debug, Clone, Copy)]
struct Sample {
    wall: f64,
    cpu: f64,
}

/// Runs kt's part of a step, timing its wall clock and this process's CPU.
async fn kt_timed<T>(step: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<(Sample, T)> {
    let cpu0 = cpu::self_time();
    let started = Instant::now();
    let out = step.await?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = (cpu::self_time().saturating_sub(cpu0)).as_secs_f64();
    Ok((Sample { wall, cpu }, out))
}

/// Runs one rsync invocation against `daemon`: its wall time (as rsync
/// measured it) and the CPU of the client and of the daemon's side.
async fn rsync_timed(
    daemon: &RsyncDaemon,
    step: impl Future<Output = anyhow::Result<std::time::Duration>>,
) -> anyhow::Result<Sample> {
    let (c0, d0) = (cpu::children_time(), daemon.cpu_time());
    let wall = step.await?.as_secs_f64();
    // The daemon reaps its connection's child when it sees it exit: wait
    // (briefly, untimed) until that child's time has been added.
    let mut d1 = daemon.cpu_time();
    let until = Instant::now() + std::time::Duration::from_millis(100);
    while d1 == d0 && Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        d1 = daemon.cpu_time();
    }
    let client = cpu::children_time().saturating_sub(c0);
    let server = d1.saturating_sub(d0);
    Ok(Sample {
        wall,
        cpu: (client + server).as_secs_f64(),
    })
}

/// Generates the data, starts both systems, runs every case, and cleans up
/// (the work directory, the daemon and the servers go away on error too).
pub async fn run(opts: &Options) -> anyhow::Result<Vec<CaseResult>> {
    ensure!(opts.runs >= 1, "--runs must be at least 1");
    ensure!(opts.files >= 1, "--files must be at least 1");
    if let Some(bad) = opts.cases.iter().find(|c| !CASES.contains(&c.as_str())) {
        anyhow::bail!("no case {bad:?}: the cases are {}", CASES.join(", "));
    }
    let large_wanted = !opts.skip_large && (opts.wants("large_cold") || opts.wants("large_get"));
    let rsync_bin = rsync::binary()?;
    note(format!(
        "{} ({}); {} warm-up and {} measured runs per case",
        rsync::version(&rsync_bin)?,
        rsync_bin.display(),
        opts.warmup,
        opts.runs
    ));

    let scratch = ScratchDir::create(&opts.dir)?;
    note(format!("work directory {}", scratch.path().display()));
    let src = scratch.subdir("src")?;
    let module_dir = scratch.subdir("rsync-module")?;
    let rsync_work = scratch.subdir("rsyncd")?;
    let kt_work = scratch.subdir("kt")?;
    let gets = scratch.subdir("gets")?;

    let started = Instant::now();
    let mut tree = SmallTree::generate(
        &src.join("small"),
        opts.files,
        data::SMALL_DIRS,
        data::SMALL_FILE_SIZE,
        data::SEED,
    )?;
    note(format!(
        "generated {} files of {} ({}) in {:.1}s",
        tree.len(),
        human(data::SMALL_FILE_SIZE as u64),
        human(tree.total_bytes()),
        started.elapsed().as_secs_f64()
    ));
    let large = src.join("large.bin");
    if large_wanted {
        let started = Instant::now();
        data::generate_large(&large, opts.large_size, data::SEED ^ 1)?;
        note(format!(
            "generated {} ({}) in {:.1}s",
            large.display(),
            human(opts.large_size),
            started.elapsed().as_secs_f64()
        ));
    }

    let daemon = RsyncDaemon::start(&rsync_bin, &rsync_work, &module_dir)?;
    note(format!("rsync daemon on 127.0.0.1:{}", daemon.port()));
    let kt = KtCluster::start(&kt_work, opts.tls.as_ref()).await?;
    note(if opts.tls.is_some() {
        "kt metadata server and store up over TLS; store registered"
    } else {
        "kt metadata server and store up; store registered"
    });

    let mut results = Vec::new();
    let cases = async {
        if opts.wants("small_cold") {
            results.push(small_cold(opts, &kt, &daemon, &tree).await?);
        }
        if opts.wants("small_noop") || opts.wants("small_changed") {
            // The destinations both systems re-sync in these cases.
            kt.put("bench/small", tree.root()).await?;
            daemon.sync(tree.root(), "small", true).await?;
        }
        if opts.wants("small_noop") {
            results.push(small_noop(opts, &kt, &daemon, &tree).await?);
        }
        if opts.wants("small_changed") {
            results.push(small_changed(opts, &kt, &daemon, &mut tree).await?);
        }
        if !opts.skip_large && opts.wants("large_cold") {
            results.push(large_cold(opts, &kt, &daemon, &large).await?);
        }
        if !opts.skip_large && opts.wants("large_get") {
            results.push(large_get(opts, &kt, &daemon, &large, &gets).await?);
        }
        anyhow::Ok(())
    };
    let outcome = cases.await;
    let stopped = kt.stop().await;
    drop(daemon);
    drop(scratch);
    outcome?;
    stopped?;
    Ok(results)
}

/// Awaits both timed steps of one run: kt first on even runs, rsync first on
/// odd ones, so that neither side always runs in the other's wake (on a VM,
/// the first to touch memory the other just freed pays for it).
async fn both(
    run: usize,
    kt: impl Future<Output = anyhow::Result<Sample>>,
    rsync: impl Future<Output = anyhow::Result<Sample>>,
) -> anyhow::Result<(Sample, Sample)> {
    if run.is_multiple_of(2) {
        let k = kt.await?;
        Ok((k, rsync.await?))
    } else {
        let r = rsync.await?;
        Ok((kt.await?, r))
    }
}

async fn small_cold(
    opts: &Options,
    kt: &KtCluster,
    daemon: &RsyncDaemon,
    tree: &SmallTree,
) -> anyhow::Result<CaseResult> {
    let mut r = case(
        "small_cold",
        format!("{} files, empty destination", tree.len()),
        tree.total_bytes(),
    );
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            kt.clear_scan_cache()?;
            let key = format!("bench/small-cold-{run}");
            let (sample, (_, summary)) = kt_timed(kt.put(&key, tree.root())).await?;
            ensure!(
                summary.stats.files_sent == tree.len() as u64,
                "small_cold: kt sent {} files, expected {}",
                summary.stats.files_sent,
                tree.len()
            );
            kt.rm(&key).await?;
            Ok(sample)
        };
        let rsync_step = async {
            let dest = daemon.module_dir().join("small-cold");
            recreate_dir(&dest)?;
            let sample = rsync_timed(daemon, daemon.sync(tree.root(), "small-cold", true)).await?;
            ensure_same_file_count(&dest, tree.len())?;
            recreate_dir(&dest)?;
            Ok(sample)
        };
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        record(&mut r, opts, run, k, rs, "");
    }
    Ok(r)
}

async fn small_noop(
    opts: &Options,
    kt: &KtCluster,
    daemon: &RsyncDaemon,
    tree: &SmallTree,
) -> anyhow::Result<CaseResult> {
    let mut r = case("small_noop", format!("{} files, unchanged", tree.len()), 0);
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            let (sample, (_, summary)) = kt_timed(kt.put("bench/small", tree.root())).await?;
            ensure!(
                summary.unchanged,
                "small_noop: kt did not see the tree as unchanged (sent {} files)",
                summary.stats.files_sent
            );
            Ok(sample)
        };
        let rsync_step = rsync_timed(daemon, daemon.sync(tree.root(), "small", true));
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        record(&mut r, opts, run, k, rs, "");
    }
    Ok(r)
}

async fn small_changed(
    opts: &Options,
    kt: &KtCluster,
    daemon: &RsyncDaemon,
    tree: &mut SmallTree,
) -> anyhow::Result<CaseResult> {
    let count = (tree.len() / 100).max(1);
    let mut r = case(
        "small_changed",
        format!("{count} of {} files rewritten", tree.len()),
        count as u64 * data::SMALL_FILE_SIZE as u64,
    );
    for run in 0..opts.warmup + opts.runs {
        let changed = tree.change(count)?;
        let tree = &*tree;
        let kt_step = async {
            let (sample, (_, summary)) = kt_timed(kt.put("bench/small", tree.root())).await?;
            ensure!(
                summary.stats.files_sent == changed.len() as u64,
                "small_changed: kt sent {} files, expected {}",
                summary.stats.files_sent,
                changed.len()
            );
            Ok(sample)
        };
        let rsync_step = async {
            let sample = rsync_timed(daemon, daemon.sync(tree.root(), "small", true)).await?;
            for rel in &changed {
                ensure_same_content(
                    &tree.root().join(rel),
                    &daemon.module_dir().join("small").join(rel),
                )?;
            }
            Ok(sample)
        };
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        record(&mut r, opts, run, k, rs, "");
    }
    Ok(r)
}

async fn large_cold(
    opts: &Options,
    kt: &KtCluster,
    daemon: &RsyncDaemon,
    large: &Path,
) -> anyhow::Result<CaseResult> {
    let mut r = case(
        "large_cold",
        format!("1 file of {}, empty destination", human(opts.large_size)),
        opts.large_size,
    );
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            kt.clear_scan_cache()?;
            let key = format!("bench/large-cold-{run}");
            let (sample, (_, summary)) = kt_timed(kt.put(&key, large)).await?;
            ensure!(
                summary.stats.bytes_sent == opts.large_size,
                "large_cold: kt sent {} bytes, expected {}",
                summary.stats.bytes_sent,
                opts.large_size
            );
            kt.rm(&key).await?;
            Ok(sample)
        };
        let rsync_step = async {
            let dest = daemon.module_dir().join("large");
            recreate_dir(&dest)?;
            let sample = rsync_timed(daemon, daemon.sync(large, "large", false)).await?;
            ensure_size(
                &dest.join("large.bin"),
                opts.large_size,
                "large_cold: rsync",
            )?;
            recreate_dir(&dest)?;
            Ok(sample)
        };
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        let speeds = speeds(opts.large_size, &k, &rs);
        record(&mut r, opts, run, k, rs, &speeds);
    }
    Ok(r)
}

/// The large file out of each system into an empty local directory (kt
/// from the store, with no node agent to take a copy; rsync pulling from
/// its daemon's module).
async fn large_get(
    opts: &Options,
    kt: &KtCluster,
    daemon: &RsyncDaemon,
    large: &Path,
    gets: &Path,
) -> anyhow::Result<CaseResult> {
    // What both systems serve in this case.
    kt.put("bench/large", large).await?;
    recreate_dir(&daemon.module_dir().join("large-src"))?;
    daemon.sync(large, "large-src", false).await?;
    let mut r = case(
        "large_get",
        format!(
            "1 file of {}, into an empty directory",
            human(opts.large_size)
        ),
        opts.large_size,
    );
    let name = large
        .file_name()
        .context("the large file has no name")?
        .to_owned();
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            let dest = gets.join("kt");
            recreate_dir(&dest)?;
            let (sample, summary) = kt_timed(kt.get("bench/large", &dest)).await?;
            ensure!(
                summary.stats.bytes_sent == opts.large_size,
                "large_get: kt fetched {} bytes, expected {}",
                summary.stats.bytes_sent,
                opts.large_size
            );
            ensure_size(&dest.join(&name), opts.large_size, "large_get: kt")?;
            recreate_dir(&dest)?;
            Ok(sample)
        };
        let rsync_step = async {
            let dest = gets.join("rsync");
            recreate_dir(&dest)?;
            let remote = format!("large-src/{}", name.to_string_lossy());
            let sample = rsync_timed(daemon, daemon.pull(&remote, &dest)).await?;
            ensure_size(&dest.join(&name), opts.large_size, "large_get: rsync")?;
            recreate_dir(&dest)?;
            Ok(sample)
        };
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        let speeds = speeds(opts.large_size, &k, &rs);
        record(&mut r, opts, run, k, rs, &speeds);
    }
    kt.rm("bench/large").await?;
    Ok(r)
}

fn speeds(bytes: u64, k: &Sample, rs: &Sample) -> String {
    format!(
        " (kt {:.0} MiB/s {:.2} cpu-s/GiB, rsync {:.0} MiB/s {:.2} cpu-s/GiB)",
        mib_per_s(bytes, k.wall),
        cpu::secs_per_gib(k.cpu, bytes),
        mib_per_s(bytes, rs.wall),
        cpu::secs_per_gib(rs.cpu, bytes),
    )
}

fn ensure_size(path: &Path, expected: u64, who: &str) -> anyhow::Result<()> {
    let got = std::fs::metadata(path)
        .with_context(|| format!("{who} left no file at {}", path.display()))?
        .len();
    ensure!(
        got == expected,
        "{who} wrote {got} bytes, expected {expected}"
    );
    Ok(())
}

/// Keeps the timings of a measured run (warm-up runs are only reported).
fn record(r: &mut CaseResult, opts: &Options, run: usize, k: Sample, rs: Sample, extra: &str) {
    let label = if run < opts.warmup {
        format!("warm-up {}", run + 1)
    } else {
        r.kt.push(k.wall);
        r.rsync.push(rs.wall);
        r.kt_cpu.push(k.cpu);
        r.rsync_cpu.push(rs.cpu);
        format!("run {}", run - opts.warmup + 1)
    };
    note(format!(
        "{} {label}: kt {:.3}s (cpu {:.3}s) rsync {:.3}s (cpu {:.3}s){extra}",
        r.name, k.wall, k.cpu, rs.wall, rs.cpu
    ));
}

fn case(name: &'static str, what: String, bytes: u64) -> CaseResult {
    CaseResult {
        name,
        what,
        bytes,
        ..CaseResult::default()
    }
}

fn mib_per_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1 << 20) as f64 / secs
}

fn ensure_same_file_count(dir: &Path, expected: usize) -> anyhow::Result<()> {
    fn count(dir: &Path) -> anyhow::Result<usize> {
        let mut n = 0;
        for dent in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let dent = dent?;
            let ft = dent.file_type()?;
            if ft.is_dir() {
                n += count(&dent.path())?;
            } else if ft.is_file() {
                n += 1;
            }
        }
        Ok(n)
    }
    let got = count(dir)?;
    ensure!(
        got == expected,
        "{} holds {got} files after rsync, expected {expected}",
        dir.display()
    );
    Ok(())
}

fn ensure_same_content(a: &Path, b: &Path) -> anyhow::Result<()> {
    let x = std::fs::read(a).with_context(|| format!("reading {}", a.display()))?;
    let y = std::fs::read(b).with_context(|| format!("reading {}", b.display()))?;
    ensure!(x == y, "{} differs from {}", b.display(), a.display());
    Ok(())
}
