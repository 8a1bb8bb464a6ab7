//! The `netns` target: like `local`, but the metadata server, the store and
//! every pod each live in a Linux network namespace of their own, plugged
//! by a veth pair into one bridge per run, so traffic crosses real
//! interfaces and a pod's link (and the store's, with `store.link`) can be
//! shaped with `tc`. Needs root.
//!
//! Layout of a run with short id `<id>` (see [`short_id`]), all in
//! 198.18.0.0/15 (the benchmarking range, never routed on the internet):
//!
//! | what     | namespace            | host-side veth   | address         |
//! |----------|----------------------|------------------|-----------------|
//! | runner   | (the root namespace) | (bridge `ktb<id>`) | 198.18.0.1/15 |
//! | metadata | `kt-<id>-meta`       | `ktv<id>0`       | 198.18.0.2:8081 |
//! | store    | `kt-<id>-store`      | `ktv<id>1`       | 198.18.0.3:8082 |
//! | pod *i*  | `kt-<id>-pod-<name>` | `ktv<id><i+2>` (base 36) | [`pod_ip`] |
//!
//! Inside each namespace the veth end is `eth0`. Pod namespaces carry a
//! `pod-` infix so that pods named `meta` or `store` cannot collide with the
//! servers'.
//!
//! What a run creates is recorded in `/run/kt-scenario/<id>` (the owning
//! pid); [`sweep_stale`] removes the leftovers of runs whose owner died
//! without cleaning up, and [`Target::up`] calls it first.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::process::Command;

use super::local::{
    Servers, agent_argv, agent_env, exec_argv, make_pod_dirs, pod_command, server_argvs,
};
use super::procs::{PodProcs, Server, binary};
use super::{Component, ExecOutput, ExecRequest, Plan, PodProcess, Target, TargetError};
use crate::format::Signal;

/// The host side of the bridge: the runner reaches the servers through it.
pub const BRIDGE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const METADATA_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const STORE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 3);
const SUBNET: &str = "198.18.0.0/15";
const PREFIX_LEN: u8 = 15;
const METADATA_PORT: u16 = 8081;
const STORE_PORT: u16 = 8082;
/// Every pod's node agent listens on this port of the pod's address.
const AGENT_PORT: u16 = 8090;
/// A Linux bridge has at most 1023 ports; the servers take two.
pub const MAX_PODS: usize = 1021;
/// Setup commands run at once.
const PARALLEL: usize = 16;

const STATE_DIR: &str = "/run/kt-scenario";
const NETNS_DIR: &str = "/run/netns";
const SYS_NET: &str = "/sys/class/net";

const NEED_ROOT: &str = "the netns target needs root (it creates network namespaces, a bridge \
                         and tc qdiscs); run as root or use --target local";

/// The 6-character id (`[0-9a-z]`) that names a run's network objects.
/// Hashed from the run id and the scenario, so runs whose ids share a prefix
/// (timestamps) and scenarios of one run still get distinct names.
pub fn short_id(run_id: &str, scenario: &str) -> String {
    let hash = blake3::hash(format!("{run_id}\0{scenario}").as_bytes());
    let n = hash.as_bytes()[..8]
        .iter()
        .fold(0u64, |a, b| a << 8 | u64::from(*b));
    format!("{:0>6}", base36(n % 36u64.pow(6)))
}

fn is_short_id(s: &str) -> bool {
    s.len() == 6
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
}

fn base36(mut n: u64) -> String {
    let mut digits = Vec::new();
    loop {
        digits.push(char::from_digit((n % 36) as u32, 36).unwrap_or('0'));
        n /= 36;
        if n == 0 {
            return digits.iter().rev().collect();
        }
    }
}

fn bridge_name(id: &str) -> String {
    format!("ktb{id}")
}

/// The host side of node `n`'s veth pair (≤ 11 characters for n < 1296).
fn veth_name(id: &str, n: usize) -> String {
    format!("ktv{id}{}", base36(n as u64))
}

/// The address of the `i`th pod: 198.18.1.1 to 198.18.1.250, then
/// 198.18.2.1, ... (250 a block, so no pod gets a .0 or .255 address);
/// None from [`MAX_PODS`] on.
pub fn pod_ip(i: usize) -> Option<Ipv4Addr> {
    let i = u32::try_from(i).ok().filter(|&i| (i as usize) < MAX_PODS)?;
    let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
    Some(Ipv4Addr::from(base + ((1 + i / 250) << 8) + 1 + i % 250))
}

/// The token bucket for a link of `rate_bps` bit/s, in bytes. tbf sends at
/// most one bucket per timer tick, so the bucket must hold a tick's worth of
/// traffic or the link tops out below its rate: rate/8/250 bytes covers
/// 4 ms (HZ=250, the coarsest common tick), e.g. 500 KB at 1 gbit. The
/// 32 KiB floor keeps low rates above a handful of MTU-sized frames and lets
/// GSO segments through unsplit; at 1 mbit it allows a ¼ s burst.
fn tbf_burst(rate_bps: u64) -> u64 {
    (rate_bps / 8 / 250).max(32 * 1024)
}

/// The qdisc spec of a shaped link. 50 ms of queue on top of the bucket
/// lets TCP fill the link without the latency of a deep (bufferbloated)
/// queue at low rates.
fn tbf(rate_bps: u64) -> String {
    format!(
        "tbf rate {rate_bps}bit burst {} latency 50ms",
        tbf_burst(rate_bps)
    )
}

/// One network namespace on the run's bridge.
#[derive(Debug, Clone)]
pub struct Node {
    pub netns: String,
    /// The host side of the veth pair; the namespace side is `eth0`.
    pub veth: String,
    pub ip: Ipv4Addr,
    /// Shaped in both directions when set (bit/s).
    pub link_bps: Option<u64>,
}

/// The namespaces, veths and bridge of one run. Plumbing only: no kt
/// processes, so it can be tested on its own.
#[derive(Debug)]
pub struct Network {
    id: String,
    /// Metadata, store, then the pods in order.
    nodes: Vec<Node>,
}

impl Network {
    /// Creates the bridge and a namespace per server and pod (`store_link`:
    /// the store's link rate; `pods`: name and link rate). On error, removes
    /// whatever it had created.
    pub fn create(
        id: &str,
        store_link: Option<u64>,
        pods: &[(String, Option<u64>)],
    ) -> Result<Network, TargetError> {
        let net = Network::layout(id, store_link, pods)?;
        check_subnet_free()?;
        claim(id)?;
        if let Err(e) = net.build() {
            if let Err(cleanup) = net.destroy() {
                tracing::warn!("cleaning up the half-created network {id}: {cleanup}");
            }
            return Err(e);
        }
        Ok(net)
    }

    /// The names, addresses and link rates of a run's nodes, checked;
    /// touches nothing on the host.
    fn layout(
        id: &str,
        store_link: Option<u64>,
        pods: &[(String, Option<u64>)],
    ) -> Result<Network, TargetError> {
        if !is_short_id(id) {
            return Err(TargetError::Failed(format!("`{id}` is not a netns run id")));
        }
        if pods.len() > MAX_PODS {
            return Err(TargetError::Failed(format!(
                "the netns target runs at most {MAX_PODS} pods (a Linux bridge has 1023 ports), \
                 this scenario has {}",
                pods.len()
            )));
        }
        let server = |n: usize, name: &str, ip, link_bps| Node {
            netns: format!("kt-{id}-{name}"),
            veth: veth_name(id, n),
            ip,
            link_bps,
        };
        // The metadata server's link is never shaped: its traffic is
        // control, not data.
        let mut nodes = vec![
            server(0, "meta", METADATA_IP, None),
            server(1, "store", STORE_IP, store_link),
        ];
        for (i, (name, link_bps)) in pods.iter().enumerate() {
            check_pod_name(name)?;
            nodes.push(Node {
                netns: format!("kt-{id}-pod-{name}"),
                veth: veth_name(id, i + 2),
                ip: pod_ip(i)
                    .ok_or_else(|| TargetError::Failed(format!("no address for pod {i}")))?,
                link_bps: *link_bps,
            });
        }
        Ok(Network {
            id: id.to_owned(),
            nodes,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn bridge(&self) -> String {
        bridge_name(&self.id)
    }

    pub fn metadata(&self) -> &Node {
        &self.nodes[0]
    }

    pub fn store(&self) -> &Node {
        &self.nodes[1]
    }

    pub fn pods(&self) -> &[Node] {
        &self.nodes[2..]
    }

    /// Kills what still runs in this run's namespaces, then removes them,
    /// the veths, the bridge, the FORWARD rule and the state file.
    /// Idempotent.
    pub fn destroy(&self) -> Result<(), TargetError> {
        remove_run(&self.id).map(drop)
    }

    fn build(&self) -> Result<(), TargetError> {
        let br = self.bridge();
        raise_host_limits(self.nodes.len());
        // The root namespace's part in one `ip` process: 1000 pods would
        // otherwise cost thousands of process starts. No interface gets an
        // IPv6 address (`addrgenmode none`): the testbed is IPv4, and the
        // address autoconfiguration of 1000 interfaces floods every port
        // with multicast.
        let mut root = vec![
            format!("link add {br} type bridge"),
            format!("addr add {BRIDGE_IP}/{PREFIX_LEN} dev {br}"),
            format!("link set {br} addrgenmode none up"),
        ];
        for n in &self.nodes {
            root.push(format!("netns add {}", n.netns));
            root.push(format!(
                "link add {} type veth peer name eth0 netns {}",
                n.veth, n.netns
            ));
            root.push(format!(
                "link set {} master {br} addrgenmode none up",
                n.veth
            ));
        }
        Cmd::batch(&["ip"], root).run()?;
        // Inside each namespace: lo, the address, and the upload shaping
        // (egress of eth0).
        let mut inside = Vec::new();
        for n in &self.nodes {
            let addr = format!("addr add {}/{PREFIX_LEN} dev eth0", n.ip);
            let lines = vec![
                "link set lo up".to_owned(),
                addr,
                "link set eth0 addrgenmode none up".to_owned(),
            ];
            inside.push(Cmd::batch(&["ip"], lines).inside(&n.netns));
        }
        for (netns, qdisc) in self.upload_shaping() {
            inside.push(Cmd::batch(&["tc"], vec![qdisc]).inside(&netns));
        }
        run_all(&inside)?;
        let shaped = self.download_shaping();
        if !shaped.is_empty() {
            Cmd::batch(&["tc"], shaped).run()?;
        }
        // Docker loads br_netfilter: bridged frames then traverse the
        // iptables FORWARD chain, whose policy Docker sets to DROP.
        let nf = std::fs::read_to_string("/proc/sys/net/bridge/bridge-nf-call-iptables");
        if nf.is_ok_and(|v| v.trim() == "1") {
            if on_path("iptables") {
                Cmd::new(&forward_rule("-I", &br)).run()?;
            } else {
                tracing::warn!("bridged traffic goes through iptables, which is not installed");
            }
        }
        Ok(())
    }
}

impl Network {
    /// The upload shaping of every shaped node: `tc` arguments for the
    /// egress of `eth0` inside its namespace, with the namespace.
    fn upload_shaping(&self) -> Vec<(String, String)> {
        (self.nodes.iter())
            .filter_map(|n| {
                let qdisc = format!("qdisc add dev eth0 root {}", tbf(n.link_bps?));
                Some((n.netns.clone(), qdisc))
            })
            .collect()
    }

    /// The download shaping of every shaped node: `tc` arguments for the
    /// egress of its host-side veth (run in the root namespace).
    fn download_shaping(&self) -> Vec<String> {
        (self.nodes.iter())
            .filter_map(|n| {
                Some(format!(
                    "qdisc add dev {} root {}",
                    n.veth,
                    tbf(n.link_bps?)
                ))
            })
            .collect()
    }
}

/// Pod names become namespace names (file names under /run/netns).
fn check_pod_name(name: &str) -> Result<(), TargetError> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 200 || !name.chars().all(ok) {
        return Err(TargetError::Failed(format!(
            "pod name `{name}` cannot name a network namespace (use letters, digits, '-', '_', '.')"
        )));
    }
    Ok(())
}

/// Two testbeds cannot share 198.18.0.0/15: their routes would clash.
fn check_subnet_free() -> Result<(), TargetError> {
    let used = Cmd::new(&["ip", "-o", "-4", "addr", "show", "to", SUBNET]).run()?;
    match used.lines().next() {
        None => Ok(()),
        Some(line) => Err(TargetError::Failed(format!(
            "{SUBNET} is already in use on this machine ({} has an address in it), probably by \
             another netns testbed (see {STATE_DIR}); the netns target runs one testbed at a time",
            line.split_whitespace().nth(1).unwrap_or("an interface")
        ))),
    }
}

/// Raises host-wide limits that a flat network of `namespaces` ports
/// outgrows (never lowers them, and leaves them raised: by then other users
/// of the host may rely on the value):
/// - the ARP table, shared by all namespaces, refuses entries beyond
///   `gc_thresh3` (1024 by default), and each server namespace alone caches
///   one per pod: 64 entries a namespace;
/// - every ARP broadcast is copied to every port at once, into a per-CPU
///   backlog of `netdev_max_backlog` (1000 by default) packets: with more
///   ports than that, broadcasts are dropped and pods fail with "No route to
///   host". Room for 8 broadcasts at once.
fn raise_host_limits(namespaces: usize) {
    let n = namespaces as u64;
    let limits = [
        ("net/ipv4/neigh/default/gc_thresh2", n * 32),
        ("net/ipv4/neigh/default/gc_thresh3", n * 64),
        ("net/core/netdev_max_backlog", n * 8),
    ];
    for (knob, want) in limits {
        let path = format!("/proc/sys/{knob}");
        let current = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        if current.is_some_and(|c| c < want) {
            match std::fs::write(&path, want.to_string()) {
                Ok(()) => tracing::info!("raised {} to {want}", knob.replace('/', ".")),
                Err(e) => tracing::warn!("could not raise {path} to {want}: {e}"),
            }
        }
    }
}

/// `iptables` arguments that insert (`-I`), check (`-C`) or delete (`-D`)
/// the rule accepting traffic between the ports of `bridge`.
fn forward_rule<'a>(op: &'a str, bridge: &'a str) -> [&'a str; 10] {
    [
        "iptables", "-w", op, "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT",
    ]
}

fn state_path(id: &str) -> PathBuf {
    Path::new(STATE_DIR).join(id)
}

/// Records in the state file that this process owns run `id`'s network
/// objects. The file appears complete and only if it did not exist (a link
/// of a finished temporary file), so a concurrent sweep never reads half of
/// it and two owners cannot claim one id.
fn claim(id: &str) -> Result<(), TargetError> {
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
fn remove_run(id: &str) -> Result<Vec<String>, TargetError> {
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

fn on_path(prog: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
}

/// An external command (`ip`, `tc`, `iptables`), optionally fed `lines` as
/// a `-batch -`. Its errors name the command line and carry its stderr and,
/// for a batch, the line that failed.
#[derive(Debug)]
struct Cmd {
    argv: Vec<String>,
    lines: Option<Vec<String>>,
}

type Started = (std::process::Child, std::io::Result<()>);

impl Cmd {
    fn new(argv: &[&str]) -> Cmd {
        let argv = argv.iter().map(|a| (*a).to_owned()).collect();
        Cmd { argv, lines: None }
    }

    /// `argv -batch -`, reading `lines`.
    fn batch(argv: &[&str], lines: Vec<String>) -> Cmd {
        let mut cmd = Cmd::new(argv);
        cmd.argv.extend(["-batch".to_owned(), "-".to_owned()]);
        cmd.lines = Some(lines);
        cmd
    }

    /// The command inside namespace `ns`. `nsenter` switches only the
    /// network namespace: several times cheaper than `ip -n`, which also
    /// remounts /sys.
    fn inside(mut self, ns: &str) -> Cmd {
        let enter = ["nsenter".to_owned(), format!("--net={NETNS_DIR}/{ns}")];
        self.argv.splice(0..0, enter);
        self
    }

    fn line(&self) -> String {
        self.argv.join(" ")
    }

    /// Runs the command and returns its stdout.
    fn run(&self) -> Result<String, TargetError> {
        self.spawn().and_then(|started| self.finish(started))
    }

    fn spawn(&self) -> Result<Started, TargetError> {
        let mut child = std::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(if self.lines.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(TargetError::io(format!("running `{}`", self.line())))?;
        // A failing batch stops reading: its status and stderr then say
        // more than the broken pipe, so `finish` looks at them first.
        let wrote = match (&self.lines, child.stdin.take()) {
            (Some(lines), Some(mut stdin)) => {
                stdin.write_all(format!("{}\n", lines.join("\n")).as_bytes())
            }
            _ => Ok(()),
        };
        Ok((child, wrote))
    }

    fn finish(&self, (child, wrote): Started) -> Result<String, TargetError> {
        let out = child
            .wait_with_output()
            .map_err(TargetError::io(format!("waiting for `{}`", self.line())))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // iproute2 names the line of a batch that failed: "Command failed -:<n>".
            let at = stderr.rsplit_once("Command failed -:").and_then(|(_, n)| {
                let n: usize = n.trim().parse().ok()?;
                self.lines.as_ref()?.get(n.checked_sub(1)?)
            });
            return Err(TargetError::Failed(format!(
                "`{}` failed ({}): {}{}",
                self.line(),
                out.status,
                stderr.trim(),
                at.map(|l| format!(" (at `{l}`)")).unwrap_or_default()
            )));
        }
        wrote.map_err(TargetError::io(format!("feeding `{}`", self.line())))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Runs `cmds`, [`PARALLEL`] at a time: namespace setup mostly waits on
/// the kernel, so this is several times faster than one by one.
fn run_all(cmds: &[Cmd]) -> Result<(), TargetError> {
    for chunk in cmds.chunks(PARALLEL) {
        let started: Vec<_> = chunk.iter().map(|c| (c, c.spawn())).collect();
        // Every started command is waited for before an error returns.
        let done: Vec<_> = started
            .into_iter()
            .map(|(c, s)| s.and_then(|s| c.finish(s)))
            .collect();
        done.into_iter().collect::<Result<Vec<_>, _>>()?;
    }
    Ok(())
}

/// Runs blocking network plumbing off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TargetError> + Send + 'static,
) -> Result<T, TargetError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| TargetError::Failed(format!("the network setup task failed: {e}")))?
}

/// `argv` run inside namespace `ns`.
fn in_netns(ns: &str, argv: Vec<String>) -> Vec<String> {
    ["ip", "netns", "exec", ns]
        .into_iter()
        .map(str::to_owned)
        .chain(argv)
        .collect()
}

#[derive(Debug)]
pub struct Netns {
    http: reqwest::Client,
    work: PathBuf,
    bin_kt: String,
    metadata_url: String,
    store_url: String,
    servers: Servers,
    /// Pod name → its agent's URL.
    agent_urls: HashMap<String, String>,
    net: Option<Network>,
    /// Pod name → its namespace and address.
    pods: HashMap<String, (String, Ipv4Addr)>,
    procs: PodProcs,
}

impl Default for Netns {
    fn default() -> Netns {
        Netns {
            // The servers are on a private subnet: never through a proxy.
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .unwrap_or_default(),
            work: PathBuf::new(),
            bin_kt: String::new(),
            metadata_url: String::new(),
            store_url: String::new(),
            servers: Default::default(),
            agent_urls: HashMap::new(),
            net: None,
            pods: HashMap::new(),
            procs: PodProcs::default(),
        }
    }
}

impl Netns {
    pub fn new() -> Netns {
        Netns::default()
    }

    async fn bring_up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.work = plan.work_dir.clone();
        self.bin_kt = binary(&plan.bin_dir, "kt")?;
        self.metadata_url = format!("http://{METADATA_IP}:{METADATA_PORT}");
        self.store_url = format!("http://{STORE_IP}:{STORE_PORT}");
        let (margv, sargv) = server_argvs(
            plan,
            &format!("{METADATA_IP}:{METADATA_PORT}"),
            &self.metadata_url,
            &format!("{STORE_IP}:{STORE_PORT}"),
            &self.store_url,
        )?;
        make_pod_dirs(plan)?;
        let id = short_id(&plan.run_id, &plan.scenario);
        tracing::info!(
            "netns testbed {id}: run {}, scenario {}",
            plan.run_id,
            plan.scenario
        );
        let pods: Vec<_> = plan
            .pods
            .iter()
            .map(|p| (p.name.clone(), p.link_bps))
            .collect();
        let store_link = plan.store_link_bps;
        let net = blocking(move || {
            for line in sweep_stale() {
                tracing::warn!("{line}");
            }
            Network::create(&id, store_link, &pods)
        })
        .await?;
        self.pods = (plan.pods.iter().zip(net.pods()))
            .map(|(p, n)| (p.name.clone(), (n.netns.clone(), n.ip)))
            .collect();
        let env = vec![("KT_TOKEN".to_owned(), plan.token.clone())];
        let logs = plan.work_dir.join("logs");
        self.servers.set(
            &Component::Metadata,
            Server::new(
                "metadata",
                in_netns(&net.metadata().netns, margv),
                env.clone(),
                logs.join("metadata.log"),
            ),
            self.metadata_url.clone(),
        );
        self.servers.set(
            &Component::Store,
            Server::new(
                "store",
                in_netns(&net.store().netns, sargv),
                env.clone(),
                logs.join("store.log"),
            ),
            self.store_url.clone(),
        );
        // Every pod's node agent, in the pod's namespace on its address.
        for (p, n) in plan.pods.iter().zip(net.pods()) {
            let url = format!("http://{}:{AGENT_PORT}", n.ip);
            let argv = agent_argv(
                plan,
                p,
                &format!("{}:{AGENT_PORT}", n.ip),
                &url,
                &self.metadata_url,
            )?;
            self.agent_urls.insert(p.name.clone(), url.clone());
            self.servers.set(
                &Component::Pod(p.name.clone()),
                Server::new(
                    &format!("agent-{}", p.name),
                    in_netns(&n.netns, argv),
                    agent_env(plan, p),
                    logs.join(format!("agent-{}.log", p.name)),
                ),
                url,
            );
        }
        self.net = Some(net);
        self.servers.start(&self.http, &Component::Metadata).await?;
        self.servers.start(&self.http, &Component::Store).await?;
        self.servers.start_pods(&self.http).await
    }
}

impl Netns {
    /// The command of an exec request, in its pod's namespace.
    fn command(&self, req: &ExecRequest) -> Result<Command, TargetError> {
        let (ns, ip) = (self.pods.get(&req.pod))
            .ok_or_else(|| TargetError::Failed(format!("no pod named {}", req.pod)))?;
        let argv = in_netns(ns, exec_argv(&self.bin_kt, req));
        Ok(pod_command(
            &argv,
            &self.pod_dir(&req.pod),
            req,
            &self.metadata_url,
            &ip.to_string(),
        ))
    }
}

#[async_trait]
impl Target for Netns {
    fn name(&self) -> &'static str {
        "netns"
    }

    fn unavailable(&self) -> Option<String> {
        if !rustix::process::geteuid().is_root() {
            return Some(NEED_ROOT.to_owned());
        }
        let needs = [
            ("ip", "iproute2"),
            ("tc", "iproute2"),
            ("nsenter", "util-linux"),
        ];
        let missing: Vec<String> = (needs.into_iter())
            .filter(|(prog, _)| !on_path(prog))
            .map(|(prog, package)| format!("`{prog}` ({package})"))
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "the netns target needs {}, not found on PATH; install it or use --target local",
                missing.join(" and ")
            )
        })
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        let result = self.bring_up(plan).await;
        if result.is_err()
            && let Err(e) = self.down().await
        {
            tracing::warn!("cleaning up after a failed netns start: {e}");
        }
        result
    }

    fn metadata_url(&self) -> String {
        self.metadata_url.clone()
    }

    fn component_url(&self, c: &Component) -> Option<String> {
        match c {
            Component::Metadata => Some(self.metadata_url.clone()),
            Component::Store => Some(self.store_url.clone()),
            Component::Pod(p) => self.agent_urls.get(p).cloned(),
        }
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.work.join("pods").join(pod)
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        let cmd = self.command(&req)?;
        self.procs.run(&req.pod, cmd).await
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        let cmd = self.command(&req)?;
        Ok(Box::new(self.procs.spawn(&req.pod, cmd)?))
    }

    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        self.pods
            .get(pod)
            .map(|(_, ip)| ip.to_string())
            .ok_or_else(|| TargetError::Failed(format!("no pod named {pod}")))
    }

    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        self.servers
            .kill(&Component::Pod(pod.to_owned()), signal)
            .await
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        self.servers.kill_with_pods(&self.procs, c, signal).await
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        self.servers.start(&self.http, c).await
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        self.servers.copy_logs(dir).await
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        self.procs.signal_all(Signal::KILL);
        // Servers first (a namespace lives on while a process is in it), but
        // the network goes even when stopping them failed.
        let stopped = self.servers.stop_all().await;
        if let Some(id) = self.net.as_ref().map(|n| n.id().to_owned()) {
            blocking(move || remove_run(&id)).await?;
            self.net = None;
        }
        stopped
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::{BufRead, BufReader, Read};

    use super::*;

    #[test]
    fn names_fit_the_interface_name_limit_and_are_distinct() {
        let id = short_id("20250101-120000", "transfer");
        assert!(is_short_id(&id), "{id}");
        assert_eq!(id, short_id("20250101-120000", "transfer"), "stable");
        assert_ne!(id, short_id("20250101-120000", "restart"));
        assert_ne!(id, short_id("20250101-120001", "transfer"));
        // Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
        assert!(bridge_name(&id).len() <= 15);
        let veths: HashSet<String> = (0..MAX_PODS + 2).map(|n| veth_name(&id, n)).collect();
        assert_eq!(veths.len(), MAX_PODS + 2);
        assert!(veths.iter().all(|v| v.len() <= 15), "{veths:?}");
        assert!(!veths.contains(&bridge_name(&id)));
        assert!(check_pod_name("getter-3").is_ok());
        for bad in ["", "a/b", "a b", "pod\n"] {
            assert!(check_pod_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pod_addresses_are_distinct_hosts_of_the_subnet() {
        let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
        let ips: Vec<Ipv4Addr> = (0..MAX_PODS).map_while(pod_ip).collect();
        assert_eq!(ips.len(), MAX_PODS);
        assert_eq!(ips[0], Ipv4Addr::new(198, 18, 1, 1));
        assert_eq!(pod_ip(MAX_PODS), None);
        let set: HashSet<_> = ips.iter().collect();
        assert_eq!(set.len(), MAX_PODS);
        for ip in &ips {
            assert_eq!(u32::from(*ip) >> 17, base >> 17, "{ip} is outside {SUBNET}");
            assert!(![BRIDGE_IP, METADATA_IP, STORE_IP].contains(ip));
            assert!(!matches!(ip.octets()[3], 0 | 255), "{ip}");
        }
    }

    #[test]
    fn token_buckets_hold_a_tick_of_traffic() {
        assert_eq!(tbf_burst(1_000_000), 32 * 1024);
        assert_eq!(tbf_burst(1_000_000_000), 500_000);
        for rate in [1_000, 1_000_000, 100_000_000, 1_000_000_000, 10_000_000_000] {
            // A 4 ms tick (HZ=250) of traffic fits in the bucket.
            assert!(tbf_burst(rate) * 8 * 250 >= rate, "{rate}");
        }
        assert_eq!(
            tbf(100_000_000),
            "tbf rate 100000000bit burst 50000 latency 50ms"
        );
    }

    #[test]
    fn too_many_pods_fail_before_touching_the_host() {
        let pods = vec![("p".to_owned(), None); MAX_PODS + 1];
        let err = Network::create("zzzzzz", None, &pods)
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most 1021 pods"), "{err}");
        let err = Network::create("no", None, &[]).unwrap_err().to_string();
        assert!(err.contains("not a netns run id"), "{err}");
    }

    #[test]
    fn shaped_nodes_get_tbf_both_ways() {
        let pods = [("a".to_owned(), None), ("b".to_owned(), Some(50_000_000))];
        let net = Network::layout("abc123", Some(1_000_000_000), &pods).unwrap();
        assert_eq!(net.store().link_bps, Some(1_000_000_000));
        assert_eq!(net.metadata().link_bps, None);
        let gbit = "tbf rate 1000000000bit burst 500000 latency 50ms";
        let mbit = "tbf rate 50000000bit burst 32768 latency 50ms";
        // Uploads: the egress of eth0 inside the store's and pod b's namespaces.
        assert_eq!(
            net.upload_shaping(),
            vec![
                (
                    "kt-abc123-store".to_owned(),
                    format!("qdisc add dev eth0 root {gbit}")
                ),
                (
                    "kt-abc123-pod-b".to_owned(),
                    format!("qdisc add dev eth0 root {mbit}")
                ),
            ]
        );
        // Downloads: the egress of their host-side veths (store = node 1,
        // pod b = node 3).
        assert_eq!(
            net.download_shaping(),
            vec![
                format!("qdisc add dev ktvabc1231 root {gbit}"),
                format!("qdisc add dev ktvabc1233 root {mbit}"),
            ]
        );
        // Unshaped by default: nothing for the store, as before.
        let net = Network::layout("abc123", None, &pods).unwrap();
        assert_eq!(net.store().link_bps, None);
        assert_eq!(net.upload_shaping().len(), 1);
        assert_eq!(
            net.download_shaping(),
            vec![format!("qdisc add dev ktvabc1233 root {mbit}")]
        );
    }

    /// Root tests share 198.18.0.0/15, so they run one at a time.
    static ROOT: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn root() -> Option<std::sync::MutexGuard<'static, ()>> {
        if !rustix::process::geteuid().is_root() {
            println!("skipped: needs root");
            return None;
        }
        let guard = ROOT.lock().unwrap_or_else(|e| e.into_inner());
        for line in sweep_stale() {
            println!("{line}");
        }
        Some(guard)
    }

    fn assert_gone(id: &str) {
        let netns = Cmd::new(&["ip", "netns", "list"]).run().unwrap();
        assert!(!netns.contains(&format!("kt-{id}-")), "{netns}");
        let links = Cmd::new(&["ip", "link", "show"]).run().unwrap();
        assert!(!links.contains(&format!("ktb{id}")), "{links}");
        assert!(!links.contains(&format!("ktv{id}")), "{links}");
        let br = bridge_name(id);
        assert!(Cmd::new(&forward_rule("-C", &br)).run().is_err());
        assert!(!state_path(id).exists());
    }

    /// Listens in `ns` on `ip:9000` and answers `hi` to `n` connections.
    fn listener(ns: &str, ip: Ipv4Addr, n: usize) -> std::process::Child {
        let script = "import socket, sys\n\
            s = socket.socket(); s.settimeout(20)\n\
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
            s.bind((sys.argv[1], 9000)); s.listen()\n\
            print('ready', flush=True)\n\
            for _ in range(int(sys.argv[2])):\n    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n";
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", ns, "python3", "-c", script])
            .args([ip.to_string(), n.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        child
    }

    #[test]
    fn a_network_connects_pods_shapes_links_and_goes_away() {
        let Some(_root) = root() else { return };
        let id = short_id(&format!("test-{}", std::process::id()), "network");
        let pods = [("a".to_owned(), None), ("b".to_owned(), Some(50_000_000))];
        let net = Network::create(&id, Some(200_000_000), &pods).unwrap();
        let (a, b) = (&net.pods()[0], &net.pods()[1]);
        assert_eq!((a.ip, b.ip), (pod_ip(0).unwrap(), pod_ip(1).unwrap()));

        if on_path("python3") {
            // Pod to pod crosses the bridge (and FORWARD, under Docker);
            // the runner reaches pods through the bridge address.
            let mut server = listener(&b.netns, b.ip, 2);
            let client = "import socket, sys\n\
                print(socket.create_connection((sys.argv[1], 9000), timeout=5).recv(2).decode())";
            let ip = b.ip.to_string();
            let out = Cmd::new(&["python3", "-c", client, &ip])
                .inside(&a.netns)
                .run()
                .unwrap();
            assert_eq!(out.trim(), "hi");
            let addr = std::net::SocketAddr::from((b.ip, 9000));
            let mut conn =
                std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5))
                    .unwrap();
            let mut got = String::new();
            conn.read_to_string(&mut got).unwrap();
            assert_eq!(got, "hi");
            assert!(server.wait().unwrap().success());
            println!("pod a -> pod b and root -> pod b: connected");
        } else {
            println!("no python3: connectivity not checked");
        }

        let down = Cmd::new(&["tc", "qdisc", "show", "dev", &b.veth])
            .run()
            .unwrap();
        let up = Cmd::new(&["tc", "-n", &b.netns, "qdisc", "show", "dev", "eth0"])
            .run()
            .unwrap();
        println!("{}\n{}", down.trim(), up.trim());
        assert!(down.contains("tbf") && down.contains("50Mbit"), "{down}");
        assert!(up.contains("tbf") && up.contains("50Mbit"), "{up}");
        let plain = Cmd::new(&["tc", "qdisc", "show", "dev", &a.veth])
            .run()
            .unwrap();
        assert!(!plain.contains("tbf"), "{plain}");
        // The store's link is shaped like a pod's; the metadata server's never.
        let store = net.store();
        let down = Cmd::new(&["tc", "qdisc", "show", "dev", &store.veth])
            .run()
            .unwrap();
        let up = Cmd::new(&["tc", "-n", &store.netns, "qdisc", "show", "dev", "eth0"])
            .run()
            .unwrap();
        assert!(down.contains("tbf") && down.contains("200Mbit"), "{down}");
        assert!(up.contains("tbf") && up.contains("200Mbit"), "{up}");
        let meta = Cmd::new(&["tc", "qdisc", "show", "dev", &net.metadata().veth])
            .run()
            .unwrap();
        assert!(!meta.contains("tbf"), "{meta}");

        net.destroy().unwrap();
        assert_gone(&id);
        net.destroy().unwrap();
    }

    #[test]
    fn the_sweep_removes_networks_of_dead_runners_only() {
        let Some(_root) = root() else { return };
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

    #[test]
    fn a_failed_create_leaves_nothing_behind() {
        let Some(_root) = root() else { return };
        let id = short_id(&format!("test-{}", std::process::id()), "failed");
        // Two pods with one name: the second namespace cannot be created.
        let pods = [("twin".to_owned(), None), ("twin".to_owned(), None)];
        let err = Network::create(&id, None, &pods).unwrap_err().to_string();
        println!("{err}");
        assert!(err.contains(&format!("kt-{id}-pod-twin")), "{err}");
        assert_gone(&id);
    }
}
