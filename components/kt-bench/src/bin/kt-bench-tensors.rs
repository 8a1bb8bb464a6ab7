//! `kt-bench-tensors`: GPU data on the host backend against plain TCP.
//!
//! A state dict (500 tensors, 1 GiB by default) moves from one node agent to
//! another in this process, packed and unpacked, and the same bytes move over
//! a plain loopback TCP connection; see [`kt_bench::tensors`]. Prints a table
//! (per case: median seconds, GiB/s, every run), then one line
//! `ratio packed_vs_tcp=R unpacked_vs_tcp=R packed_vs_unpacked=R
//! per_tensor_overhead_us=X` (throughput ratios; (unpacked - packed) /
//! tensors).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kt_bench::tensors::{self, DictArgs, Options};

/// Times a state dict between two node agents (host backend), packed and
/// unpacked, against a plain TCP copy of the same bytes: 1 GiB by default,
/// 64 MiB with --quick.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-tensors")]
struct Args {
    /// Where the work directory goes; its `shm/` holds the tensors and is
    /// both agents' shared-memory directory (tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    #[command(flatten)]
    dict: DictArgs,
    /// Log the in-process servers on stderr with this filter (tracing
    /// EnvFilter syntax, e.g. `kt_agent=debug`); off by default.
    #[arg(long)]
    log: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(filter) = &args.log {
        kt_service::telemetry::init_logging(Some(filter), Some("text"));
    }
    let opts = Options::of(args.dir, args.dict.resolve(1 << 30, 64 << 20));
    // On Ctrl-C the run is dropped, which stops the servers and removes the
    // work directory with its shared memory.
    let outcome = tokio::select! {
        r = tensors::run(&opts) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    match outcome {
        Ok(results) => {
            print!("{}", results.table());
            println!("{}", results.ratio_line());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-tensors: {e:#}");
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
