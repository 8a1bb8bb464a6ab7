//! CPU time spent by this process, its reaped children and another process
//! (with its reaped children), for CPU-seconds-per-GiB figures.
//!
//! kt runs in this process in the rsync comparison (client, store and
//! metadata server), so `getrusage(RUSAGE_SELF)` taken around a kt step is
//! what that step cost kt. rsync runs as a client child of this process and
//! a daemon that forks a child per connection and reaps it: its cost is our
//! `RUSAGE_CHILDREN` plus the daemon's own and reaped children's times from
//! `/proc/<pid>/stat`.

use std::time::Duration;

fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64)
}

#[allow(unsafe_code)]
fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: getrusage writes a plain struct we own; an error leaves it zeroed.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    timeval(ru.ru_utime) + timeval(ru.ru_stime)
}

/// User plus system time of every thread of this process so far.
pub fn self_time() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

/// User plus system time of this process's children that were waited for.
pub fn children_time() -> Duration {
    rusage(libc::RUSAGE_CHILDREN)
}

/// User plus system time of process `pid` and of its children it waited
/// for (`/proc/<pid>/stat` fields 14–17); `None` when it cannot be read.
pub fn process_tree_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_times(&stat, clock_ticks())
}

#[allow(unsafe_code)]
fn clock_ticks() -> u64 {
    // SAFETY: sysconf only reads a constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as u64 } else { 100 }
}

/// utime + stime + cutime + cstime of a `/proc/<pid>/stat` line, in `hz` ticks.
fn parse_stat_times(stat: &str, hz: u64) -> Option<Duration> {
    // The command (field 2) may hold spaces and parentheses: fields are
    // counted after its last `)`, which leaves field 3 (state) first.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// CPU seconds per GiB moved (NaN when nothing moved).
pub fn secs_per_gib(cpu_secs: f64, bytes: u64) -> f64 {
    if bytes == 0 {
        return f64::NAN;
    }
    cpu_secs / (bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_times_are_summed_after_the_command() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
        // majflt cmajflt utime stime cutime cstime ...
        let line = "42 (rsync (x) y) S 1 42 42 0 -1 4194560 10 20 0 0 150 50 30 20 20 0";
        assert_eq!(
            parse_stat_times(line, 100),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(parse_stat_times("42 (short) S 1", 100), None);
    }

    /// Spinning until getrusage counts 50 ms of CPU (however long a busy
    /// machine makes that take); `/proc`'s tick-granular figure for this
    /// process then holds at least that much too.
    #[test]
    fn this_process_burns_measurable_time() {
        let before = self_time();
        let want = before + Duration::from_millis(50);
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let mut x = 0u64;
        while self_time() < want {
            assert!(
                std::time::Instant::now() < deadline,
                "no 50 ms of CPU in 2 minutes"
            );
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        let me = process_tree_time(std::process::id()).expect("own /proc stat");
        assert!(me >= Duration::from_millis(40), "{me:?} ({x})");
    }

    #[test]
    fn per_gib() {
        assert_eq!(secs_per_gib(2.0, 1 << 30), 2.0);
        assert_eq!(secs_per_gib(1.0, 512 << 20), 2.0);
        assert!(secs_per_gib(1.0, 0).is_nan());
    }
}
