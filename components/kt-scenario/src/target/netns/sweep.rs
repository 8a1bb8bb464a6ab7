//! What a run made, and its removal: the state file that records a run's
//! owner under /run/kt-scenario, the sweep of runs whose owner died, and the
//! teardown of a run's namespaces, veths, bridge and FORWARD rule.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::exec::{Cmd, NETNS_DIR, on_path};
use super::layout::{bridge_name, forward_rule, is_short_id};
use crate::target::TargetError;

pub(super) const STATE_DIR: &str = "/run/kt-scenario";
pub(super) const SYS_NET: &str = "/sys/class/net";

pub(super) fn state_path(id: &str) -> PathBuf {
    Path::new(STATE_DIR).join(id)
}

/// Records in the state file that this process owns run `id`'s network
/// objects. The file appears complete and only if it did not exist (a link
/// of a finished temporary file), so a concurrent sweep never reads half of
/// it and two owners cannot claim one id.
pub(super) fn claim(id: &str) -> Result<(), TargetError> {
    std::fs::create_dir_all(STATE_DIR).map_err(TargetError::io(format!("creating {STATE_DIR}")))?;
    let pid = std::process::id();
    let start = process_start(pid)
        .ok_or_else(|| TargetError::Failed(format!("cannot read /proc/{pid}/stat")))?;
    let tmp = Path::new(STATE_DIR).join(format!(".{id}.{pid}"));
    std::fs::write(&tmp, format!("{pid} {start}\n"))
        .map_err(TargetError::io(format!("writing {}", tmp.display())))?;
    let linked = std::fs::hard_link(&tmp, state_path(id));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(TargetError::Failed(format!(
                "a netns testbed with id {id} is already up ({})",
                state_path(id).display()
            )))
        }
        Err(e) => Err(TargetError::io(format!(
            "writing {}",
            state_path(id).display()
        ))(e)),
    }
}

/// The start time of process `pid` (field 22 of its stat), None when it is
/// gone or a zombie. With the pid it identifies a process across pid reuse.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether the process recorded in a state file still runs.
fn owner_alive(state: &Path) -> bool {
    let text = std::fs::read_to_string(state).unwrap_or_default();
    let mut it = text.split_whitespace().map(str::parse::<u64>);
    match (it.next(), it.next()) {
        (Some(Ok(pid)), Some(Ok(start))) => {
            u32::try_from(pid).ok().and_then(process_start) == Some(start)
        }
        _ => false,
    }
}

/// Removes the network objects of earlier runs whose runner died without
/// cleaning up (its recorded pid is gone). Returns one line per run it
/// removed or failed to remove, for the runner to log.
pub fn sweep_stale() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(STATE_DIR) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        if !is_short_id(&id) || owner_alive(&e.path()) {
            continue;
        }
        out.push(match remove_run(&id) {
            Ok(removed) => format!(
                "removed the netns testbed {id} of a runner that exited without cleaning up ({})",
                removed.join(", ")
            ),
            Err(e) => format!("could not remove the stale netns testbed {id}: {e}"),
        });
    }
    out
}

/// Names in `dir` (namespaces, interfaces) starting with `prefix`.
fn names_in(dir: &str, prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = (entries.flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

/// Everything of run `id` that exists now: veths, namespaces, the bridge.
fn run_objects(id: &str) -> (Vec<String>, Vec<String>, Vec<String>) {
    (
        names_in(SYS_NET, &format!("ktv{id}")),
        names_in(NETNS_DIR, &format!("kt-{id}-")),
        names_in(SYS_NET, &bridge_name(id)),
    )
}

/// Kills the processes in the namespaces `netns` (servers a killed runner
/// left behind, daemons a pod command started); returns how many. A process
/// is matched by the inode of its network namespace, on the nsfs device.
fn kill_processes_in(netns: &[String]) -> usize {
    use rustix::process::{Pid, Signal as Sig, kill_process};
    use std::os::unix::fs::MetadataExt;
    let Ok(nsfs) = std::fs::metadata("/proc/self/ns/net").map(|m| m.dev()) else {
        return 0;
    };
    let inodes: HashSet<u64> = (netns.iter())
        .filter_map(|n| std::fs::metadata(Path::new(NETNS_DIR).join(n)).ok())
        .filter(|m| m.dev() == nsfs)
        .map(|m| m.ino())
        .collect();
    if inodes.is_empty() {
        return 0;
    }
    let mut killed = 0;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = e
            .file_name()
            .to_str()
            .and_then(|p| p.parse().ok())
            .and_then(Pid::from_raw);
        let ns = std::fs::metadata(e.path().join("ns/net")).ok();
        if let (Some(pid), Some(ns)) = (pid, ns)
            && ns.dev() == nsfs
            && inodes.contains(&ns.ino())
            && kill_process(pid, Sig::KILL).is_ok()
        {
            killed += 1;
        }
    }
    killed
}

/// Waits while the kernel tears deleted namespaces down (asynchronously:
/// about 3 s for 1000), until their veths are gone or none went for a
/// second (something still holds the namespace).
fn await_teardown(id: &str) {
    let veths = || names_in(SYS_NET, &format!("ktv{id}")).len();
    let (mut left, mut progress) = (veths(), Instant::now());
    while left > 0 && progress.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
        let now = veths();
        if now < left {
            progress = Instant::now();
        }
        left = now;
    }
}

/// Removes whatever exists of run `id`, checks that nothing is left, then
/// drops its state file. Returns a summary of what it removed.
pub(super) fn remove_run(id: &str) -> Result<Vec<String>, TargetError> {
    let mut removed = Vec::new();
    let mut failed = None;
    let netns = names_in(NETNS_DIR, &format!("kt-{id}-"));
    let killed = kill_processes_in(&netns);
    if killed > 0 {
        removed.push(format!("{killed} process(es)"));
    }
    // Deleting the namespaces deletes their veths in one kernel pass, much
    // faster than deleting 1000 veths one by one.
    if !netns.is_empty() {
        let lines = netns.iter().map(|n| format!("netns del {n}")).collect();
        failed = Cmd::batch(&["ip", "-force"], lines).run().err();
        removed.push(format!("{} namespaces", netns.len()));
    }
    await_teardown(id);
    // Veths whose namespace something still holds, and the bridge.
    let (veths, _, bridges) = run_objects(id);
    let lines: Vec<String> = veths
        .iter()
        .chain(&bridges)
        .map(|l| format!("link del {l}"))
        .collect();
    if !lines.is_empty() {
        failed = failed.or(Cmd::batch(&["ip", "-force"], lines).run().err());
    }
    removed.extend(bridges.iter().map(|b| format!("bridge {b}")));
    if on_path("iptables") {
        let br = bridge_name(id);
        // Bounded: a rule inserted twice (never by us) is deleted twice.
        for _ in 0..8 {
            if Cmd::new(&forward_rule("-C", &br)).run().is_err() {
                break;
            }
            Cmd::new(&forward_rule("-D", &br)).run()?;
            removed.push("iptables FORWARD rule".to_owned());
        }
    }
    let (veths, netns, bridges) = run_objects(id);
    let left = [veths, netns, bridges].concat();
    if !left.is_empty() {
        return Err(TargetError::Failed(format!(
            "could not remove {}{}",
            left.join(", "),
            failed.map(|e| format!(": {e}")).unwrap_or_default()
        )));
    }
    match std::fs::remove_file(state_path(id)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TargetError::io(format!(
            "removing {}",
            state_path(id).display()
        ))(e)),
        _ => Ok(removed),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    use super::*;
    use crate::target::netns::layout::{Network, short_id};
    use crate::target::netns::testing::{assert_gone, root};

    #[test]
    #[cfg_attr(kt_unprivileged_build, ignore = "skipping: needs root")]
    fn the_sweep_removes_networks_of_dead_runners_only() {
        let _root = root();
        let id = short_id(&format!("test-{}", std::process::id()), "sweep");
        let net = Network::create(&id, None, &[("p".to_owned(), None)]).unwrap();
        assert!(sweep_stale().is_empty(), "a live runner's network is kept");
        assert!(Path::new(SYS_NET).join(net.bridge()).exists());
        // A runner killed with SIGKILL: its pid is gone, a server it
        // started still runs in its namespace.
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        dead.wait().unwrap();
        std::fs::write(state_path(&id), format!("{} 1\n", dead.id())).unwrap();
        let mut orphan = std::process::Command::new("ip")
            .args(["netns", "exec", &net.pods()[0].netns])
            .args(["sh", "-c", "echo ready; exec sleep 60"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(orphan.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let swept = sweep_stale();
        println!("{swept:?}");
        assert_eq!(swept.len(), 1);
        assert!(
            swept[0].contains(&format!("removed the netns testbed {id}")),
            "{swept:?}"
        );
        assert!(swept[0].contains("1 process(es)"), "{swept:?}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(orphan.wait().unwrap().signal(), Some(9));
        assert_gone(&id);
        net.destroy().unwrap();
    }
}
