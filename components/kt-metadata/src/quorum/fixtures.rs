//! What the tests of rounds and of the coordinator join with.

use kt_types::tensor::{
    BackendKind, DType, QuorumJoin, QuorumKey, QuorumRole, TensorDesc, TensorMeta,
};
use kt_types::{BroadcastWindow, Key};

pub(super) fn key(k: &str, len: u64) -> QuorumKey {
    QuorumKey {
        from: None,
        key: Key::parse(k).unwrap(),
        version: format!("v-{k}"),
        tensors: vec![TensorDesc {
            name: "w".into(),
            meta: TensorMeta::new(DType::F32, [len]),
        }],
    }
}

pub(super) fn window(world: Option<u32>, secs: f64) -> BroadcastWindow {
    BroadcastWindow {
        world_size: world,
        timeout_secs: Some(secs),
        fanout: 2,
        ..BroadcastWindow::default()
    }
}

pub(super) fn putter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
    member(agent, QuorumRole::Put { keys }, w)
}

pub(super) fn getter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
    member(agent, QuorumRole::Get { keys }, w)
}

/// Agent `aN` has IP 10.0.0.N (N defaults to 99).
fn member(agent: &str, role: QuorumRole, w: &BroadcastWindow) -> QuorumJoin {
    let n: u32 = agent
        .trim_start_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or(99);
    let ip = format!("10.0.0.{n}");
    QuorumJoin {
        member: String::new(),
        node: String::new(),
        agent: agent.into(),
        endpoint: format!("{ip}:8100"),
        ip,
        backend: BackendKind::Host,
        role,
        window: w.clone(),
        comms: Vec::new(),
    }
}
