//! `kt-bench-metadata`: the metadata server under concurrent lookups, and
//! broadcast joins.
//!
//! Prints a latency table (per request kind: count, rate, p50/p95/p99/max),
//! the lookup rate, the CPU split and the errors, then one line
//! `metadata lookups_per_s=N p99_ms=X clients=C op=OP` (p99 of every request).
//! With `--joins N` it then lets N getters join one broadcast group, each on
//! its own WebSocket, and prints `joins=N assigned in Xs (Y joins/s), p99 Z ms`
//! (`--only-joins` skips the lookups). Exits non-zero when any request failed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kt_bench::metaload::joins::{self, JoinOptions};
use kt_bench::metaload::{self, Op, Options, Target};

/// Loads a metadata server (in process by default) with concurrent lookups.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-metadata")]
struct Args {
    /// What one lookup is: `lease` (lease a source, then release it: the
    /// getter's path) or `stat` (read the key's record).
    #[arg(long, default_value = "lease")]
    op: Op,
    /// Concurrent clients, each with one keep-alive connection.
    #[arg(long, default_value_t = 200)]
    clients: usize,
    /// Measured seconds.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Unmeasured seconds of load before the measurement.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Keys seeded (store keys).
    #[arg(long, default_value_t = 1000)]
    keys: usize,
    /// Fake node agents seeded; they heartbeat through the run.
    #[arg(long, default_value_t = 20)]
    agents: usize,
    /// Agents serving each key (its peers).
    #[arg(long, default_value_t = 3)]
    peers_per_key: usize,
    /// Seed of the clients' key choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Load this running server instead of one started in process
    /// (seeded under a unique prefix, removed at the end).
    #[arg(long, requires = "token")]
    url: Option<String>,
    /// The token of the server given by --url.
    #[arg(long, env = kt_types::env::TOKEN, hide_env_values = true)]
    token: Option<String>,
    /// Where the in-process server keeps its state.
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Log the in-process server on stderr with this filter (tracing
    /// EnvFilter syntax, e.g. `kt_metadata=debug`); off by default.
    #[arg(long)]
    log: Option<String>,
    /// Then let this many getters join one broadcast group, each holding a
    /// WebSocket until all are assigned (the in-process server then runs in
    /// a child process: one process cannot hold both ends of that many
    /// connections).
    #[arg(long)]
    joins: Option<usize>,
    /// Run the join benchmark alone, without the lookups.
    #[arg(long, requires = "joins")]
    only_joins: bool,
    /// Getters between connecting and being assigned at once.
    #[arg(long, default_value_t = 256)]
    join_concurrency: usize,
    /// Children per node of the joined group.
    #[arg(long, default_value_t = 50)]
    join_fanout: u32,
    /// Internal: serve a metadata server for the join benchmark, state under DIR.
    #[arg(long, hide = true, value_name = "DIR")]
    serve_metadata: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(filter) = &args.log {
        kt_service::telemetry::init_logging(Some(filter), Some("text"));
    }
    if let Some(dir) = &args.serve_metadata {
        return match joins::serve_child(dir).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kt-bench-metadata (server): {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let target = match (args.url, args.token) {
        (Some(url), Some(token)) => Target::External { url, token },
        _ => Target::InProcess { dir: args.dir },
    };
    let mut ok = true;
    if !args.only_joins {
        let opts = Options {
            target: target.clone(),
            keys: args.keys,
            agents: args.agents,
            peers_per_key: args.peers_per_key,
            clients: args.clients,
            warmup: args.warmup,
            duration: args.duration,
            op: args.op,
            seed: args.seed,
        };
        // On Ctrl-C the run is dropped, which stops the in-process server and
        // removes its state.
        let outcome = tokio::select! {
            r = metaload::run(&opts) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        };
        match outcome {
            Ok(o) => {
                print!("{}", o.report());
                println!("{}", o.summary_line());
                ok &= o.errors.count == 0;
            }
            Err(e) => {
                eprintln!("kt-bench-metadata: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(n) = args.joins {
        let opts = JoinOptions {
            target,
            joins: n,
            concurrency: args.join_concurrency,
            fanout: args.join_fanout,
        };
        // On Ctrl-C the run is dropped: the server process is killed.
        let outcome = tokio::select! {
            r = joins::run(&opts) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        };
        match outcome {
            Ok(o) => {
                print!("{}", o.report());
                println!("{}", o.summary_line());
                ok &= o.errors.count == 0 && o.assigned == n;
            }
            Err(e) => {
                eprintln!("kt-bench-metadata: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
