//! `kt-bench-broadcast`: one 512 MiB payload to 32 pods over shaped 1 Gbit/s
//! links (netns target, root), measured in one run three ways: a single
//! point-to-point get, all 32 from the store (star), and a broadcast tree of
//! fanout 2. Runs `kt-scenario run testbed/bench/broadcast.yaml`, then prints
//! a table and one line
//! `broadcast single=Ts star=Ts tree=Ts tree/single=R star/tree=R store_egress_tree=B`
//! and whether the targets (tree/single <= 1.5, star/tree >= 8) are
//! met (informational). Exits non-zero when the scenario failed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use kt_bench::broadcast::{self, RunFiles};

/// Runs the broadcast benchmark scenario and summarizes it.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-broadcast")]
struct Args {
    /// The scenario file.
    #[arg(long, default_value = "testbed/bench/broadcast.yaml")]
    scenario: PathBuf,
    /// Where kt-scenario, kt, kt-store, kt-metadata and kt-agent are.
    #[arg(long, default_value = "target/release")]
    bin_dir: PathBuf,
    /// kt-scenario's report directory (report.json, the failure dump, and
    /// the run's snapshot holding its records).
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

/// Ok(false): the scenario failed (what it measured is still printed).
async fn run(args: &Args) -> anyhow::Result<bool> {
    let kt_scenario = args.bin_dir.join("kt-scenario");
    if !kt_scenario.is_file() {
        anyhow::bail!(
            "{} not found; build the release binaries first (make bench-broadcast does)",
            kt_scenario.display()
        );
    }
    let files = RunFiles::new(&args.report);
    files
        .clear()
        .with_context(|| format!("clearing {}", args.report.display()))?;
    let argv = broadcast::scenario_args(
        &args.scenario,
        &args.target,
        &files,
        &args.bin_dir,
        &args.scenario_args,
    );
    println!("$ {} {}", kt_scenario.display(), argv.join(" "));
    let started = Instant::now();
    let mut child = tokio::process::Command::new(&kt_scenario)
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
    match broadcast::results(scn, &records) {
        Ok(r) => {
            print!("{}", broadcast::table(&r));
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
            println!("{}", broadcast::final_line(&r));
        }
        Err(e) if !ok => println!("no results: {e:#}"),
        Err(e) => return Err(e),
    }
    if !ok {
        eprintln!(
            "kt-bench-broadcast: the scenario failed ({}): {}",
            status,
            scn.message.as_deref().unwrap_or("see the report")
        );
    }
    Ok(ok)
}
