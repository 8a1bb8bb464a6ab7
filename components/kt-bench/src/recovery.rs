//! Restart recovery (`kt-bench-recovery`, `make bench-recovery`): what one
//! store restart in the middle of a large get costs.
//!
//! The real `kt-metadata` and `kt-store` binaries run as child processes on
//! loopback (a store restart must drop its connections as a crash does,
//! which an in-process server cannot). One file (1 GiB by default) is put
//! once; then each run does a plain get of it (the baseline) and a get
//! during which the store is SIGKILLed once the get has `at` of the bytes,
//! and started again at once on the same address and data; and the same
//! for a put of it. Per run and operation:
//!
//! - the extra time of the get with the restart over the baseline, against
//!   the time the store was away (kill to ready again): the target is
//!   extra ≤ away + 1 s;
//! - the bytes moved twice: for the get, received beyond what the
//!   undisturbed get received ([`kt_client::bytes_received`]); for a put of
//!   the same file (to a new key, the store killed at the same point), what
//!   the restarted store received beyond what the first had not confirmed
//!   (its `kt_bytes_received_total`): the target is at most one chunk per
//!   stream.

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

/// One run's figures: a get, and a put of the same file.
#[derive(Debug, Clone)]
pub struct Run {
    pub get: Case,
    pub put: Case,
}

/// One transfer undisturbed and with the store restarted midway.
#[derive(Debug, Clone)]
pub struct Case {
    pub baseline: Duration,
    pub with_restart: Duration,
    /// From the kill until the store answered ready again.
    pub away: Duration,
    /// Bytes moved twice: for a get, received beyond what the undisturbed
    /// get received (the file and its manifest); for a put, what the
    /// restarted store received beyond what the first had not confirmed.
    pub refetched: u64,
}

impl Case {
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
            "{:>3}  {:>4}  {:>10}  {:>12}  {:>8}  {:>8}  {:>11}\n",
            "run", "op", "baseline_s", "with_restart", "extra_s", "away_s", "twice_MiB"
        );
        for (i, r) in self.runs.iter().enumerate() {
            for (op, c) in [("get", &r.get), ("put", &r.put)] {
                out += &format!(
                    "{:>3}  {op:>4}  {:>10.2}  {:>12.2}  {:>8.2}  {:>8.2}  {:>11.1}\n",
                    i + 1,
                    c.baseline.as_secs_f64(),
                    c.with_restart.as_secs_f64(),
                    c.extra(),
                    c.away.as_secs_f64(),
                    mib(c.refetched),
                );
            }
        }
        let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
        for (op, pick) in [
            ("get", (|r: &Run| &r.get) as fn(&Run) -> &Case),
            ("put", |r: &Run| &r.put),
        ] {
            let med = |f: &dyn Fn(&Case) -> f64| {
                median(&self.runs.iter().map(|r| f(pick(r))).collect::<Vec<_>>())
            };
            let extra = med(&Case::extra);
            let away = med(&|c| c.away.as_secs_f64());
            let twice = med(&|c| c.refetched as f64) as u64;
            out += &format!(
                "recovery op={op} size_mib={:.0} at={:.2} baseline_s={:.2} extra_s={extra:.2} \
                 away_s={away:.2} extra_target={} twice_mib={:.1} twice_limit_mib={:.1} \
                 twice_target={}\n",
                mib(self.size),
                self.at,
                med(&|c| c.baseline.as_secs_f64()),
                verdict(extra <= away + 1.0),
                mib(twice),
                mib(self.refetch_limit),
                verdict(twice <= self.refetch_limit),
            );
        }
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
            http: kt_api::client_builder().build()?,
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
            .env(kt_types::env::TOKEN, TOKEN)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it first: make release)",
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

    /// `kt_bytes_received_total` of the store running now.
    async fn store_bytes_received(&self) -> anyhow::Result<u64> {
        let text = self
            .http
            .get(format!("http://{}/metrics", self.store_addr))
            .bearer_auth(TOKEN)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        text.lines()
            .find_map(|l| l.strip_prefix("kt_bytes_received_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
            .context("the store's metrics lack kt_bytes_received_total")
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

/// Waits until `placed` reached `at` of the size, then SIGKILLs the store
/// and starts it again; how long it was away.
async fn restart_midway(
    servers: &mut Servers,
    placed: &Placed,
    running: &tokio::task::JoinHandle<impl Sized>,
    opts: &Options,
) -> anyhow::Result<Duration> {
    let kill_at = (opts.size as f64 * opts.at) as u64;
    while placed.0.load(Ordering::Relaxed) < kill_at && !running.is_finished() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if running.is_finished() {
        bail!("the transfer ended before the store could be killed; use a larger --size");
    }
    let killed = Instant::now();
    servers.kill_store();
    servers.start_store().await?;
    Ok(killed.elapsed())
}

/// A get undisturbed, then one with the store restarted midway.
async fn get_case(
    servers: &mut Servers,
    client: &Client,
    key: &Key,
    dest: &Path,
    opts: &Options,
) -> anyhow::Result<Case> {
    let rx = kt_client::bytes_received();
    let t = Instant::now();
    client.get(key, dest, Progress::none()).await?;
    let baseline = t.elapsed();
    let baseline_overhead = (kt_client::bytes_received() - rx).saturating_sub(opts.size);
    std::fs::remove_file(dest)?;

    let placed = Arc::new(Placed::default());
    let get = {
        let (client, key, dest) = (client.clone(), key.clone(), dest.to_owned());
        let progress = Progress::new(placed.clone());
        tokio::spawn(async move { client.get(&key, &dest, progress).await })
    };
    let rx = kt_client::bytes_received();
    let t = Instant::now();
    let away = match restart_midway(servers, &placed, &get, opts).await {
        Ok(a) => a,
        Err(e) => {
            get.await??;
            return Err(e);
        }
    };
    get.await??;
    let with_restart = t.elapsed();
    // Beyond what an undisturbed get receives too (manifests).
    let refetched =
        (kt_client::bytes_received() - rx).saturating_sub(opts.size + baseline_overhead);
    if std::fs::metadata(dest)?.len() != opts.size {
        bail!("the get with a restart left a file of the wrong size");
    }
    std::fs::remove_file(dest)?;
    Ok(Case {
        baseline,
        with_restart,
        away,
        refetched,
    })
}

/// A put of `src` to a new key undisturbed, then one to another new key
/// with the store restarted midway (it resumes: only the rest is sent).
async fn put_case(
    servers: &mut Servers,
    client: &Client,
    src: &Path,
    n: usize,
    opts: &Options,
) -> anyhow::Result<Case> {
    let t = Instant::now();
    let base_key = Key::parse(&format!("bench/put-base-{n}"))?;
    client
        .put(&base_key, src, PutOptions::default(), Progress::none())
        .await?;
    let baseline = t.elapsed();

    let key = Key::parse(&format!("bench/put-restart-{n}"))?;
    let placed = Arc::new(Placed::default());
    let put = {
        let (client, key, src) = (client.clone(), key.clone(), src.to_owned());
        let progress = Progress::new(placed.clone());
        tokio::spawn(async move {
            client
                .put(&key, &src, PutOptions::default(), progress)
                .await
        })
    };
    let t = Instant::now();
    let away = match restart_midway(servers, &placed, &put, opts).await {
        Ok(a) => a,
        Err(e) => {
            put.await??;
            return Err(e);
        }
    };
    // What the first store had confirmed when it was killed.
    let confirmed = placed.0.load(Ordering::Relaxed);
    put.await??;
    let with_restart = t.elapsed();
    let received = servers.store_bytes_received().await?;
    // Both copies go: the work directory is tmpfs, memory.
    for k in [&base_key, &key] {
        client.rm(k, false).await?;
    }
    Ok(Case {
        baseline,
        with_restart,
        away,
        refetched: received.saturating_sub(opts.size.saturating_sub(confirmed)),
    })
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

    let mut runs = Vec::new();
    for n in 0..opts.runs {
        let get = get_case(
            &mut servers,
            &client,
            &key,
            &work.join(format!("get-{n}")),
            opts,
        )
        .await?;
        let put = put_case(&mut servers, &client, &src, n, opts).await?;
        runs.push(Run { get, put });
    }
    Ok(Report {
        size: opts.size,
        at: opts.at,
        runs,
        refetch_limit,
    })
}
