//! `kt-bench-broadcast`: one payload to many pods over shaped links (netns
//! target, root), in three scenarios run one after the other:
//! - `testbed/bench/broadcast-300mbit.yaml`: 256 MiB to 12 pods over
//!   300 Mbit/s links, link-bound even on 2 cores: a broadcast with its
//!   rank 1 SIGKILLed midway, a single get, all from the store (star), and a
//!   broadcast in kt's default shape;
//! - `testbed/bench/broadcast-250mbit.yaml`: the same legs, 512 MiB to 32 pods
//!   over 250 Mbit/s links (CPU-bound on a small host: the table's `cpu`
//!   column says how busy the cores were);
//! - `testbed/bench/broadcast.yaml`: 512 MiB to 32 pods over 1 Gbit/s links
//!   (single, star, tree).
//!
//! For each it prints a table, where each broadcast member's time went
//! (per rank: joining, waiting for the first byte, receiving and the pauses
//! within, hashing, writing, finishing, serving its children, its CPU), and
//! one line
//! `broadcast NAME: single=Ts star=Ts tree=Ts killed=Ts tree/single=R star/tree=R killed/single=R store_egress_tree=B`
//! and whether the targets (tree/single <= 1.2, star/tree >= 8,
//! killed/single <= 1.5) are met (informational), naming the legs whose
//! cores were busy 90% of the time or more. Exits non-zero when a scenario
//! failed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use kt_bench::broadcast::{self, RunFiles};

/// Runs the broadcast benchmark scenario and summarizes it.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-broadcast")]
struct Args {
    /// The scenario files, run in this order (repeat the flag).
    #[arg(
        long,
        default_values = [
            "testbed/bench/broadcast-300mbit.yaml",
            "testbed/bench/broadcast-250mbit.yaml",
            "testbed/bench/broadcast.yaml",
        ]
    )]
    scenario: Vec<PathBuf>,
    /// Where kt-scenario, kt, kt-store, kt-metadata and kt-agent are.
    #[arg(long, default_value = "target/release")]
    bin_dir: PathBuf,
    /// Where each scenario's report directory goes (`<report>/<file stem>`:
    /// report.json, the failure dump, and the run's snapshot holding its
    /// records).
    #[arg(long, default_value = "target/bench-broadcast")]
    report: PathBuf,
    /// The testbed: netns (shaped links; root) or local (no shaping: a
    /// smoke test of the scenario, not a measurement).
    #[arg(long, default_value = "netns")]
    target: String,
    /// Extra arguments for `kt-scenario run` (after `--`), e.g. `--keep`.
    #[arg(last = true)]
    scenario_args: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kt-bench-broadcast: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Ok(false): a scenario failed (what it measured is still printed).
async fn run(args: &Args) -> anyhow::Result<bool> {
    let kt_scenario = args.bin_dir.join("kt-scenario");
    if !kt_scenario.is_file() {
        anyhow::bail!(
            "{} not found; build the release binaries first (make bench-broadcast does)",
            kt_scenario.display()
        );
    }
    let mut all_ok = true;
    let mut lines = Vec::new();
    for scenario in &args.scenario {
        let (ok, line) = run_one(args, &kt_scenario, scenario).await?;
        all_ok &= ok;
        lines.extend(line);
    }
    if args.scenario.len() > 1 {
        println!();
        for l in lines {
            println!("{l}");
        }
    }
    Ok(all_ok)
}

/// Runs one scenario; Ok((false, _)) when it failed. Its final line, if any.
async fn run_one(
    args: &Args,
    kt_scenario: &Path,
    scenario: &Path,
) -> anyhow::Result<(bool, Option<String>)> {
    let stem = scenario
        .file_stem()
        .with_context(|| format!("{}: no file name", scenario.display()))?;
    let report_dir = args.report.join(stem);
    let files = RunFiles::new(&report_dir);
    files
        .clear()
        .with_context(|| format!("clearing {}", report_dir.display()))?;
    let argv = broadcast::scenario_args(
        scenario,
        &args.target,
        &files,
        &args.bin_dir,
        &args.scenario_args,
    );
    println!("$ {} {}", kt_scenario.display(), argv.join(" "));
    let started = Instant::now();
    let mut child = tokio::process::Command::new(kt_scenario)
        .args(&argv)
        // The snapshot holds this run's measurements: no need to see it as
        // a diff.
        .env("INSTA_OUTPUT", "none")
        .spawn()
        .with_context(|| format!("starting {}", kt_scenario.display()))?;
    // Ctrl-C reaches kt-scenario too (same process group): wait while it
    // tears its testbed down, then report what there is.
    let status = loop {
        tokio::select! {
            s = child.wait() => break s.context("waiting for kt-scenario")?,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("interrupted: waiting for kt-scenario to tear its testbed down");
            }
        }
    };
    let wall = started.elapsed().as_secs_f64();

    let report = broadcast::read_report(&files)?;
    let Some(scn) = report.scenarios.first() else {
        anyhow::bail!("the report holds no scenario");
    };
    println!();
    for s in &scn.steps {
        if s.status != "passed" {
            println!(
                "step {:?} {}: {}",
                s.name,
                s.status,
                s.error.as_deref().unwrap_or("")
            );
        }
    }
    let records = match broadcast::read_records(&files, &scn.name) {
        Ok(r) => r,
        Err(e) if scn.status != "passed" => {
            // A failed scenario writes no snapshot: only times are known.
            println!("(no records: {e:#})");
            serde_json::Value::Null
        }
        Err(e) => return Err(e),
    };
    let ok = status.success() && scn.status == "passed";
    let mut line = None;
    match broadcast::results(scn, &records) {
        Ok(r) => {
            print!("{}", broadcast::table(&r));
            print!("{}", broadcast::member_table(&r));
            println!(
                "target {}; wall {} (testbed up {}, scenario {})",
                report.target,
                broadcast::secs(wall),
                broadcast::secs(scn.setup_ms / 1e3),
                broadcast::secs(scn.duration_ms / 1e3)
            );
            for t in broadcast::targets(&r) {
                println!("{t}");
            }
            let l = broadcast::final_line(&scn.name, &r);
            println!("{l}");
            line = Some(l);
        }
        Err(e) if !ok => println!("no results: {e:#}"),
        Err(e) => return Err(e),
    }
    if !ok {
        eprintln!(
            "kt-bench-broadcast: {} failed ({}): {}",
            scn.name,
            status,
            scn.message.as_deref().unwrap_or("see the report")
        );
    }
    Ok((ok, line))
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
