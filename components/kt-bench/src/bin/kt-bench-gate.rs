//! `kt-bench-gate` (`make bench-gate`): runs the kt-vs-rsync comparison a
//! few times, takes each case's median kt/rsync ratio and fails (exit 1)
//! when one is worse than the committed baseline by more than its margin
//! (`kt_bench::gate`). `--accept` records the run as the new baseline of
//! its profile instead.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kt_bench::gate::{self, Baseline, Measured, Profile};
use kt_bench::{compare, report};

/// The kt-vs-rsync ratios held against a committed baseline.
#[derive(Debug, Parser)]
#[command(name = "kt-bench-gate")]
struct Args {
    /// What to measure: `quick` (2,000 files, 128 MiB, for CI) or `full`
    /// (10,000 files, 1 GiB, 5 runs per case).
    #[arg(long, value_enum, default_value = "full")]
    profile: Profile,
    /// The baseline file.
    #[arg(long, default_value = gate::BASELINE)]
    baseline: PathBuf,
    /// Invocations of the whole comparison (fresh data and servers each);
    /// the gate holds the median of their ratios.
    #[arg(long, default_value_t = 3)]
    invocations: usize,
    /// Where the work directories go (tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// Record this run's medians as the profile's baseline (and the
    /// command line that made them) instead of judging them.
    #[arg(long)]
    accept: bool,
    /// With --accept: the profile's margin (else the one it had).
    #[arg(long)]
    margin: Option<f64>,
    /// What to judge: time and CPU ratios (`both`), or one of them. On a
    /// machine busy with other work the time ratios move (kt's threads
    /// wait for cores); the CPU ratios hardly do: `cpu` there.
    #[arg(long, value_enum, default_value = "both")]
    judge: Judge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Judge {
    Both,
    Time,
    Cpu,
}

impl Judge {
    fn wants(self, case: &str) -> bool {
        let cpu = case.ends_with(gate::CPU_SUFFIX);
        match self {
            Judge::Both => true,
            Judge::Time => !cpu,
            Judge::Cpu => cpu,
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kt-bench-gate: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kt-bench-gate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<bool> {
    anyhow::ensure!(args.invocations >= 1, "--invocations must be at least 1");
    let mut baseline = if args.accept && !args.baseline.exists() {
        Baseline::default()
    } else {
        Baseline::load(&args.baseline)?
    };
    let opts = args.profile.options(args.dir.clone());
    let mut measured = Measured::new();
    let mut cpu_lines = Vec::new();
    for i in 1..=args.invocations {
        eprintln!(
            "[kt-bench-gate] invocation {i} of {} (profile {})",
            args.invocations,
            args.profile.name()
        );
        let results = tokio::select! {
            r = compare::run(&opts) => r?,
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
        };
        print!("{}", report::table(&results));
        println!("{}", report::ratio_line(&results));
        cpu_lines.push(report::cpu_line(&results));
        gate::add_invocation(&mut measured, &results);
    }
    for line in cpu_lines.iter().filter(|l| !l.is_empty()) {
        println!("{line}");
    }
    if args.accept {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        let when = format!("{} (load: {})", utc_now(), loadavg());
        gate::accept(
            &mut baseline,
            args.profile,
            &measured,
            &command,
            &when,
            args.margin,
        );
        baseline.save(&args.baseline)?;
        println!(
            "recorded profile {} in {}",
            args.profile.name(),
            args.baseline.display()
        );
        return Ok(true);
    }
    let profile = baseline.profiles.get(args.profile.name()).ok_or_else(|| {
        anyhow::anyhow!(
            "{} has no profile {:?}: record one with --accept",
            args.baseline.display(),
            args.profile.name()
        )
    })?;
    let mut profile = profile.clone();
    profile.cases.retain(|case, _| args.judge.wants(case));
    measured.retain(|case, _| args.judge.wants(case));
    let verdicts = gate::judge(&profile, &measured);
    println!(
        "gate (profile {}, median of {} invocations; baseline by `{}`):",
        args.profile.name(),
        args.invocations,
        profile.command
    );
    print!("{}", gate::table(&verdicts));
    let ok = gate::passed(&verdicts);
    println!(
        "{}",
        if ok {
            "bench-gate: passed"
        } else {
            "bench-gate: FAILED (a ratio is worse than its baseline by more than the margin)"
        }
    );
    Ok(ok)
}

/// The 1-minute load average, for the record of when a baseline was made.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

fn utc_now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
