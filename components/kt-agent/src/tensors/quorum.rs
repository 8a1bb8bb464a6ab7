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
use kt_types::Key;
use kt_types::model::BroadcastWindow;
use kt_types::tensor::{
    self as t, BackendKind, QuorumJoin, QuorumRole, Rendezvous, TensorStats, TransferPlan,
};

use super::{Tensors, blocking, internal, transport};

/// A join waits this much longer than the window it asks for.
const JOIN_GRACE: Duration = Duration::from_secs(30);

impl Tensors {
    /// Joins `key`'s quorum (`window`) as `member` (see [`member_id`]),
    /// runs the plan and reports.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn quorum(
        &self,
        key: &Key,
        member: String,
        role: QuorumRole,
        window: &BroadcastWindow,
        backend: Arc<dyn Backend>,
        lent: Lent,
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
        let qp = self.metadata.quorum_join(&group, &join, wait).await?;
        let plan = qp.plan;
        let rank = qp.rank;
        tracing::info!(group, transfer = %plan.id, rank, world = plan.ranks.len(), closed_by = %qp.closed_by, reuse = ?qp.reuse, "quorum closed");
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
            Ok(kept) => {
                self.run_quorum(&group, &plan, rank, backend, endpoint, lent, kept)
                    .await
            }
            Err(id) => Err(internal(format!(
                "quorum {group}: the plan reuses communicator {id}, which this agent does not keep"
            ))),
        };
        let done = t::QuorumDone {
            rank,
            error: res.as_ref().err().map(|e| e.message.clone()),
            stats: res.as_ref().cloned().unwrap_or_default(),
        };
        if let Err(e) = self.metadata.quorum_done(&group, &plan.id, &done).await {
            tracing::warn!(group, error = %e, "could not report the end of a quorum transfer");
        }
        res
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
    fn auto_groups_are_valid_group_ids() {
        let g = auto_group(&Key::parse("team/model/weights").unwrap());
        kt_types::broadcast::check_group_id(&g).unwrap();
        assert!(g.starts_with("auto-team.model.weights-"), "{g}");
        assert_ne!(g, auto_group(&Key::parse("team/model.weights").unwrap()));
    }
}
