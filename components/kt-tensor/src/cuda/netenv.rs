//! NCCL's settings from the agent's environment: the pod's network for
//! NCCL's sockets, the `NCCL_*` settings a workload may pass to its agent
//! (an allow-list), and the ones kt cannot run with.
//!
//! NCCL reads its settings with `getenv` when it first bootstraps, in the
//! agent process (ranks) and in the unique-id helper (which inherits the
//! agent's environment). So [`prepare_nccl_env`] runs at the agent's start,
//! before any other thread exists: it pins `NCCL_SOCKET_IFNAME` to the
//! interface holding `KT_POD_IP` unless the operator set it (with Multus
//! secondary NICs, NCCL's own pick may be one that does not route between
//! pods), and drops `NCCL_*` variables outside [`WORKLOAD_NCCL_ENV`], a
//! network plugin named by a path and a log file ([`refused`]) with a
//! warning. [`check_comm_blocking`] refuses `NCCL_COMM_BLOCKING=1`, which
//! would make every NCCL call block and so disable every deadline kt puts
//! on a transfer; the backend asks it before it starts.

#![allow(unsafe_code)]

use std::net::IpAddr;

/// The `NCCL_*` settings the agent honours (others are dropped at its
/// start, with a warning). A workload passes them to its agent sidecar
/// (the `gpu-rdma` component's `kt-nccl` ConfigMap): which HCAs and GID,
/// which interface, traffic class and service level, GPUDirect RDMA and
/// P2P levels, the network plugin (a bare name only: [`refused`]),
/// logging to the agent's stderr (never `NCCL_DEBUG_FILE`), and
/// `NCCL_HOSTID` (pods sharing a node: see the README's GPU section).
/// The `gpu-rdma` component passes exactly these keys of `kt-nccl`
/// (testbed/k8s/components.py reads this list).
pub const WORKLOAD_NCCL_ENV: &[&str] = &[
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TC",
    "NCCL_IB_SL",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_DISABLE",
    "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_CROSS_NIC",
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_READ",
    "NCCL_P2P_LEVEL",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_SOCKET_FAMILY",
    "NCCL_SOCKET_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD",
    "NCCL_HOSTID",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
];

/// NCCL's network plugin: it loads `libnccl-net-<value>.so`, or the value
/// itself when it is a path.
pub const NET_PLUGIN: &str = "NCCL_NET_PLUGIN";

/// Where NCCL writes its log: a file of the value's name.
pub const DEBUG_FILE: &str = "NCCL_DEBUG_FILE";

/// Why an `NCCL_*` setting is refused whatever the allow-list says, if it
/// is: a network plugin named by a path (NCCL would load that library into
/// the agent, which holds IPC_LOCK, the HCA and the pod's token, from a
/// place such as the `/dev/shm` the workload writes) and a log file (NCCL
/// would write wherever the value says). Whoever may edit the `kt-nccl`
/// ConfigMap sets these, often more people than may change the pod.
pub fn refused(name: &str, value: &str) -> Option<String> {
    let bare = |v: &str| {
        !v.is_empty()
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    match name {
        NET_PLUGIN if !bare(value.trim()) => Some(format!(
            "{NET_PLUGIN}={value:?} is not a bare plugin name ([A-Za-z0-9_-]+, e.g. ib or \
             aws-ofi): NCCL would load it as a library path into the agent; ignored (install \
             the plugin in the agent's image and name it)"
        )),
        DEBUG_FILE => Some(format!(
            "{DEBUG_FILE} would make NCCL write its log to a file the setting names: ignored \
             (NCCL_DEBUG logs to the agent's stderr)"
        )),
        _ => None,
    }
}

/// The variable NCCL picks its socket interface by.
pub const SOCKET_IFNAME: &str = "NCCL_SOCKET_IFNAME";

/// How the agent's NCCL treats pods that share a node
/// ([`host_id`]): `p2p` or `separate`; unset, NCCL's own view.
pub const SAME_NODE_ENV: &str = kt_types::env::NCCL_SAME_NODE;

/// The node the agent's pod runs on (the downward API's `spec.nodeName`).
pub const NODE_NAME_ENV: &str = kt_types::env::NODE_NAME;

/// NCCL's host identity: ranks of one value are one host to it.
pub const HOST_ID: &str = "NCCL_HOSTID";

/// Makes every NCCL call block: refused.
pub const COMM_BLOCKING: &str = "NCCL_COMM_BLOCKING";

/// Why `NCCL_COMM_BLOCKING`'s value cannot be run with, if it cannot.
pub fn check_comm_blocking(value: Option<&str>) -> Result<(), String> {
    match value.map(str::trim) {
        Some("1") => Err(format!(
            "{COMM_BLOCKING}=1 makes every NCCL call block, which disables the deadline of every \
             transfer (a dead peer would hang the agent's transfers for good); unset it (kt runs \
             NCCL non-blocking and bounds every call itself)"
        )),
        _ => Ok(()),
    }
}

/// The interface (of `interfaces`: name and address) holding `pod_ip`:
/// NCCL's socket interface on the pod's network. `None` when none holds
/// it (a loopback address is never picked: NCCL would talk to nobody).
pub fn socket_ifname(pod_ip: IpAddr, interfaces: &[(String, IpAddr)]) -> Option<String> {
    if pod_ip.is_loopback() || pod_ip.is_unspecified() {
        return None;
    }
    interfaces
        .iter()
        .find(|(_, a)| *a == pod_ip)
        .map(|(name, _)| format!("={name}"))
}

/// A setting's value, trimmed; `None` when empty.
fn clean(v: Option<&str>) -> Option<&str> {
    v.map(str::trim).filter(|v| !v.is_empty())
}

/// NCCL's host identity (`NCCL_HOSTID`) for pods sharing a node, by
/// `KT_NCCL_SAME_NODE` (`same_node`):
/// - `p2p`: every agent of the node claims the node (`kt-node-<node>`),
///   so NCCL moves GPU data between pods of one node over P2P/NVLink (and
///   SHM) instead of the NIC. The operator must grant what that needs:
///   the pods share the host's IPC namespace (`hostIPC: true`, CUDA IPC
///   between processes of different pods) or at least one `/dev/shm`, and
///   the agents see each other's GPUs (a DRA claim shared by the pods, or
///   the node's GPUs). Without the node's name: nothing.
/// - `separate`: each pod is a host of its own (`kt-pod-<pod IP>`): for
///   `hostNetwork` pods, which NCCL would otherwise take for one host
///   (same hostname and boot id) and try SHM/P2P across separate
///   `/dev/shm`s and IPC namespaces.
///
/// `Ok(None)`: NCCL's own view (hostname and boot id: pods of one node
/// are different hosts, their traffic goes through the NIC). An operator's
/// `NCCL_HOSTID` is never overridden (the caller checks).
pub fn host_id(
    same_node: Option<&str>,
    node: Option<&str>,
    pod_ip: Option<&str>,
) -> Result<Option<String>, String> {
    match clean(same_node) {
        None => Ok(None),
        Some("p2p") => Ok(clean(node).map(|n| format!("kt-node-{n}"))),
        Some("separate") => Ok(clean(pod_ip).map(|ip| format!("kt-pod-{ip}"))),
        Some(other) => Err(format!(
            "{SAME_NODE_ENV}={other:?}: expected p2p (pods of a node share P2P/NVLink) or separate (each pod a host of its own)"
        )),
    }
}

/// What the agent's start does to the environment (pure: see
/// [`prepare_nccl_env`]): variables to set, variables to drop (and why),
/// from the current `vars`, `KT_POD_IP` and the interfaces.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NcclEnv {
    pub set: Vec<(String, String)>,
    pub drop: Vec<String>,
    /// Said once at the start (`tracing::info`/`warn`).
    pub notes: Vec<String>,
}

pub fn plan_nccl_env(
    vars: &[(String, String)],
    pod_ip: Option<&str>,
    interfaces: &[(String, IpAddr)],
) -> NcclEnv {
    let mut out = NcclEnv::default();
    let var = |name: &str| {
        vars.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if var(HOST_ID).is_none_or(|v| v.trim().is_empty()) {
        match host_id(var(SAME_NODE_ENV), var(NODE_NAME_ENV), pod_ip) {
            Ok(Some(id)) => {
                out.notes.push(format!(
                    "NCCL's host identity for pods sharing a node: {HOST_ID}={id}"
                ));
                out.set.push((HOST_ID.to_owned(), id));
            }
            Ok(None) => {}
            Err(e) => out.notes.push(format!("{e}: ignored")),
        }
    }
    for (k, v) in vars {
        if !k.starts_with("NCCL_") || k == COMM_BLOCKING {
            continue;
        }
        if let Some(why) = refused(k, v) {
            out.notes.push(why);
            out.drop.push(k.clone());
        } else if !WORKLOAD_NCCL_ENV.contains(&k.as_str()) {
            out.notes.push(format!(
                "{k} is not among the NCCL settings the agent honours (README, GPU section): ignored"
            ));
            out.drop.push(k.clone());
        }
    }
    if vars
        .iter()
        .any(|(k, v)| k == SOCKET_IFNAME && !v.trim().is_empty())
    {
        return out;
    }
    let Some(ip) = pod_ip.and_then(|p| p.trim().parse::<IpAddr>().ok()) else {
        return out;
    };
    match socket_ifname(ip, interfaces) {
        Some(name) => {
            out.notes.push(format!(
                "NCCL's sockets use the pod's interface: {SOCKET_IFNAME}{name}"
            ));
            out.set.push((SOCKET_IFNAME.to_owned(), name));
        }
        None => out.notes.push(format!(
            "no interface holds KT_POD_IP {ip}: NCCL picks its socket interface itself (set {SOCKET_IFNAME})"
        )),
    }
    out
}

/// This machine's interfaces and their addresses (`getifaddrs`).
pub fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, valid until freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: NUL-terminated name of a live node.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `ifa_addr` is non-null and its family says its layout.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if let Some(a) = addr {
            out.push((name, a));
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// Applies [`plan_nccl_env`] to this process's environment and returns
/// its notes.
///
/// # Safety
/// Changes the environment: call it before any other thread runs (first
/// thing in `main`, before an async runtime starts), as `set_var` says.
pub unsafe fn prepare_nccl_env(pod_ip: Option<&str>) -> Vec<String> {
    let vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k.starts_with("NCCL_") || k == SAME_NODE_ENV || k == NODE_NAME_ENV)
        .collect();
    let plan = plan_nccl_env(&vars, pod_ip, &interfaces());
    for k in &plan.drop {
        // SAFETY: the caller runs this while no other thread does.
        unsafe { std::env::remove_var(k) };
    }
    for (k, v) in &plan.set {
        // SAFETY: as above.
        unsafe { std::env::set_var(k, v) };
    }
    plan.notes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifaces() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "10.244.1.7"),
            ("net1", "192.168.50.3"),
            ("eth0", "fd00::7"),
        ]
        .iter()
        .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
        .collect()
    }

    #[test]
    fn the_pod_ips_interface_is_nccls_unless_the_operator_chose() {
        let i = ifaces();
        // Exact match (`=`): NCCL otherwise takes the name as a prefix.
        assert_eq!(
            socket_ifname("10.244.1.7".parse().unwrap(), &i),
            Some("=eth0".into())
        );
        assert_eq!(
            socket_ifname("192.168.50.3".parse().unwrap(), &i),
            Some("=net1".into())
        );
        assert_eq!(
            socket_ifname("fd00::7".parse().unwrap(), &i),
            Some("=eth0".into())
        );
        assert_eq!(socket_ifname("10.0.0.9".parse().unwrap(), &i), None);
        assert_eq!(socket_ifname("127.0.0.1".parse().unwrap(), &i), None);

        let plan = plan_nccl_env(&[], Some("10.244.1.7"), &i);
        assert_eq!(plan.set, [(SOCKET_IFNAME.to_owned(), "=eth0".to_owned())]);
        let set = [(SOCKET_IFNAME.to_owned(), "ib0".to_owned())];
        assert!(plan_nccl_env(&set, Some("10.244.1.7"), &i).set.is_empty());
        assert!(plan_nccl_env(&[], None, &i).set.is_empty());
        assert!(plan_nccl_env(&[], Some("not an ip"), &i).set.is_empty());
        let lost = plan_nccl_env(&[], Some("10.0.0.9"), &i);
        assert!(lost.set.is_empty());
        assert!(
            lost.notes[0].contains("no interface holds"),
            "{:?}",
            lost.notes
        );
    }

    #[test]
    fn only_allowed_nccl_settings_are_kept() {
        let vars: Vec<(String, String)> = [
            ("NCCL_IB_HCA", "mlx5_0"),
            ("NCCL_IB_GID_INDEX", "3"),
            ("NCCL_ALGO", "Ring"),
            ("NCCL_COMM_BLOCKING", "0"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let plan = plan_nccl_env(&vars, None, &[]);
        assert_eq!(plan.drop, ["NCCL_ALGO"]);
        assert!(plan.notes[0].contains("NCCL_ALGO"));
    }

    /// A plugin named by a path (a library NCCL would load into the agent)
    /// and a log file are dropped with a note; a bare plugin name stays.
    #[test]
    fn plugin_paths_and_log_files_are_refused() {
        let plan = |pairs: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            plan_nccl_env(&vars, None, &[])
        };
        let bad = plan(&[
            ("NCCL_NET_PLUGIN", "/dev/shm/x.so"),
            ("NCCL_DEBUG_FILE", "/x"),
        ]);
        assert_eq!(bad.drop, ["NCCL_NET_PLUGIN", "NCCL_DEBUG_FILE"]);
        assert!(
            bad.notes[0].contains("not a bare plugin name"),
            "{:?}",
            bad.notes
        );
        assert!(bad.notes[1].contains("NCCL_DEBUG_FILE"), "{:?}", bad.notes);
        for path in ["x.so", "../x", "", "ib ib"] {
            assert_eq!(plan(&[(NET_PLUGIN, path)]).drop, [NET_PLUGIN], "{path:?}");
        }
        for name in ["ib", "aws-ofi", "gIB_2"] {
            let ok = plan(&[(NET_PLUGIN, name), ("NCCL_DEBUG", "INFO")]);
            assert!(ok.drop.is_empty(), "{name}: {:?}", ok.notes);
        }
        assert!(!WORKLOAD_NCCL_ENV.contains(&DEBUG_FILE));
    }

    /// The planning part of pods sharing a node: one host identity per
    /// node (P2P/NVLink between them) or per pod (hostNetwork pods kept
    /// apart); an operator's `NCCL_HOSTID` stays.
    #[test]
    fn pods_sharing_a_node_get_the_host_identity_asked_for() {
        let ip = Some("10.244.1.7");
        assert_eq!(host_id(None, Some("n1"), ip), Ok(None));
        assert_eq!(
            host_id(Some("p2p"), Some("n1"), ip),
            Ok(Some("kt-node-n1".into()))
        );
        assert_eq!(host_id(Some("p2p"), None, ip), Ok(None));
        assert_eq!(
            host_id(Some("separate"), Some("n1"), ip),
            Ok(Some("kt-pod-10.244.1.7".into()))
        );
        assert!(host_id(Some("nvlink"), Some("n1"), ip).is_err());
        let vars = |extra: &[(&str, &str)]| -> Vec<(String, String)> {
            [(SAME_NODE_ENV, "p2p"), (NODE_NAME_ENV, "gpu-node-3")]
                .iter()
                .chain(extra)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // Two pods' agents on one node claim the same host.
        let a = plan_nccl_env(&vars(&[]), Some("10.244.1.7"), &[]);
        let b = plan_nccl_env(&vars(&[]), Some("10.244.1.8"), &[]);
        let id = |p: &NcclEnv| {
            p.set
                .iter()
                .find(|(k, _)| k == HOST_ID)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(id(&a), Some("kt-node-gpu-node-3".into()));
        assert_eq!(id(&a), id(&b));
        let mine = plan_nccl_env(&vars(&[(HOST_ID, "mine")]), Some("10.244.1.7"), &[]);
        assert_eq!(id(&mine), None);
    }

    #[test]
    fn blocking_communicators_are_refused() {
        let e = check_comm_blocking(Some("1")).unwrap_err();
        assert!(e.contains("NCCL_COMM_BLOCKING=1"), "{e}");
        check_comm_blocking(Some("0")).unwrap();
        check_comm_blocking(None).unwrap();
    }

    #[test]
    fn this_machine_lists_its_loopback() {
        let all = interfaces();
        assert!(
            all.iter().any(|(_, a)| a.is_loopback()),
            "getifaddrs found no loopback: {all:?}"
        );
    }
}
