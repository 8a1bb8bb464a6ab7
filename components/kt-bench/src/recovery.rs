//! Restart recovery (`kt-bench-recovery`, `make bench-recovery`): what one
//! store restart in the middle of a large get costs.
//!
//! The real `kt-metadata` and `kt-store` binaries run as child processes on
//! loopback (a store restart must drop its connections as a crash does,
//! which an in-process server cannot). One file (1 GiB by default) is put
//! once; then each run does a plain get of it (the baseline) and a get
//! during which the store is SIGKILLed once the get has `at` of the bytes,
//! and started again at once on the same address and data. Per run:
//!
//! - the extra time of the get with the restart over the baseline, against
//!   the time the store was away (kill to ready again): the target is
//!   extra ≤ away + 1 s;
//! - the bytes received more than the file's size (what the restart made
//!   the get fetch twice, read from [`kt_client::bytes_received`]): the
//!   target is at most one chunk per stream.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kt_client::progress::ProgressSink;
use kt_client::{Client, ClientConfig, Progress};
use kt_types::Key;
use kt_types::api::PutOptions;

use crate::report::median;
use crate::scratch::ScratchDir;

const TOKEN: &str = "bench";
/// How long a server may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a recovery benchmark runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where the work directory goes (tmpfs keeps the disk out of it).
    pub dir: PathBuf,
    /// Where `kt-metadata` and `kt-store` are.
    pub bin_dir: PathBuf,
    pub size: u64,
    pub runs: usize,
    /// The fraction of the bytes the get has when the store is killed.
    pub at: f64,
}

/// One run's figures.
#[derive(Debug, Clone)]
pub struct Run {
    pub baseline: Duration,
    pub with_restart: Duration,
    /// From the kill until the store answered ready again.
    pub away: Duration,
    /// Bytes received with the restart beyond what the undisturbed get
    /// received (the file and its manifest).
    pub refetched: u64,
}

impl Run {
    pub fn extra(&self) -> f64 {
        self.with_restart.as_secs_f64() - self.baseline.as_secs_f64()
    }
}

/// The figures of every run, and the limits they are held to.
#[derive(Debug, Clone)]
pub struct Report {
    pub size: u64,
    pub at: f64,
    pub runs: Vec<Run>,
    /// One chunk per stream: what a get may fetch twice.
    pub refetch_limit: u64,
}

impl Report {
    /// A table of the runs, then one summary line with medians and whether
    /// the targets were met.
    pub fn render(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut out = format!(
            "{:>3}  {:>10}  {:>12}  {:>8}  {:>8}  {:>13}\n",
            "run", "baseline_s", "with_restart", "extra_s", "away_s", "refetched_MiB"
        );
        for (i, r) in self.runs.iter().enumerate() {
            out += &format!(
                "{:>3}  {:>10.2}  {:>12.2}  {:>8.2}  {:>8.2}  {:>13.1}\n",
                i + 1,
                r.baseline.as_secs_f64(),
                r.with_restart.as_secs_f64(),
                r.extra(),
                r.away.as_secs_f64(),
                mib(r.refetched),
            );
        }
        let med = |f: fn(&Run) -> f64| median(&self.runs.iter().map(f).collect::<Vec<_>>());
        let extra = med(Run::extra);
        let away = med(|r| r.away.as_secs_f64());
        let refetched = med(|r| r.refetched as f64) as u64;
        let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
        out += &format!(
            "recovery size_mib={:.0} at={:.2} baseline_s={:.2} extra_s={extra:.2} away_s={away:.2} \
             extra_target={} refetched_mib={:.1} refetch_limit_mib={:.1} refetch_target={}\n",
            mib(self.size),
            self.at,
            med(|r| r.baseline.as_secs_f64()),
            verdict(extra <= away + 1.0),
            mib(refetched),
            mib(self.refetch_limit),
            verdict(refetched <= self.refetch_limit),
        );
        out
    }
}

/// A child process, killed when dropped.
#[derive(Debug)]
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The metadata server and the store as child processes on loopback.
#[derive(Debug)]
struct Servers {
    bin_dir: PathBuf,
    work: PathBuf,
    http: reqwest::Client,
    metadata_url: String,
    store_addr: String,
    metadata: Proc,
    store: Option<Proc>,
}

/// A loopback port free at the time of asking.
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Servers {
    async fn start(bin_dir: &Path, work: &Path) -> anyhow::Result<Servers> {
        let metadata_addr = format!("127.0.0.1:{}", free_port()?);
        let metadata = Self::spawn(
            bin_dir,
            work,
            "kt-metadata",
            &[
                "--listen",
                &metadata_addr,
                "--state-dir",
                &work.join("metadata").display().to_string(),
            ],
        )?;
        let mut s = Servers {
            bin_dir: bin_dir.to_owned(),
            work: work.to_owned(),
            http: reqwest::Client::builder().no_proxy().build()?,
            metadata_url: format!("http://{metadata_addr}"),
            store_addr: format!("127.0.0.1:{}", free_port()?),
            metadata,
            store: None,
        };
        s.wait_ready(&s.metadata_url.clone()).await?;
        s.start_store().await?;
        Ok(s)
    }

    fn spawn(bin_dir: &Path, work: &Path, name: &str, args: &[&str]) -> anyhow::Result<Proc> {
        let program = bin_dir.join(name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(work.join(format!("{name}.log")))?;
        let child = Command::new(&program)
            .args(args)
            .env("KT_TOKEN", TOKEN)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it first: cargo build --release --bin {name})",
                    program.display()
                )
            })?;
        Ok(Proc(child))
    }

    async fn start_store(&mut self) -> anyhow::Result<()> {
        let store = Self::spawn(
            &self.bin_dir,
            &self.work,
            "kt-store",
            &[
                "--listen",
                &self.store_addr,
                "--data-dir",
                &self.work.join("store").display().to_string(),
                "--metadata-url",
                &self.metadata_url,
            ],
        )?;
        self.store = Some(store);
        self.wait_ready(&format!("http://{}", self.store_addr))
            .await
    }

    /// SIGKILL, as a crash or an OOM kill would.
    fn kill_store(&mut self) {
        drop(self.store.take());
    }

    /// Polls `/readyz` until it answers 200 (the store: registered and its
    /// keys reconciled).
    async fn wait_ready(&mut self, url: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let ok = self
                .http
                .get(format!("{url}/readyz"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
            for p in std::iter::once(&mut self.metadata).chain(self.store.as_mut()) {
                if let Some(status) = p.0.try_wait()? {
                    bail!(
                        "a kt server exited ({status}); see the logs in {}",
                        self.work.display()
                    );
                }
            }
            if Instant::now() >= deadline {
                bail!("{url} was not ready within {READY_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Counts the bytes a get has placed.
#[derive(Debug, Default)]
struct Placed(AtomicU64);

impl ProgressSink for Placed {
    fn start(&self, _bytes: u64, _files: u64) {}
    fn advance(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }
    fn finish(&self) {}
}

/// Runs the benchmark.
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    if !(0.0..1.0).contains(&opts.at) {
        bail!("--at must be in [0, 1), not {}", opts.at);
    }
    let scratch = ScratchDir::create(&opts.dir)?;
    let work = scratch.path().to_owned();
    let mut servers = Servers::start(&opts.bin_dir, &work).await?;
    let mut cfg = ClientConfig::new(servers.metadata_url.clone(), TOKEN);
    cfg.cache_dir = Some(work.join("client-cache"));
    cfg.serve_copies = false;
    let refetch_limit = cfg.streams as u64 * kt_sync::defaults::CHUNK_SIZE;
    let client = Client::new(cfg)?;

    let src = work.join("src.bin");
    crate::data::generate_large(&src, opts.size, 1)?;
    let key = Key::parse("bench/recovery")?;
    client
        .put(&key, &src, PutOptions::default(), Progress::none())
        .await?;
    std::fs::remove_file(&src)?;

    let mut runs = Vec::new();
    for n in 0..opts.runs {
        let dest = work.join(format!("get-{n}"));
        let rx = kt_client::bytes_received();
        let t = Instant::now();
        client.get(&key, &dest, Progress::none()).await?;
        let baseline = t.elapsed();
        let baseline_overhead = (kt_client::bytes_received() - rx).saturating_sub(opts.size);
        std::fs::remove_file(&dest)?;

        let placed = Arc::new(Placed::default());
        let get = {
            let (client, key, dest) = (client.clone(), key.clone(), dest.clone());
            let progress = Progress::new(placed.clone());
            tokio::spawn(async move { client.get(&key, &dest, progress).await })
        };
        let rx = kt_client::bytes_received();
        let t = Instant::now();
        let kill_at = (opts.size as f64 * opts.at) as u64;
        while placed.0.load(Ordering::Relaxed) < kill_at && !get.is_finished() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if get.is_finished() {
            get.await??;
            bail!("the get finished before the store could be killed; use a larger --size");
        }
        let killed = Instant::now();
        servers.kill_store();
        servers.start_store().await?;
        let away = killed.elapsed();
        get.await??;
        let with_restart = t.elapsed();
        // Beyond what an undisturbed get receives too (manifests).
        let refetched =
            (kt_client::bytes_received() - rx).saturating_sub(opts.size + baseline_overhead);
        if std::fs::metadata(&dest)?.len() != opts.size {
            bail!("the get with a restart left a file of the wrong size");
        }
        std::fs::remove_file(&dest)?;
        runs.push(Run {
            baseline,
            with_restart,
            away,
            refetched,
        });
    }
    Ok(Report {
        size: opts.size,
        at: opts.at,
        runs,
        refetch_limit,
    })
}
