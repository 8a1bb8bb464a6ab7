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
//!
//! This module is the [`Target`]; `layout` has the network (names,
//! addresses, bridge, veths, `tc` shaping), `sweep` the state file and the
//! removal of a run, `exec` the `ip`/`tc`/`iptables` commands and the
//! commands run inside namespaces.
//!
//! # Tests that need root
//!
//! Three tests create network namespaces, a bridge and qdiscs, so they need
//! root. CI runs as root and must run them; anywhere else they must show as
//! skipped, never as a pass of a test that did not run. Neither libtest nor
//! nextest can skip a test once it runs (a test passes or fails), so the
//! decision is made when the test binary is built: build.rs sets the cfg
//! `kt_unprivileged_build` when the build does not run as root, and each
//! root-only test carries
//!
//! ```text
//! #[cfg_attr(kt_unprivileged_build, ignore = "skipping: needs root")]
//! ```
//!
//! so a non-root `cargo nextest run` counts it as skipped (`cargo test`
//! prints `ignored, skipping: needs root`), and a root build runs it.
//! build.rs runs again when the user changes (`USER`, `LOGNAME`,
//! `SUDO_UID`). A binary built by one user and run by another cannot pass
//! unrun either: built as root and run by another user, `testing::root`
//! fails the test; built by another user and run as root, the test
//! `a_build_that_skips_root_tests_does_not_run_as_root` (only in such a
//! build) fails. `--run-ignored all` runs them anyway, and `testing::root`
//! then fails them when not root.
//!
//! The fallback (fail when not root unless `KT_SKIP_ROOT_TESTS=1`, and then
//! pass) was not needed, and would report a pass for an unrun test.

use std::collections::HashMap;

use async_trait::async_trait;

use super::nodes::{NodeAddrs, pod_name};
use super::process::{At, Place, Placed, Processes};
use super::procs::free_port;
use super::{Component, Plan, TargetError};
use crate::datasets::NodesSpec;

mod exec;
mod layout;
mod sweep;
#[cfg(test)]
mod testing;

use exec::{Cmd, blocking, in_netns, on_path};
use layout::{AGENT_PORT, METADATA_PORT, STORE_PORT};
pub use layout::{BRIDGE_IP, MAX_PODS, METADATA_IP, Network, Node, STORE_IP, pod_ip, short_id};
use sweep::remove_run;
pub use sweep::sweep_stale;

const NEED_ROOT: &str = "the netns target needs root (it creates network namespaces, a bridge \
                         and tc qdiscs); run as root or use --target local";

/// Where the netns target's components go: each in a network namespace
/// of its own, plugged into the run's bridge.
#[derive(Debug, Default)]
pub struct Namespaces {
    net: Option<Network>,
}

/// The `netns` target.
pub type Netns = Processes<Namespaces>;

#[async_trait]
impl Place for Namespaces {
    const NAME: &'static str = "netns";

    fn http() -> reqwest::Client {
        // The servers are on a private subnet: never through a proxy.
        kt_api::client_builder().build().unwrap_or_default()
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

    /// The run's network: the servers' namespaces, the pods' and then the
    /// nodes' agents' (each in a namespace of its own).
    async fn place(&mut self, plan: &Plan) -> Result<Placed, TargetError> {
        let id = short_id(&plan.run_id, &plan.scenario);
        tracing::info!(
            "netns testbed {id}: run {}, scenario {}",
            plan.run_id,
            plan.scenario
        );
        let mut pods: Vec<_> = plan
            .pods
            .iter()
            .map(|p| (p.name.clone(), p.link_bps))
            .collect();
        let node_names = plan.nodes.as_ref().map(|n| n.names()).unwrap_or_default();
        pods.extend(node_names.iter().map(|n| (pod_name(n), None)));
        let store_link = plan.store_link_bps;
        let net = blocking(move || {
            for line in sweep_stale() {
                tracing::warn!("{line}");
            }
            Network::create(&id, store_link, &pods)
        })
        .await?;
        let at = |n: &Node, port| At {
            ip: n.ip,
            port,
            prefix: in_netns(&n.netns, Vec::new()),
        };
        let placed = Placed {
            metadata: at(net.metadata(), METADATA_PORT),
            store: at(net.store(), STORE_PORT),
            pods: (net.pods().iter().take(plan.pods.len()))
                .map(|n| at(n, AGENT_PORT))
                .collect(),
        };
        self.net = Some(net);
        Ok(placed)
    }

    /// The nodes' agents in their namespaces (after the pods'), the
    /// controller on loopback.
    fn node_addrs(&self, _: &NodesSpec, pods: usize) -> Result<NodeAddrs, TargetError> {
        let agents = (self.net.iter())
            .flat_map(|net| net.pods().iter().skip(pods))
            .map(|n| (n.ip, AGENT_PORT, in_netns(&n.netns, Vec::new())))
            .collect();
        let local = std::net::Ipv4Addr::LOCALHOST;
        Ok(NodeAddrs {
            agents,
            controller: (local, free_port(std::net::IpAddr::V4(local))?),
        })
    }

    fn cuts_links(&self) -> bool {
        true
    }

    /// The host side of the node's veth goes down: the bridge no longer
    /// forwards to or from it, and its `eth0` loses carrier (its routes
    /// stay, so its sockets retry rather than fail). Up again, it is a
    /// bridge port as before, with its shaping.
    async fn set_link(
        &self,
        c: &Component,
        pods: &HashMap<String, At>,
        up: bool,
    ) -> Result<(), TargetError> {
        let net = self
            .net
            .as_ref()
            .ok_or_else(|| TargetError::Failed("the netns network is not up".into()))?;
        let node = match c {
            Component::Metadata => net.metadata(),
            Component::Store => net.store(),
            Component::Pod(p) => {
                let ip = pods
                    .get(p)
                    .ok_or_else(|| TargetError::Failed(format!("no pod named {p}")))?
                    .ip;
                net.pods()
                    .iter()
                    .find(|n| n.ip == ip)
                    .ok_or_else(|| TargetError::Failed(format!("no namespace for pod {p}")))?
            }
        };
        let veth = node.veth.clone();
        let state = if up { "up" } else { "down" };
        blocking(move || {
            Cmd::new(&["ip", "link", "set", &veth, state])
                .run()
                .map(drop)
        })
        .await
    }

    async fn remove(&mut self) -> Result<(), TargetError> {
        if let Some(id) = self.net.as_ref().map(|n| n.id().to_owned()) {
            blocking(move || remove_run(&id)).await?;
            self.net = None;
        }
        Ok(())
    }
}
