//! `kt-bench-s3`: an S3 ingest into the store against a plain download of
//! the same objects from the same S3 server (issue #33's target: within
//! 1.3×, the ingesting process's peak RSS under 256 MiB).
//!
//! ```text
//! bash testbed/s3/moto.sh      # once: moto's S3 server (make test does it too)
//! make bench-s3 BENCH_ARGS='--size 1GiB --objects 1000 --runs 3'
//! make bench-s3 BENCH_ARGS='--size 64MiB --objects 100 --runs 1'   # a quick run
//! ```
//!
//! It starts moto's server (`kt_dataset::ingest::moto`), fills a bucket
//! with `--objects` objects of `--size` in all (seeded pseudo-random
//! content, single-part uploads: ETags are MD5s), starts a metadata server
//! and a store in this process, then per run, interleaved: (a) a child
//! process downloads every object to local disk with the ingest's own S3
//! client, concurrency and streaming writer but nothing else
//! (`kt_dataset::ingest::download`), (b) a child process ingests them into
//! a fresh key from a fresh staging directory (`kt_dataset::ingest::ingest`:
//! download, verify and hash each object, and put them, each as soon as it
//! is down, `kt_client::Client::put_arriving`). Each child times itself and reports its
//! peak RSS (`VmHWM` from `/proc/self/status`). Prints a table, then one
//! line `s3-ingest size=… objects=… download_s=… ingest_s=… ratio=…
//! ratio_target=met|MISSED peak_rss_mib=… rss_target=met|MISSED
//! download_cpu_s=… ingest_cpu_s=…` (medians; the RSS is the largest of the
//! ingest runs). The CPU seconds of each half add the child's own, this
//! process's (the store and metadata server run in it) and moto's: on a
//! small shared machine the ratio follows them as much as the server's
//! speed.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use futures::{StreamExt, TryStreamExt};
use kt_bench::kt::KtCluster;
use kt_bench::report::median;
use kt_bench::size::{human, parse_size};
use kt_client::{Client, ClientConfig};
use kt_dataset::ingest::moto::Moto;
use kt_dataset::ingest::{S3Config, S3Credentials};
use kt_types::Key;
use rand::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

const BUCKET: &str = "bench";
const PREFIX: &str = "data";
/// Issue #33's targets.
const RATIO_TARGET: f64 = 1.3;
const RSS_TARGET_MIB: f64 = 256.0;

/// Times an S3 ingest into a kt store against a plain download of the same
/// objects, with moto's S3 server.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-s3")]
struct Args {
    /// Where the work directory goes (downloads, staging, the store).
    #[arg(long, env = kt_types::env::BENCH_DIR, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Bytes in all (e.g. 1GiB, 64MiB).
    #[arg(long, env = kt_types::env::BENCH_SIZE, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// How many objects share them.
    #[arg(long, env = kt_types::env::BENCH_OBJECTS, default_value_t = 1000)]
    objects: u64,
    #[arg(long, env = kt_types::env::BENCH_RUNS, default_value_t = 3)]
    runs: usize,
    /// Objects downloaded at once, by both.
    #[arg(long, env = kt_types::env::BENCH_CONCURRENCY, default_value_t = kt_dataset::ingest::s3::DEFAULT_CONCURRENCY)]
    concurrency: usize,
    #[command(subcommand)]
    child: Option<Child>,
}

/// The measured halves, run as child processes of the bench.
#[derive(Debug, Subcommand)]
enum Child {
    #[command(hide = true)]
    Download {
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        dest: PathBuf,
        #[arg(long)]
        concurrency: usize,
    },
    #[command(hide = true)]
    Ingest {
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        staging: PathBuf,
        #[arg(long)]
        concurrency: usize,
        #[arg(long)]
        metadata_url: String,
        #[arg(long)]
        token: String,
        #[arg(long)]
        cache_dir: PathBuf,
        #[arg(long)]
        key: String,
    },
}

/// What a child prints on stdout, one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Measured {
    seconds: f64,
    objects: u64,
    bytes: u64,
    /// Peak resident set size, KiB.
    vm_hwm_kib: u64,
    /// Of `seconds`, the put into the store: from its start, beside the
    /// downloads (it sends each object as soon as it is down), to its commit.
    #[serde(default)]
    put_seconds: f64,
    /// CPU seconds (user + system) the child used.
    #[serde(default)]
    cpu_seconds: f64,
}

/// CPU seconds of a measured half beside the child's own: moto's and this
/// process's (the store and metadata server run in it). On a small shared
/// machine the ratio follows the CPU each half needs as much as the
/// server's speed.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    server: f64,
    bench: f64,
}

/// Runs `half`, measuring moto's (`moto_pid`) and this process's CPU
/// around it.
async fn with_cpu<T>(
    moto_pid: Option<u32>,
    half: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Cpu)> {
    let server = || {
        moto_pid
            .and_then(kt_bench::cpu::process_tree_time)
            .map_or(0.0, |t| t.as_secs_f64())
    };
    let bench = || kt_bench::cpu::self_time().as_secs_f64();
    let (s0, b0) = (server(), bench());
    let got = half.await?;
    Ok((
        got,
        Cpu {
            server: server() - s0,
            bench: bench() - b0,
        },
    ))
}

fn s3(endpoint: &str, concurrency: usize) -> S3Config {
    S3Config {
        bucket: BUCKET.to_owned(),
        prefix: PREFIX.to_owned(),
        endpoint: Some(endpoint.to_owned()),
        region: None,
        credentials: Some(S3Credentials {
            access_key_id: "bench".to_owned(),
            secret_access_key: "bench".to_owned(),
            session_token: None,
        }),
        concurrency,
        record_every: kt_dataset::ingest::s3::RECORD_EVERY,
    }
}

fn vm_hwm_kib() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")
}

async fn child(c: Child) -> anyhow::Result<Measured> {
    match c {
        Child::Download {
            endpoint,
            dest,
            concurrency,
        } => {
            let started = Instant::now();
            let r = kt_dataset::ingest::download(&s3(&endpoint, concurrency), &dest).await?;
            Ok(Measured {
                seconds: started.elapsed().as_secs_f64(),
                objects: r.objects,
                bytes: r.bytes,
                vm_hwm_kib: vm_hwm_kib()?,
                put_seconds: 0.0,
                cpu_seconds: kt_bench::cpu::self_time().as_secs_f64(),
            })
        }
        Child::Ingest {
            endpoint,
            staging,
            concurrency,
            metadata_url,
            token,
            cache_dir,
            key,
        } => {
            let mut cfg = ClientConfig::new(metadata_url, token);
            cfg.cache_dir = Some(cache_dir);
            cfg.serve_copies = false;
            let client = Client::new(cfg)?;
            let key = Key::parse(&key)?;
            let started = Instant::now();
            let r = kt_dataset::ingest::ingest(
                &client,
                &key,
                &s3(&endpoint, concurrency),
                &staging,
                None,
            )
            .await?;
            if r.changed != r.objects || r.put.stats.bytes_sent != r.bytes {
                bail!(
                    "a fresh ingest fetched {} of {} objects and sent {} of {} bytes",
                    r.changed,
                    r.objects,
                    r.put.stats.bytes_sent,
                    r.bytes
                );
            }
            Ok(Measured {
                seconds: started.elapsed().as_secs_f64(),
                objects: r.objects,
                bytes: r.bytes,
                vm_hwm_kib: vm_hwm_kib()?,
                put_seconds: r.put.duration.as_secs_f64(),
                cpu_seconds: kt_bench::cpu::self_time().as_secs_f64(),
            })
        }
    }
}

/// Runs this program as a child with `args`; returns what it measured.
async fn run_child(args: &[String]) -> anyhow::Result<Measured> {
    let exe = std::env::current_exe().context("where am I")?;
    let out = tokio::process::Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("running a child")?;
    if !out.status.success() {
        bail!("child {} failed: {}", args[0], out.status);
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("child said {line:?}"))
}

async fn fill(moto: &Moto, size: u64, objects: u64) -> anyhow::Result<()> {
    moto.create_bucket(BUCKET)
        .await
        .map_err(anyhow::Error::msg)?;
    let each = size / objects.max(1);
    let extra = size % objects.max(1);
    futures::stream::iter(0..objects)
        .map(|i| async move {
            let len = each + u64::from(i < extra);
            let mut body = vec![0u8; len as usize];
            rand::rngs::SmallRng::seed_from_u64(i).fill_bytes(&mut body);
            moto.put_object(BUCKET, &format!("{PREFIX}/d{:02}/obj-{i:05}", i % 20), body)
                .await
                .map_err(anyhow::Error::msg)
        })
        .buffer_unordered(8)
        .try_collect::<()>()
        .await
}

async fn bench(args: &Args) -> anyhow::Result<()> {
    let work = tempfile::Builder::new()
        .prefix("kt-bench-s3-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("a work directory in {}", args.dir.display()))?;
    let moto = Moto::start().await.map_err(anyhow::Error::msg)?;
    let filling = Instant::now();
    fill(&moto, args.size, args.objects).await?;
    eprintln!(
        "kt-bench-s3: {} in {} objects put into moto in {:.1} s",
        human(args.size),
        args.objects,
        filling.elapsed().as_secs_f64()
    );
    let cluster = KtCluster::start(&work.path().join("kt"), None).await?;
    let token = cluster.client().bearer().to_string();
    let endpoint = moto.endpoint().to_owned();
    let concurrency = args.concurrency.max(1).to_string();
    let (mut downloads, mut ingests, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    println!(
        "run  download_s  ingest_s  (put_s, overlapping)  ratio  ingest_peak_rss_mib  download_peak_rss_mib  \
         cpu_s: download (client+bench+s3)  ingest (client+store+s3)"
    );
    for run in 0..args.runs.max(1) {
        let dest = work.path().join(format!("download-{run}"));
        let (d, d_cpu) = with_cpu(
            moto.pid(),
            run_child(&[
                "download".into(),
                "--endpoint".into(),
                endpoint.clone(),
                "--dest".into(),
                path_arg(&dest),
                "--concurrency".into(),
                concurrency.clone(),
            ]),
        )
        .await?;
        std::fs::remove_dir_all(&dest).ok();
        let staging = work.path().join(format!("staging-{run}"));
        let cache = work.path().join(format!("cache-{run}"));
        let key = format!("bench/s3-{run}");
        let (i, i_cpu) = with_cpu(
            moto.pid(),
            run_child(&[
                "ingest".into(),
                "--endpoint".into(),
                endpoint.clone(),
                "--staging".into(),
                path_arg(&staging),
                "--concurrency".into(),
                concurrency.clone(),
                "--metadata-url".into(),
                cluster.metadata_url().to_owned(),
                "--token".into(),
                token.clone(),
                "--cache-dir".into(),
                path_arg(&cache),
                "--key".into(),
                key.clone(),
            ]),
        )
        .await?;
        if (d.objects, d.bytes) != (i.objects, i.bytes) || d.bytes != args.size {
            bail!("download moved {d:?}, ingest {i:?}, of {} bytes", args.size);
        }
        cluster.rm(&key).await?;
        std::fs::remove_dir_all(&staging).ok();
        std::fs::remove_dir_all(&cache).ok();
        let (d_total, i_total) = (
            d.cpu_seconds + d_cpu.server + d_cpu.bench,
            i.cpu_seconds + i_cpu.server + i_cpu.bench,
        );
        println!(
            "{run:>3}  {:>10.2}  {:>8.2}  {:>19.2}  {:>5.2}  {:>19.1}  {:>21.1}  \
             {d_total:>6.2} ({:.2}+{:.2}+{:.2})  {i_total:>6.2} ({:.2}+{:.2}+{:.2})",
            d.seconds,
            i.seconds,
            i.put_seconds,
            i.seconds / d.seconds,
            mib(i.vm_hwm_kib),
            mib(d.vm_hwm_kib),
            d.cpu_seconds,
            d_cpu.bench,
            d_cpu.server,
            i.cpu_seconds,
            i_cpu.bench,
            i_cpu.server,
        );
        downloads.push(d);
        ingests.push(i);
        cpu.push((d_total, i_total));
    }
    let d_cpu = median(&cpu.iter().map(|c| c.0).collect::<Vec<_>>());
    let i_cpu = median(&cpu.iter().map(|c| c.1).collect::<Vec<_>>());
    let d = median(&downloads.iter().map(|m| m.seconds).collect::<Vec<_>>());
    let i = median(&ingests.iter().map(|m| m.seconds).collect::<Vec<_>>());
    let rss = ingests
        .iter()
        .map(|m| mib(m.vm_hwm_kib))
        .fold(0.0, f64::max);
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "s3-ingest size={} objects={} concurrency={} download_s={d:.2} ingest_s={i:.2} ratio={:.2} \
         ratio_target={} peak_rss_mib={rss:.1} rss_target={} download_cpu_s={d_cpu:.2} \
         ingest_cpu_s={i_cpu:.2}",
        human(args.size),
        args.objects,
        args.concurrency,
        i / d,
        verdict(i / d <= RATIO_TARGET),
        verdict(rss < RSS_TARGET_MIB),
    );
    cluster.stop().await?;
    drop(moto);
    Ok(())
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = Args::parse();
    if let Some(c) = args.child.take() {
        return match child(c).await {
            Ok(m) => {
                println!("{}", serde_json::to_string(&m).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kt-bench-s3 (child): {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    match bench(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kt-bench-s3: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
