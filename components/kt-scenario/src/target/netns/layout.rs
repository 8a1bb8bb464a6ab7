//! The network of a run: its nodes' names and addresses, the bridge and
//! the veth pairs that plug each namespace into it, and the `tc` shaping
//! of links.

use std::net::Ipv4Addr;

use super::exec::{Cmd, on_path, run_all};
use super::sweep::{STATE_DIR, claim, remove_run};
use crate::target::TargetError;

/// The host side of the bridge: the runner reaches the servers through it.
pub const BRIDGE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const METADATA_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const STORE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 3);
const SUBNET: &str = "198.18.0.0/15";
const PREFIX_LEN: u8 = 15;
pub(super) const METADATA_PORT: u16 = 8081;
pub(super) const STORE_PORT: u16 = 8082;
/// Every pod's node agent listens on this port of the pod's address.
pub(super) const AGENT_PORT: u16 = 8090;
/// A Linux bridge has at most 1023 ports; the servers take two.
pub const MAX_PODS: usize = 1021;

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

pub(super) fn is_short_id(s: &str) -> bool {
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

pub(super) fn bridge_name(id: &str) -> String {
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
        crate::target::host::raise_limits(self.nodes.len());
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

/// `iptables` arguments that insert (`-I`), check (`-C`) or delete (`-D`)
/// the rule accepting traffic between the ports of `bridge`.
pub(super) fn forward_rule<'a>(op: &'a str, bridge: &'a str) -> [&'a str; 10] {
    [
        "iptables", "-w", op, "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT",
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;

    use super::*;
    use crate::target::netns::testing::{assert_gone, root};

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
    #[cfg_attr(kt_unprivileged_build, ignore = "skipping: needs root")]
    fn a_network_connects_pods_shapes_links_and_goes_away() {
        let _root = root();
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
    #[cfg_attr(kt_unprivileged_build, ignore = "skipping: needs root")]
    fn a_failed_create_leaves_nothing_behind() {
        let _root = root();
        let id = short_id(&format!("test-{}", std::process::id()), "failed");
        // Two pods with one name: the second namespace cannot be created.
        let pods = [("twin".to_owned(), None), ("twin".to_owned(), None)];
        let err = Network::create(&id, None, &pods).unwrap_err().to_string();
        println!("{err}");
        assert!(err.contains(&format!("kt-{id}-pod-twin")), "{err}");
        assert_gone(&id);
    }
}
