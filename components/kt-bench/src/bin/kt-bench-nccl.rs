//! `kt-bench-nccl`: GPU data on the NCCL backend against a bare NCCL
//! broadcast of the same bytes (needs a CUDA GPU and NCCL 2.14+).
//!
//! A state dict (500 tensors, 4 GiB by default) moves from rank 0 to rank 1
//! through the transfer engine the node agent runs, packed and unpacked,
//! and the same bytes move in one bare broadcast; see [`kt_bench::nccl`].
//! Prints a table (per case: median seconds, GiB/s, every run), then one
//! line `ratio packed_vs_nccl=R unpacked_vs_nccl=R packed_vs_unpacked=R
//! per_tensor_overhead_us=X` (throughput ratios; (unpacked - packed) /
//! tensors).

use std::process::ExitCode;

use clap::Parser;
use kt_bench::nccl;
use kt_bench::tensors::DictArgs;

/// Times a state dict between two NCCL ranks through kt's transfer engine,
/// packed and unpacked, against a bare NCCL broadcast of the same bytes:
/// 4 GiB by default, 256 MiB with --quick.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-nccl")]
struct Args {
    #[command(flatten)]
    dict: DictArgs,
}

fn main() -> ExitCode {
    // NCCL's unique id is made in this executable again (see
    // kt_tensor::cuda::serve_root_helper).
    if let Some(served) = kt_tensor::cuda::serve_root_helper() {
        return match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kt-bench-nccl: {e}");
                ExitCode::FAILURE
            }
        };
    }
    // The two ranks are this executable again.
    if let Some(outcome) = nccl::child() {
        return match outcome {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kt-bench-nccl rank: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let args = Args::parse();
    let opts = args.dict.resolve(nccl::FULL_SIZE, nccl::QUICK_SIZE);
    match nccl::run(&opts) {
        Ok(results) => {
            print!("{}", results.table());
            println!("{}", results.ratio_line());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-nccl: {e:#}");
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
