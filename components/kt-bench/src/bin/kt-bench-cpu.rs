//! `kt-bench-cpu`: CPU seconds per GiB of a put, the store's send, a
//! relaying broadcast member and a pure getter, on loopback without root;
//! see [`kt_bench::relay_cpu`]. Prints a table (each figure's median and
//! runs, in CPU s/GiB and ms/MB), the wall times, then one line
//! `cpu size_mib=… members=… put_client=… put_store=… store_send=… relay=…
//! getter=… relay_ms_per_mb=… relay_target=met|MISSED`.
//!
//! The store, the putter and the members are this program again, run with
//! a role (`store`, `put`, `member`): not for use by hand.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kt_bench::relay_cpu::{self, Options, Role};

/// Measures CPU per byte of kt's transfers (one store, a putter, a chain of
/// broadcast members, each its own process).
#[derive(Debug, Parser)]
#[command(name = "kt-bench-cpu")]
struct Args {
    /// Where the work directory goes (tmpfs keeps the disk out of it).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// The payload's size (e.g. 256MiB, 1GiB).
    #[arg(long, default_value = "256MiB", value_parser = kt_bench::size::parse_size)]
    size: u64,
    /// Broadcast members (a chain: all but the last relay).
    #[arg(long, default_value_t = 4)]
    members: usize,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[command(subcommand)]
    role: Option<ChildRole>,
}

/// A child's role (the benchmark starts these itself).
#[derive(Debug, Subcommand)]
enum ChildRole {
    #[command(hide = true)]
    Store {
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        metadata_url: String,
    },
    #[command(hide = true)]
    Put {
        #[arg(long)]
        metadata_url: String,
        #[arg(long)]
        key: String,
        #[arg(long)]
        src: PathBuf,
        #[arg(long)]
        cache: PathBuf,
    },
    #[command(hide = true)]
    Member {
        #[arg(long)]
        metadata_url: String,
        #[arg(long)]
        key: String,
        #[arg(long)]
        group: String,
        #[arg(long)]
        dest: PathBuf,
        #[arg(long)]
        cache: PathBuf,
    },
}

impl From<ChildRole> for Role {
    fn from(r: ChildRole) -> Role {
        match r {
            ChildRole::Store { data, metadata_url } => Role::Store { data, metadata_url },
            ChildRole::Put {
                metadata_url,
                key,
                src,
                cache,
            } => Role::Put {
                metadata_url,
                key,
                src,
                cache,
            },
            ChildRole::Member {
                metadata_url,
                key,
                group,
                dest,
                cache,
            } => Role::Member {
                metadata_url,
                key,
                group,
                dest,
                cache,
            },
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(role) = args.role {
        return match relay_cpu::child(role.into()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kt-bench-cpu child: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let opts = Options {
        dir: args.dir,
        size: args.size,
        members: args.members,
        runs: args.runs.max(1),
    };
    match relay_cpu::run(&opts).await {
        Ok(report) => {
            print!("{}", report.render());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt-bench-cpu: {e:#}");
            ExitCode::FAILURE
        }
    }
}
