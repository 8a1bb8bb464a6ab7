//! Quorum membership: a broadcast put or get joins the metadata server's
//! quorum of its group (`/api/v1/quorums/...`) as putter or getter, gets its
//! rank and the plan when the quorum closes, exchanges the backend's
//! rendezvous (NCCL's unique id) through it, runs the plan and reports
//! `done` whatever happened after the join.

use std::sync::Arc;
use std::time::Duration;

use kt_service::ApiError;
use kt_tensor::engine::Lent;
use kt_tensor::{Backend, Comm, Link};
use kt_types::model::BroadcastWindow;
use kt_types::tensor::{
    self as t, BackendKind, QuorumJoin, QuorumRole, Rendezvous, TensorStats, TransferPlan,
};
use kt_types::{ErrorCode, Key};
use tokio_util::sync::CancellationToken;

use super::{Tensors, blocking, internal, transport};

/// A join waits this much longer than the window it asks for.
const JOIN_GRACE: Duration = Duration::from_secs(30);

impl Tensors {
    /// Joins `key`'s quorum (`window`) as `member` (see [`member_id`]),
    /// runs the plan and reports. Once `gone` (the caller went away) before
    /// the quorum closed, the join is withdrawn: the member leaves the
    /// round, so the same process may join it again at once.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn quorum(
        &self,
        key: &Key,
        member: String,
        role: QuorumRole,
        window: &BroadcastWindow,
        backend: Arc<dyn Backend>,
        lent: Lent,
        gone: &CancellationToken,
    ) -> Result<TensorStats, ApiError> {
        let group = match &window.group_id {
            Some(g) => g.clone(),
            None => auto_group(key),
        };
        let ip = self.ip()?;
        let b = backend.clone();
        let ip2 = ip.clone();
        let endpoint = blocking(move || b.endpoint("quorum", &ip2).map_err(transport)).await?;
        // NCCL communicators this group kept, reserved for this join (the
        // others are released when it ends): see `comms`.
        let device = lent.memory_device();
        let reserved =
            (backend.kind() == BackendKind::Nccl).then(|| self.comms.reserve(&group, device));
        let join = QuorumJoin {
            member,
            agent: self.id.clone(),
            ip,
            endpoint: endpoint.address(),
            node: self.node.clone().unwrap_or_default(),
            backend: backend.kind(),
            role,
            window: window.clone(),
            comms: reserved
                .as_ref()
                .map(|r| r.held.clone())
                .unwrap_or_default(),
        };
        // The round's first join fixed its window, maybe a longer one than
        // ours: the server answers by its deadline, at most the longest
        // window, so wait that long (leaving early would leave the round).
        let wait = Duration::from_secs_f64(t::MAX_QUORUM_TIMEOUT_SECS) + JOIN_GRACE;
        // Dropping the join closes its request: the server takes the
        // member out of the round.
        let qp = tokio::select! {
            qp = self.metadata.quorum_join(&group, &join, wait) => qp?,
            () = gone.cancelled() => {
                tracing::info!(group, member = %join.member, "the caller went away before the quorum closed: its join is withdrawn");
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("quorum {group}: the caller went away before the quorum closed; its join was withdrawn"),
                ));
            }
        };
        let plan = qp.plan;
        let rank = qp.rank;
        tracing::info!(group, transfer = %plan.id, rank, world = plan.ranks.len(), closed_by = %qp.closed_by, reuse = ?qp.reuse, "quorum closed");
        // Members of one node are planned together: say where this rank is.
        let placement = (!plan.nodes().is_empty()).then(|| kt_tensor::host::placement(&plan, rank));
        if let Some(p) = &placement {
            tracing::info!(group, transfer = %plan.id, rank, host = %p.host, same_node = ?p.same_node, links_same_node = p.links_same_node, links_other_nodes = p.links_other_nodes, "quorum placement");
        }
        let link = match (&qp.reuse, &reserved) {
            (None, _) => Ok(None),
            (Some(id), Some(r)) => r.take(id).map(Some).ok_or(id),
            (Some(id), None) => Err(id),
        };
        drop(reserved);
        // Whatever happens from here on, the transfer hears how this rank
        // ended, so it completes (and is forgotten) instead of waiting for
        // a report that never comes.
        let res = match link {
            Ok(kept) => self
                .run_quorum(&group, &plan, rank, backend, endpoint, lent, kept)
                .await
                .map(|stats| TensorStats { placement, ..stats }),
            Err(id) => Err(internal(format!(
                "quorum {group}: the plan reuses communicator {id}, which this agent does not keep"
            ))),
        };
        let done = t::QuorumDone {
            rank,
            error: res.as_ref().err().map(|e| e.message.clone()),
            stats: res.as_ref().cloned().unwrap_or_default(),
        };
        match self.metadata.quorum_done(&group, &plan.id, &done).await {
            // A peer that failed for its own reason (no memory for its
            // staging buffers, a handle that did not open) reported it
            // before this rank ran out of time waiting for it: say that.
            Ok(status) => res.map_err(|e| with_peer_causes(e, rank, &status)),
            Err(e) => {
                tracing::warn!(group, error = %e, "could not report the end of a quorum transfer");
                res
            }
        }
    }

    /// This rank's part of a closed quorum: the rendezvous (unless it runs
    /// on a `kept` communicator), then the plan; keeps the communicator
    /// for the group's next round when it can.
    #[allow(clippy::too_many_arguments)]
    async fn run_quorum(
        &self,
        group: &str,
        plan: &Arc<TransferPlan>,
        rank: u32,
        backend: Arc<dyn Backend>,
        endpoint: Box<dyn kt_tensor::Endpoint>,
        lent: Lent,
        kept: Option<Box<dyn Comm>>,
    ) -> Result<TensorStats, ApiError> {
        let device = lent.memory_device();
        let bad = plan
            .validate()
            .err()
            .map(|e| format!("quorum {group} sent an invalid plan: {e}"))
            .or_else(|| {
                (rank as usize >= plan.ranks.len()).then(|| {
                    format!(
                        "quorum {group} gave rank {rank} in a plan of {} ranks",
                        plan.ranks.len()
                    )
                })
            });
        if let Some(why) = bad {
            if let Some(c) = kept {
                Self::retire(&backend, vec![(device, c)]);
            }
            return Err(internal(why));
        }
        let rendezvous = if kept.is_some() {
            None
        } else if rank == 0 {
            let b = backend.clone();
            let p = plan.clone();
            let blob = blocking(move || b.rendezvous(&p).map_err(transport)).await?;
            if let Some(blob) = &blob {
                let r = Rendezvous { blob: blob.clone() };
                let published = self
                    .metadata
                    .rendezvous(group, &plan.id, Some(&r), self.timeout)
                    .await;
                if let Err(e) = published {
                    backend.abandon_rendezvous(blob);
                    return Err(e);
                }
            }
            blob
        } else if backend.kind() == BackendKind::Nccl {
            Some(
                self.metadata
                    .rendezvous(group, &plan.id, None, self.timeout)
                    .await?
                    .blob,
            )
        } else {
            None
        };
        let (p, timeout, b) = (plan.clone(), self.timeout, backend.clone());
        let (res, back) = blocking(move || {
            let link = match kept {
                Some(c) => Link::Reuse(c),
                None => Link::Connect {
                    endpoint,
                    rendezvous: rendezvous.as_deref(),
                },
            };
            Ok(kt_tensor::transfer_on(&*b, &p, rank, link, lent, timeout))
        })
        .await?;
        if let Some(comm) = back
            && backend.kind() == BackendKind::Nccl
        {
            Self::retire(&backend, self.comms.keep(group, device, plan, comm));
        }
        res.map_err(transport)
    }
}

/// A failed rank's error with what the other ranks that failed reported
/// (the metadata server's status of the transfer): a rank that failed for
/// a reason of its own left the others waiting for it until their
/// deadlines, and their `Timeout` alone would hide the cause.
fn with_peer_causes(e: ApiError, me: u32, status: &t::QuorumStatus) -> ApiError {
    let others: Vec<String> = status
        .failed
        .iter()
        .filter(|(r, _)| *r != me)
        .take(3)
        .map(|(r, why)| format!("rank {r}: {why}"))
        .collect();
    if others.is_empty() {
        return e;
    }
    ApiError::new(
        e.code,
        format!(
            "{} (other ranks of transfer {} failed: {})",
            e.message,
            status.transfer,
            others.join("; ")
        ),
    )
}

/// The member id of a quorum join by `owner` (see
/// [`QuorumJoin::member`]): its pid when the agent sees it (else `c` and
/// its control connection), then `.` and the caller's `label` when it gave
/// one. Each process of a pod is a member of its own, so it takes a rank of
/// its own; one process joins a round once unless it labels its joins.
pub(super) fn member_id(owner: &super::Owner, label: Option<&str>) -> Result<String, ApiError> {
    let base = if owner.pid != 0 {
        owner.pid.to_string()
    } else {
        format!("c{}", owner.conn)
    };
    let id = match label {
        None => base,
        Some(l) => format!("{base}.{l}"),
    };
    match t::member_id_problem(&id) {
        Some(why) => Err(ApiError::bad_request(format!(
            "member label {label:?}: {why}"
        ))),
        None => Ok(id),
    }
}

/// The group of a broadcast without an id: one per key.
pub fn auto_group(key: &Key) -> String {
    let readable: String = key
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '.'
            }
        })
        .take(80)
        .collect();
    let h = t::version_of(&[], key.as_str());
    format!("auto-{readable}-{}", &h[2..10])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_that_timed_out_says_why_its_peers_failed() {
        let status = t::QuorumStatus {
            group: "g".into(),
            transfer: "t1".into(),
            world: 3,
            done: vec![],
            failed: vec![
                (
                    1,
                    "allocating 268435456 bytes on cuda:0: out of memory".into(),
                ),
                (2, "mine".into()),
            ],
            complete: false,
        };
        let own = ApiError::new(
            kt_types::ErrorCode::Unavailable,
            "NCCL broadcast: not done after 60s; aborted",
        );
        let e = with_peer_causes(own, 2, &status);
        assert_eq!(e.code, kt_types::ErrorCode::Unavailable);
        assert!(e.message.starts_with("NCCL broadcast"), "{}", e.message);
        assert!(
            e.message
                .contains("rank 1: allocating 268435456 bytes on cuda:0: out of memory"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("mine"), "{}", e.message);
        // Nobody else failed: the error as it was.
        let own = ApiError::new(kt_types::ErrorCode::Unavailable, "x");
        let alone = t::QuorumStatus {
            failed: vec![(2, "x".into())],
            ..status
        };
        assert_eq!(with_peer_causes(own, 2, &alone).message, "x");
    }

    #[test]
    fn auto_groups_are_valid_group_ids() {
        let g = auto_group(&Key::parse("team/model/weights").unwrap());
        kt_types::broadcast::check_group_id(&g).unwrap();
        assert!(g.starts_with("auto-team.model.weights-"), "{g}");
        assert_ne!(g, auto_group(&Key::parse("team/model.weights").unwrap()));
    }
}
