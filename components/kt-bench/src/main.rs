//! `kt-bench-rsync`: kt against a real rsync daemon on this machine.
//!
//! Prints a table (median seconds per case for kt and rsync, and kt/rsync),
//! then one line `ratio small_cold=R small_noop=R small_changed=R large_cold=R`
//! (`large_cold` is left out with `--skip-large`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kt_bench::compare::{self, Options};
use kt_bench::report;
use kt_bench::size::parse_size;

/// Compares kt put with rsync to a local rsync daemon, both on tmpfs.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-rsync")]
struct Args {
    /// Where the work directory goes (tmpfs, so neither side waits on a disk).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// Size of the large file (bytes; K, M, G, T suffixes are binary).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    large_size: u64,
    /// Runs per case; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Untimed warm-up runs per case before the measured ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Number of 4 KiB files in the small tree.
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Leave out the large-file case.
    #[arg(long)]
    skip_large: bool,
    /// Log the in-process kt servers and client on stderr with this filter
    /// (tracing EnvFilter syntax, e.g. `kt_store=debug`); off by default.
    #[arg(long)]
    log: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(filter) = &args.log {
        kt_service::telemetry::init_logging(Some(filter), Some("text"));
    }
    let opts = Options {
        dir: args.dir,
        files: args.files,
        large_size: args.large_size,
        runs: args.runs,
        warmup: args.warmup,
        skip_large: args.skip_large,
    };
    // On Ctrl-C the run is dropped, which removes its work directory and
    // stops the rsync daemon and the servers.
    let outcome = tokio::select! {
        r = compare::run(&opts) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    match outcome {
        Ok(results) => {
            print!("{}", report::table(&results));
            println!("{}", report::ratio_line(&results));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-rsync: {e:#}");
            ExitCode::FAILURE
        }
    }
}
