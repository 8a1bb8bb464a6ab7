//! The agent's gauges, read at each scrape: what it exports (origin copies
//! of `locale=local` puts, downloaded copies it serves), tensor sets
//! registered and the bytes they lend (host memory is shared memory), read
//! leases open, heartbeats. Labels: `kind` and `device` (bounded); never a
//! key or the pod's name (Prometheus adds the target's own labels).

use std::sync::Weak;
use std::sync::atomic::Ordering;

use kt_service::metrics::{Collect, Snapshot};
use kt_service::reads::Reads;
use kt_types::tensor::Device;

use crate::exports::Exports;
use crate::heartbeat::BeatStats;
use crate::tensors::Tensors;

/// The agent's state, held weakly (the read state holds the metrics that
/// hold this).
pub struct AgentGauges {
    pub exports: Weak<Exports>,
    pub reads: Weak<Reads<std::sync::Arc<Exports>>>,
    pub tensors: Weak<Tensors>,
    pub heartbeats: Weak<BeatStats>,
}

impl std::fmt::Debug for AgentGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentGauges").finish_non_exhaustive()
    }
}

impl AgentGauges {
    fn snapshot(&self) -> Snapshot {
        let mut snap = Snapshot::default();
        if let Some(exports) = self.exports.upgrade() {
            const EXPORTS: &str =
                "Keys this agent serves, by kind (origin: a locale=local put; copy: a download)";
            const BYTES: &str = "Bytes of the keys this agent serves, by kind";
            let (mut origin, mut copy) = ((0u64, 0u64), (0u64, 0u64));
            for e in exports.all() {
                let c = if e.origin { &mut origin } else { &mut copy };
                c.0 += 1;
                c.1 += e.manifest.total_bytes();
            }
            for (kind, (n, bytes)) in [("origin", origin), ("copy", copy)] {
                snap.gauge("agent_exports", EXPORTS, &[("kind", kind)], n as f64);
                snap.gauge("agent_export_bytes", BYTES, &[("kind", kind)], bytes as f64);
            }
        }
        if let Some(tensors) = self.tensors.upgrade() {
            const SETS: &str = "Tensor sets registered with this agent, by device";
            const LENT: &str =
                "Bytes of the registered tensor sets, by device (cpu: shared memory)";
            let (mut cpu, mut cuda) = ((0u64, 0u64), (0u64, 0u64));
            for r in tensors.registrations() {
                let c = match r.device {
                    Device::Cpu => &mut cpu,
                    Device::Cuda(_) => &mut cuda,
                };
                c.0 += 1;
                c.1 += r.bytes;
            }
            for (device, (n, bytes)) in [("cpu", cpu), ("cuda", cuda)] {
                snap.gauge(
                    "agent_tensor_registrations",
                    SETS,
                    &[("device", device)],
                    n as f64,
                );
                snap.gauge(
                    "agent_tensor_bytes",
                    LENT,
                    &[("device", device)],
                    bytes as f64,
                );
            }
        }
        if let Some(reads) = self.reads.upgrade() {
            snap.gauge(
                "read_leases",
                "Read leases open on this server (getters reading from it)",
                &[],
                reads.open_leases() as f64,
            );
        }
        if let Some(beats) = self.heartbeats.upgrade() {
            const BEATS: &str = "Heartbeats to the metadata server, by outcome";
            for (outcome, n) in [
                ("ok", beats.ok.load(Ordering::Relaxed)),
                ("failed", beats.failed.load(Ordering::Relaxed)),
            ] {
                snap.counter("agent_heartbeats", BEATS, &[("outcome", outcome)], n as f64);
            }
        }
        snap
    }
}

impl Collect for AgentGauges {
    fn collect(&self) -> std::pin::Pin<Box<dyn Future<Output = Snapshot> + Send + '_>> {
        let snap = self.snapshot();
        Box::pin(async move { snap })
    }
}
