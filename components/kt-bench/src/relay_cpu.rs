//! CPU per byte (`kt-bench-cpu`, `make bench-cpu`): what a put, the store's
//! send, a relaying broadcast member and a pure getter cost in CPU seconds
//! per GiB of payload, on loopback, without root.
//!
//! The metadata server runs in this process; the store, the putting client
//! and every broadcast member run as child processes of this same program
//! (each its own runtime, so each one's CPU is its own), spoken to over a
//! line protocol on stdin and stdout ([`Role`]). Per run: a fresh payload is
//! put under a new key (the putter measures its own CPU around the put, the
//! store's is read before and after); then `members` getters join a named
//! group of fanout 1 (a chain: the store serves rank 1, rank `k` serves
//! rank `k + 1`) at the same moment, each measuring its own CPU around its
//! broadcast get, which returns once its child no longer needs it. Ranks 1
//! to `members - 1` relay (receive, verify, write, forward); the last one
//! is a pure getter.
//!
//! CPU time is `getrusage(RUSAGE_SELF)` (every thread, user and system):
//! far less sensitive to a busy machine than wall time, which is printed
//! too but only as an indication.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kt_client::broadcast::BroadcastOptions;
use kt_client::{Client, ClientConfig, Progress};
use kt_service::Token;
use kt_types::Key;
use kt_types::api::PutOptions;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpListener;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cpu::{secs_per_gib, self_time};
use crate::report::median;
use crate::scratch::ScratchDir;

const TOKEN: &str = "bench";
/// How long a child may take to get ready, or a step to end.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

/// What a CPU benchmark runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where the work directory goes (tmpfs keeps the disk out of it).
    pub dir: PathBuf,
    /// The payload: one file of this size.
    pub size: u64,
    /// Broadcast members (at least 2: a relay and a pure getter).
    pub members: usize,
    pub runs: usize,
}

/// The CPU seconds of one run.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// The putting client.
    pub put_client: f64,
    /// The store while it received the put.
    pub put_store: f64,
    /// The store while it served the broadcast (rank 1).
    pub store_send: f64,
    /// Each relaying member (ranks 1 to members - 1), in rank order.
    pub relays: Vec<f64>,
    /// The last member, which relays nothing.
    pub getter: f64,
    /// From the go to the last member done.
    pub broadcast_wall: Duration,
    pub put_wall: Duration,
}

/// Every run's figures and the payload size.
#[derive(Debug, Clone)]
pub struct Report {
    pub size: u64,
    pub members: usize,
    pub runs: Vec<Run>,
}

/// A figure: its per-run CPU seconds per GiB.
fn per_gib(size: u64, secs: impl Iterator<Item = f64>) -> Vec<f64> {
    secs.map(|s| secs_per_gib(s, size)).collect()
}

/// CPU seconds per GiB as milliseconds per MB (10^6 bytes).
pub fn ms_per_mb(secs_per_gib: f64) -> f64 {
    secs_per_gib * 1000.0 / ((1u64 << 30) as f64 / 1e6)
}

impl Report {
    /// The figures, each as its per-run values: (name, CPU s/GiB per run).
    pub fn figures(&self) -> Vec<(&'static str, Vec<f64>)> {
        let s = self.size;
        let relay = |r: &Run| median(&r.relays);
        vec![
            (
                "put_client",
                per_gib(s, self.runs.iter().map(|r| r.put_client)),
            ),
            (
                "put_store",
                per_gib(s, self.runs.iter().map(|r| r.put_store)),
            ),
            (
                "store_send",
                per_gib(s, self.runs.iter().map(|r| r.store_send)),
            ),
            ("relay", per_gib(s, self.runs.iter().map(relay))),
            ("getter", per_gib(s, self.runs.iter().map(|r| r.getter))),
        ]
    }

    /// A table (one row per figure: the median and every run, in CPU
    /// seconds per GiB and ms per MB), the wall times, then one summary line
    /// `cpu size_mib=… members=… put_client=… put_store=… store_send=…
    /// relay=… getter=… relay_ms_per_mb=… relay_target=met|MISSED` (medians
    /// in CPU s/GiB; the target is a relay at 3 ms/MB or less).
    pub fn render(&self) -> String {
        let mut out = format!(
            "{:<11} {:>9} {:>9}  {}\n",
            "figure", "s/GiB", "ms/MB", "runs (s/GiB)"
        );
        let mut summary = format!("cpu size_mib={} members={}", self.size >> 20, self.members);
        for (name, runs) in self.figures() {
            let m = median(&runs);
            let each: Vec<String> = runs.iter().map(|x| format!("{x:.2}")).collect();
            out += &format!(
                "{name:<11} {m:>9.2} {:>9.2}  {}\n",
                ms_per_mb(m),
                each.join(" ")
            );
            summary += &format!(" {name}={m:.2}");
        }
        let walls = |f: fn(&Run) -> Duration| {
            self.runs
                .iter()
                .map(|r| format!("{:.2}", f(r).as_secs_f64()))
                .collect::<Vec<_>>()
                .join(" ")
        };
        out += &format!(
            "wall (s, a busy machine stretches it): put {} · broadcast {}\n",
            walls(|r| r.put_wall),
            walls(|r| r.broadcast_wall)
        );
        let relay = median(
            &self
                .figures()
                .into_iter()
                .find(|(n, _)| *n == "relay")
                .map(|(_, v)| v)
                .unwrap_or_default(),
        );
        let ms = ms_per_mb(relay);
        summary += &format!(
            " relay_ms_per_mb={ms:.2} relay_target={}\n",
            if ms <= 3.0 { "met" } else { "MISSED" }
        );
        out + &summary
    }
}

/// The roles this program's children play (`kt-bench-cpu <role> …`).
#[derive(Debug, Clone)]
pub enum Role {
    /// A store on 127.0.0.1: prints `ready`, then answers each `cpu` line
    /// with `cpu <seconds>`; stops at the end of its input.
    Store { data: PathBuf, metadata_url: String },
    /// Prints `ready`, waits for `go`, puts `src` under `key`, prints
    /// `done <cpu seconds>`.
    Put {
        metadata_url: String,
        key: String,
        src: PathBuf,
        cache: PathBuf,
    },
    /// Prints `ready`, waits for `go`, gets `key` into `dest` as a member of
    /// `group` (fanout 1), prints `done <cpu seconds> <rank> <bytes relayed>`.
    Member {
        metadata_url: String,
        key: String,
        group: String,
        dest: PathBuf,
        cache: PathBuf,
    },
}

fn client(metadata_url: &str, cache: &Path) -> anyhow::Result<Client> {
    let mut cfg = ClientConfig::new(metadata_url, TOKEN);
    cfg.cache_dir = Some(cache.to_owned());
    // Transfers only: no node agent takes the copies.
    cfg.serve_copies = false;
    Ok(Client::new(cfg)?)
}

/// This process's input, line by line (read on a thread of its own); the
/// channel closes at the end of the input.
fn stdin_lines() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads input lines until `want` (an error at the end of input).
async fn expect_line(
    lines: &mut mpsc::UnboundedReceiver<String>,
    want: &str,
) -> anyhow::Result<()> {
    while let Some(l) = lines.recv().await {
        if l.trim() == want {
            return Ok(());
        }
    }
    bail!("input ended before {want:?}")
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs one child role (see [`Role`]).
pub async fn child(role: Role) -> anyhow::Result<()> {
    let mut lines = stdin_lines();
    match role {
        Role::Store { data, metadata_url } => {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let cfg = kt_store::Config::new(data, metadata_url, Token::new(TOKEN)?);
            let shutdown = CancellationToken::new();
            let store = kt_store::start(listener, cfg, shutdown.clone())?;
            say("ready");
            while let Some(l) = lines.recv().await {
                if l.trim() == "cpu" {
                    say(&format!("cpu {}", self_time().as_secs_f64()));
                }
            }
            shutdown.cancel();
            store.task.await?.context("store")?;
        }
        Role::Put {
            metadata_url,
            key,
            src,
            cache,
        } => {
            let client = client(&metadata_url, &cache)?;
            let key = Key::parse(&key)?;
            say("ready");
            expect_line(&mut lines, "go").await?;
            let before = self_time();
            client
                .put(&key, &src, PutOptions::default(), Progress::none())
                .await
                .with_context(|| format!("kt put {key}"))?;
            say(&format!("done {}", (self_time() - before).as_secs_f64()));
        }
        Role::Member {
            metadata_url,
            key,
            group,
            dest,
            cache,
        } => {
            let client = client(&metadata_url, &cache)?;
            let key = Key::parse(&key)?;
            let options = BroadcastOptions {
                group: Some(group),
                fanout: Some(1),
                window: Some(Duration::from_secs(60)),
                delete: false,
            };
            say("ready");
            expect_line(&mut lines, "go").await?;
            let before = self_time();
            let s = client
                .get_broadcast(&key, &dest, &options, Progress::none())
                .await
                .with_context(|| format!("broadcast get of {key}"))?;
            say(&format!(
                "done {} {} {}",
                (self_time() - before).as_secs_f64(),
                s.rank,
                s.relayed
            ));
        }
    }
    Ok(())
}

/// A child process of this program, killed when dropped.
struct Kid {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Kid {
    fn spawn(name: &str, args: &[String], log: &Path) -> anyhow::Result<Kid> {
        let exe = std::env::current_exe().context("where this program is")?;
        let log = std::fs::File::create(log)?;
        let mut child = Command::new(exe)
            .args(args)
            // Any free port: other relays on this host hold the default range.
            .env(kt_types::env::RELAY_PORT, "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the {name}"))?;
        let stdout = BufReader::new(child.stdout.take().context("child stdout")?).lines();
        Ok(Kid {
            name: name.to_owned(),
            stdin: child.stdin.take(),
            child,
            stdout,
        })
    }

    async fn tell(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    /// The next line, which must start with `word`: the rest of it.
    async fn hear(&mut self, word: &str) -> anyhow::Result<String> {
        let line = tokio::time::timeout(STEP_TIMEOUT, self.stdout.next_line())
            .await
            .with_context(|| format!("the {} said nothing for {STEP_TIMEOUT:?}", self.name))??;
        match line {
            Some(l) if l.split_whitespace().next() == Some(word) => {
                Ok(l[word.len()..].trim().to_owned())
            }
            Some(l) => bail!("the {} said {l:?}, expected {word:?}", self.name),
            None => bail!("the {} exited early (see its log)", self.name),
        }
    }

    /// Closes its input and waits for it to exit.
    async fn end(mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        let status = tokio::time::timeout(STEP_TIMEOUT, self.child.wait())
            .await
            .with_context(|| format!("the {} did not exit", self.name))??;
        if !status.success() {
            bail!("the {} exited with {status} (see its log)", self.name);
        }
        Ok(())
    }
}

fn numbers(s: &str) -> anyhow::Result<Vec<f64>> {
    s.split_whitespace()
        .map(|w| {
            w.parse::<f64>()
                .with_context(|| format!("not a number: {w:?}"))
        })
        .collect()
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

/// Runs the benchmark (see the module documentation).
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    if opts.members < 2 {
        bail!("--members must be at least 2 (a relaying member and a pure getter)");
    }
    let work = ScratchDir::create(&opts.dir)?;
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let metadata_url = format!("http://{}", listener.local_addr()?);
    let meta = kt_metadata::Config::new(work.path().join("metadata"), Token::new(TOKEN)?);
    let metadata = tokio::spawn(kt_metadata::run(listener, meta, shutdown.clone()));

    let mut store = Kid::spawn(
        "store",
        &[
            "store".into(),
            "--data".into(),
            path_arg(&work.subdir("store")?),
            "--metadata-url".into(),
            metadata_url.clone(),
        ],
        &work.path().join("store.log"),
    )?;
    store.hear("ready").await?;
    wait_registered(&client(&metadata_url, &work.subdir("probe")?)?).await?;

    let mut runs = Vec::new();
    for i in 0..opts.runs {
        let r = one_run(opts, &work, &metadata_url, &mut store, i).await?;
        eprintln!(
            "run {}: relay {:.2} s/GiB, getter {:.2} s/GiB, broadcast {:.2} s",
            i + 1,
            secs_per_gib(median(&r.relays), opts.size),
            secs_per_gib(r.getter, opts.size),
            r.broadcast_wall.as_secs_f64()
        );
        runs.push(r);
    }
    store.end().await?;
    shutdown.cancel();
    metadata.await?.context("metadata server")?;
    Ok(Report {
        size: opts.size,
        members: opts.members,
        runs,
    })
}

async fn store_cpu(store: &mut Kid) -> anyhow::Result<f64> {
    store.tell("cpu").await?;
    Ok(numbers(&store.hear("cpu").await?)?[0])
}

async fn wait_registered(client: &Client) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match client.store_url().await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("the store did not register within a minute: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn one_run(
    opts: &Options,
    work: &ScratchDir,
    metadata_url: &str,
    store: &mut Kid,
    i: usize,
) -> anyhow::Result<Run> {
    let dir = work.subdir(&format!("run-{i}"))?;
    let src = dir.join("payload.bin");
    let (src2, size) = (src.clone(), opts.size);
    kt_sync::task::blocking(move || crate::data::generate_large(&src2, size, 1000 + i as u64))
        .await?;
    let key = format!("cpu/run-{i}");
    let mut run = Run::default();

    // The put.
    let mut put = Kid::spawn(
        "putter",
        &[
            "put".into(),
            "--metadata-url".into(),
            metadata_url.into(),
            "--key".into(),
            key.clone(),
            "--src".into(),
            path_arg(&src),
            "--cache".into(),
            path_arg(&dir.join("put-cache")),
        ],
        &dir.join("put.log"),
    )?;
    put.hear("ready").await?;
    let store_before = store_cpu(store).await?;
    let started = Instant::now();
    put.tell("go").await?;
    run.put_client = numbers(&put.hear("done").await?)?[0];
    run.put_wall = started.elapsed();
    run.put_store = store_cpu(store).await? - store_before;
    put.end().await?;
    std::fs::remove_file(&src).with_context(|| format!("removing {}", src.display()))?;

    // The broadcast.
    let group = format!("cpu-{}-{i}", std::process::id());
    let mut members = Vec::new();
    for m in 0..opts.members {
        let kid = Kid::spawn(
            &format!("member {m}"),
            &[
                "member".into(),
                "--metadata-url".into(),
                metadata_url.into(),
                "--key".into(),
                key.clone(),
                "--group".into(),
                group.clone(),
                "--dest".into(),
                path_arg(&dir.join(format!("dest-{m}"))),
                "--cache".into(),
                path_arg(&dir.join(format!("cache-{m}"))),
            ],
            &dir.join(format!("member-{m}.log")),
        )?;
        members.push(kid);
    }
    for m in &mut members {
        m.hear("ready").await?;
    }
    let store_before = store_cpu(store).await?;
    let started = Instant::now();
    for m in &mut members {
        m.tell("go").await?;
    }
    // (cpu, rank, relayed) of each member.
    let mut done = Vec::new();
    for m in &mut members {
        let n = numbers(&m.hear("done").await?)?;
        done.push((n[0], n[1] as u32, n[2] as u64));
    }
    run.broadcast_wall = started.elapsed();
    run.store_send = store_cpu(store).await? - store_before;
    for m in members {
        m.end().await?;
    }
    done.sort_by_key(|d| d.1);
    // A chain: every rank but the last relayed the whole payload once.
    let last = done.len() - 1;
    for (k, &(cpu, rank, relayed)) in done.iter().enumerate() {
        let want = if k < last { opts.size } else { 0 };
        if relayed != want {
            bail!(
                "rank {rank} relayed {relayed} bytes, not {want}: the group was not one chain \
                 (a member joined late?); run again"
            );
        }
        if k < last {
            run.relays.push(cpu);
        } else {
            run.getter = cpu;
        }
    }
    crate::scratch::recreate_dir(&dir)?;
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_medians_per_gib() {
        let r = |relay: f64| Run {
            put_client: 1.0,
            put_store: 0.5,
            store_send: 0.25,
            relays: vec![relay, relay * 3.0, relay],
            getter: 0.75,
            ..Run::default()
        };
        let report = Report {
            size: 512 << 20,
            members: 4,
            runs: vec![r(1.0), r(2.0), r(1.5)],
        };
        let figs = report.figures();
        assert_eq!(figs[0], ("put_client", vec![2.0, 2.0, 2.0]));
        // Each run's relay is the median of its relaying members.
        assert_eq!(figs[3], ("relay", vec![2.0, 4.0, 3.0]));
        let text = report.render();
        assert!(text.contains("relay=3.00"), "{text}");
        assert!(text.contains("relay_target=met"), "{text}");
        assert!((ms_per_mb(1.0) - 0.931).abs() < 0.001);
    }
}
