//! `kt-bench-shards`: a streamed share ([`kt_client::stream`]) against a
//! plain prefix get of the same data, with in-process servers: `--shards`
//! single-file keys of `--size` bytes in all below one prefix. Per run it
//! times the prefix get (until every file is there) and the stream of the
//! whole dataset (rank 0 of 1): its first file, its end, its throughput,
//! and the most bytes it held (reserved, and as sampled on disk) against
//! its budget. The last line: `shards files=… bytes=… get_s=… first_s=…
//! first_ratio=… stream_s=… stream_mibs=… get_mibs=… peak_disk=… budget=…
//! first_target=met|MISSED budget_target=met|MISSED` (medians; the first
//! file's target is under 10% of the full get's time).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kt_bench::kt::KtCluster;
use kt_bench::report::median;
use kt_bench::scratch::ScratchDir;
use kt_client::GetOptions;
use kt_client::stream::StreamOptions;
use kt_types::KeyPrefix;
use kt_types::shard::{Shard, ShareSpec};

#[derive(Debug, Parser)]
#[command(name = "kt-bench-shards")]
struct Args {
    /// Where the work directory goes.
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// Bytes of the whole dataset (e.g. 1GiB).
    #[arg(long, default_value = "1GiB", value_parser = kt_bench::size::parse_size)]
    size: u64,
    /// Files it is split into.
    #[arg(long, default_value_t = 64)]
    shards: u64,
    /// The stream's budget (e.g. 256MiB).
    #[arg(long, default_value = "256MiB", value_parser = kt_bench::size::parse_size)]
    budget: u64,
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    get_s: f64,
    first_s: f64,
    stream_s: f64,
    peak_reserved: u64,
    peak_disk: u64,
}

async fn one(kt: &KtCluster, scratch: &ScratchDir, n: usize, args: &Args) -> anyhow::Result<Run> {
    let prefix = KeyPrefix::parse("bench/shards")?;
    let client = kt.client();
    let dest = scratch.subdir(&format!("get-{n}"))?;
    let started = Instant::now();
    client
        .get_prefix(&prefix, &dest, &GetOptions::default())
        .await
        .context("the prefix get")?;
    let get_s = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&dest).ok();

    let dir = scratch.subdir(&format!("stream-{n}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, most, dir) = (stop.clone(), most.clone(), dir.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                most.fetch_max(kt_sync::du::disk_bytes(&dir), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let spec = ShareSpec {
        shard: Shard::new(0, 1)?,
        epoch: 0,
        shuffle: false,
    };
    let mut opts = StreamOptions::new(spec, args.budget);
    opts.dir = Some(dir.clone());
    let started = Instant::now();
    let mut s = client.stream_share(&prefix, opts).await?;
    let mut first_s = None;
    let mut files = 0u64;
    while let Some(f) = s.next().await {
        let f = f?;
        first_s.get_or_insert(started.elapsed().as_secs_f64());
        files += 1;
        drop(f);
    }
    let stream_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    sampler.join().ok();
    anyhow::ensure!(
        files == args.shards,
        "streamed {files} of {} files",
        args.shards
    );
    Ok(Run {
        get_s,
        first_s: first_s.unwrap_or(stream_s),
        stream_s,
        peak_reserved: s.peak_held(),
        peak_disk: most.load(Ordering::SeqCst),
    })
}

async fn bench(args: &Args) -> anyhow::Result<String> {
    let scratch = ScratchDir::create(&args.dir)?;
    let kt = KtCluster::start(&scratch.subdir("kt")?, None).await?;
    let src = scratch.subdir("src")?;
    let each = args.size / args.shards.max(1);
    for i in 0..args.shards {
        let file = src.join(format!("part-{i:04}.bin"));
        kt_bench::data::generate_large(&file, each, 77 + i)?;
        kt.put(&format!("bench/shards/part-{i:04}.bin"), &file)
            .await?;
        std::fs::remove_file(&file).ok();
    }
    let total = each * args.shards;
    let mut out = String::from("run  get_s  first_s  stream_s  peak_reserved  peak_disk\n");
    let mut runs = Vec::new();
    for n in 0..args.runs.max(1) {
        let r = one(&kt, &scratch, n, args).await?;
        out.push_str(&format!(
            "{n:>3}  {:>5.2}  {:>7.3}  {:>8.2}  {:>13}  {:>9}\n",
            r.get_s, r.first_s, r.stream_s, r.peak_reserved, r.peak_disk
        ));
        runs.push(r);
    }
    kt.stop().await?;
    let get_s = median(&runs.iter().map(|r| r.get_s).collect::<Vec<_>>());
    let first_s = median(&runs.iter().map(|r| r.first_s).collect::<Vec<_>>());
    let stream_s = median(&runs.iter().map(|r| r.stream_s).collect::<Vec<_>>());
    let peak_disk = runs.iter().map(|r| r.peak_disk).max().unwrap_or(0);
    let peak_reserved = runs.iter().map(|r| r.peak_reserved).max().unwrap_or(0);
    let mib = total as f64 / f64::from(1 << 20);
    let ratio = first_s / get_s;
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    out.push_str(&format!(
        "shards files={} bytes={total} get_s={get_s:.3} first_s={first_s:.3} first_ratio={ratio:.3} \
         stream_s={stream_s:.3} stream_mibs={:.0} get_mibs={:.0} peak_reserved={peak_reserved} \
         peak_disk={peak_disk} budget={} first_target={} budget_target={}\n",
        args.shards,
        mib / stream_s,
        mib / get_s,
        args.budget,
        met(ratio < 0.1),
        met(peak_disk <= args.budget.max(each) && peak_reserved <= args.budget.max(each)),
    ));
    Ok(out)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match bench(&args).await {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-shards: {e:#}");
            ExitCode::FAILURE
        }
    }
}
