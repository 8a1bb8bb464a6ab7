//! `kt-bench-rsync`: kt against a real rsync daemon on this machine.
//!
//! Prints a table (median seconds per case for kt and rsync, and kt/rsync),
//! then one line `ratio small_cold=R small_noop=R small_changed=R large_cold=R
//! large_get=R` (the large cases are left out with `--skip-large`) and one
//! `cpu-s/GiB large_cold=kt:K,rsync:R large_get=kt:K,rsync:R` (CPU seconds per
//! GiB moved, kt's client and servers against rsync's client and daemon).

#![allow(unsafe_code)]

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
    /// Leave out the large-file cases.
    #[arg(long)]
    skip_large: bool,
    /// Run only these cases (comma-separated: small_cold, small_noop,
    /// small_changed, large_cold, large_get); all by default.
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// Log the in-process kt servers and client on stderr with this filter
    /// (tracing EnvFilter syntax, e.g. `kt_store=debug`); off by default.
    #[arg(long)]
    log: Option<String>,
    /// kt over TLS: its servers serve HTTPS with a certificate of a CA made
    /// for the run (rustls, ring); rsync stays plain. Compare the ratios
    /// with a run without it for the cost of transport security.
    #[arg(long)]
    tls: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let certs = match args.tls.then(kt_bench::tls::TestPki::create).transpose() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kt-bench-rsync: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(c) = &certs {
        // SAFETY: no other thread exists yet (the runtime is built below).
        unsafe { std::env::set_var(kt_api::tls::CA_FILE, c.ca()) };
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kt-bench-rsync: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(bench(args, certs))
}

async fn bench(args: Args, certs: Option<kt_bench::tls::TestPki>) -> ExitCode {
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
        cases: args.cases,
        tls: certs.as_ref().map(|c| c.server()),
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
            let cpu = report::cpu_line(&results);
            if !cpu.is_empty() {
                println!("{cpu}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-rsync: {e:#}");
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
