//! `kt-bench-recovery`: what one store restart in the middle of a large get
//! costs; see [`kt_bench::recovery`]. Prints a table (per run: baseline and
//! with-restart seconds, the extra time, how long the store was away, the
//! MiB received twice), then one line `recovery size=… extra_s=… away_s=…
//! extra_target=met|MISSED refetched_mib=… refetch_limit_mib=…
//! refetch_target=met|MISSED` (medians).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kt_bench::recovery::{self, Options};

/// Times a get of one large file with and without a store SIGKILLed and
/// started again midway, with the real kt-metadata and kt-store binaries.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-recovery")]
struct Args {
    /// Where the work directory goes (tmpfs keeps the disk out of it).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// Where kt-metadata and kt-store are; by default beside this program.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The file's size (e.g. 1GiB, 256MiB).
    #[arg(long, default_value = "1GiB", value_parser = kt_bench::size::parse_size)]
    size: u64,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The fraction of the file the get has when the store is killed.
    #[arg(long, default_value_t = 0.5)]
    at: f64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let bin_dir = match args.bin_dir.clone().map(Ok).unwrap_or_else(|| {
        std::env::current_exe().map(|p| p.parent().map(PathBuf::from).unwrap_or_default())
    }) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kt-bench-recovery: where am I: {e}");
            return ExitCode::FAILURE;
        }
    };
    let opts = Options {
        dir: args.dir,
        bin_dir,
        size: args.size,
        runs: args.runs.max(1),
        at: args.at,
    };
    match recovery::run(&opts).await {
        Ok(report) => {
            print!("{}", report.render());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-recovery: {e:#}");
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
