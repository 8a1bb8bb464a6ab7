//! The kt-vs-rsync cases. Each run times kt and rsync on the same data; a case
//! reports the median of its measured runs, after untimed warm-up runs.
//!
//! - `small_cold`: the small tree into a destination that has nothing (kt: a new
//!   key and an empty scan cache each run; rsync: an emptied module directory);
//! - `small_noop`: the unchanged tree again;
//! - `small_changed`: 1% of the files rewritten (fresh random bytes, same size,
//!   a new mtime), a fresh 1% each run;
//! - `large_cold`: the large file into a destination that has nothing.
//!
//! Setup, checks and clean-up between runs are not timed. Within a run, kt
//! goes first on even runs and rsync on odd ones; each side removes what a
//! cold run wrote right after it, so both start from the same memory state.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, ensure};

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
}

/// Progress notes go to stderr; results are returned.
fn note(msg: impl AsRef<str>) {
    eprintln!("[kt-bench] {}", msg.as_ref());
}

fn secs(d: std::time::Duration) -> f64 {
    d.as_secs_f64()
}

/// Generates the data, starts both systems, runs every case, and cleans up
/// (the work directory, the daemon and the servers go away on error too).
pub async fn run(opts: &Options) -> anyhow::Result<Vec<CaseResult>> {
    ensure!(opts.runs >= 1, "--runs must be at least 1");
    ensure!(opts.files >= 1, "--files must be at least 1");
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
    if !opts.skip_large {
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
        results.push(small_cold(opts, &kt, &daemon, &tree).await?);
        results.push(small_noop(opts, &kt, &daemon, &tree).await?);
        results.push(small_changed(opts, &kt, &daemon, &mut tree).await?);
        if !opts.skip_large {
            results.push(large_cold(opts, &kt, &daemon, &large).await?);
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
    kt: impl Future<Output = anyhow::Result<f64>>,
    rsync: impl Future<Output = anyhow::Result<f64>>,
) -> anyhow::Result<(f64, f64)> {
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
    );
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            kt.clear_scan_cache()?;
            let key = format!("bench/small-cold-{run}");
            let (took, summary) = kt.put(&key, tree.root()).await?;
            ensure!(
                summary.stats.files_sent == tree.len() as u64,
                "small_cold: kt sent {} files, expected {}",
                summary.stats.files_sent,
                tree.len()
            );
            kt.rm(&key).await?;
            Ok(secs(took))
        };
        let rsync_step = async {
            let dest = daemon.module_dir().join("small-cold");
            recreate_dir(&dest)?;
            let took = daemon.sync(tree.root(), "small-cold", true).await?;
            ensure_same_file_count(&dest, tree.len())?;
            recreate_dir(&dest)?;
            Ok(secs(took))
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
    // The destinations both systems re-sync in this case and the next.
    kt.put("bench/small", tree.root()).await?;
    daemon.sync(tree.root(), "small", true).await?;
    let mut r = case("small_noop", format!("{} files, unchanged", tree.len()));
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            let (took, summary) = kt.put("bench/small", tree.root()).await?;
            ensure!(
                summary.unchanged,
                "small_noop: kt did not see the tree as unchanged (sent {} files)",
                summary.stats.files_sent
            );
            Ok(secs(took))
        };
        let rsync_step = async { Ok(secs(daemon.sync(tree.root(), "small", true).await?)) };
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
    );
    for run in 0..opts.warmup + opts.runs {
        let changed = tree.change(count)?;
        let tree = &*tree;
        let kt_step = async {
            let (took, summary) = kt.put("bench/small", tree.root()).await?;
            ensure!(
                summary.stats.files_sent == changed.len() as u64,
                "small_changed: kt sent {} files, expected {}",
                summary.stats.files_sent,
                changed.len()
            );
            Ok(secs(took))
        };
        let rsync_step = async {
            let took = daemon.sync(tree.root(), "small", true).await?;
            for rel in &changed {
                ensure_same_content(
                    &tree.root().join(rel),
                    &daemon.module_dir().join("small").join(rel),
                )?;
            }
            Ok(secs(took))
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
    );
    for run in 0..opts.warmup + opts.runs {
        let kt_step = async {
            kt.clear_scan_cache()?;
            let key = format!("bench/large-cold-{run}");
            let (took, summary) = kt.put(&key, large).await?;
            ensure!(
                summary.stats.bytes_sent == opts.large_size,
                "large_cold: kt sent {} bytes, expected {}",
                summary.stats.bytes_sent,
                opts.large_size
            );
            kt.rm(&key).await?;
            Ok(secs(took))
        };
        let rsync_step = async {
            let dest = daemon.module_dir().join("large");
            recreate_dir(&dest)?;
            let took = daemon.sync(large, "large", false).await?;
            let got = std::fs::metadata(dest.join("large.bin"))
                .context("large_cold: rsync left no file")?
                .len();
            ensure!(
                got == opts.large_size,
                "large_cold: rsync wrote {got} bytes"
            );
            recreate_dir(&dest)?;
            Ok(secs(took))
        };
        let (k, rs) = both(run, kt_step, rsync_step).await?;
        let speeds = format!(
            " (kt {:.0} MiB/s, rsync {:.0} MiB/s)",
            mib_per_s(opts.large_size, k),
            mib_per_s(opts.large_size, rs),
        );
        record(&mut r, opts, run, k, rs, &speeds);
    }
    Ok(r)
}

/// Keeps the timings of a measured run (warm-up runs are only reported).
fn record(r: &mut CaseResult, opts: &Options, run: usize, k: f64, rs: f64, extra: &str) {
    let label = if run < opts.warmup {
        format!("warm-up {}", run + 1)
    } else {
        r.kt.push(k);
        r.rsync.push(rs);
        format!("run {}", run - opts.warmup + 1)
    };
    note(format!(
        "{} {label}: kt {k:.3}s rsync {rs:.3}s{extra}",
        r.name
    ));
}

fn case(name: &'static str, what: String) -> CaseResult {
    CaseResult {
        name,
        what,
        kt: Vec::new(),
        rsync: Vec::new(),
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
