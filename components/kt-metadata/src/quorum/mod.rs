//! Quorums of GPU broadcasts: who takes part in one coordinated tensor
//! transfer, and the plan they all run. In memory only (see *Restarts*).
//!
//! # Rounds
//!
//! - `POST /api/v1/quorums/{group}/join` ([`QuorumJoin`]) is long-polled: it
//!   is answered when the group's open *round* closes, with the member's
//!   rank and the plan ([`QuorumPlan`]), or with this member's error.
//! - A group has at most one open round. Its first join opens it and fixes
//!   its settings from that join's window and backend (world size, timeout,
//!   ips, fanout, pack, bucket size); the timeout runs from that first join.
//!   Later joins' windows are checked, then ignored.
//! - Refused at once, the round unchanged: bad input (400 `invalid_request`:
//!   group id, agent id, ips, world size under 2, timeout not in (0, 3600] s,
//!   fanout 0, bucket under [`t::MIN_BUCKET_BYTES`], no keys, a key twice,
//!   invalid tensor layouts, a `window.group_id` naming another group); a
//!   member on another backend than the round's (400); an agent already in
//!   the round (409 `conflict`: one rank per pod); a put of a key another
//!   member of the round already puts (409); a new round beyond
//!   [`MAX_OPEN`] open rounds plus kept transfers (503 `unavailable`).
//! - A member whose request goes away before the close (the client
//!   disconnected: axum drops the handler's future) leaves the round; a round
//!   whose members all left is forgotten.
//! - A round closes on whichever comes first: `world_size` members; every IP
//!   of `ips` among the members' IPs; the timeout. [`QuorumPlan::closed_by`]
//!   says which (`world_size`, `ips`, `timeout`).
//!
//! # Plans
//!
//! Closing takes the round out of the open ones (a later join opens a new
//! round), then builds the plan (`plan`, pure) without holding the
//! coordinator's lock, keeps the transfer, and only then answers the
//! members, all with the same shared plan:
//! - no putter: every member gets 503 `no_source`;
//! - a getter wanting a key no putter brings gets 404 `not_found`; one whose
//!   destination layout does not match the source's
//!   ([`t::check_destination`]) gets 400 `invalid_request` naming both
//!   sides; neither takes a rank;
//! - ranks: the putters ordered by their first key (rank 0 puts the
//!   smallest), then the remaining getters ordered by agent id: the same
//!   members make the same plan whatever order they joined in;
//! - flows: for each putter, each of its keys in order: root the putter,
//!   receivers the getters that want the key (ascending), the putter's
//!   tensors and version; a key nobody wants makes no flow (its putter still
//!   takes a rank);
//! - no getter left: every remaining member gets 503 `unavailable`;
//! - the plan's id is a fresh UUID; backend, fanout and packing come from the
//!   round. A plan failing [`TransferPlan::validate`] is a bug: 500 to all.
//!
//! # Transfers
//!
//! The closed round becomes a *transfer*, `/api/v1/quorums/{group}/{id}`
//! (unknown group or id: 404):
//! - `PUT …/rendezvous` ([`Rendezvous`], 1 byte to 64 KiB): the backend's
//!   bootstrap blob (NCCL's unique id), published by rank 0. Once: the same
//!   blob again is accepted, another one is 409.
//! - `GET …/rendezvous?wait_ms=N` (default 30 000, at most 600 000):
//!   long-polled until published, else 503 `unavailable`.
//! - `POST …/done` ([`QuorumDone`]) → [`QuorumStatus`]: once per rank (a
//!   second report is 409, a rank outside the plan 400).
//! - `GET …?wait_ms=N` (default 0, at most 600 000) → [`QuorumStatus`],
//!   long-polled until every rank reported or N ms.
//! - `GET /api/v1/quorums/{group}` → [`QuorumInfo`]: the open round (its
//!   members) and the kept transfers (404 when it has neither).
//!
//! A join after the close opens a new round (the previous transfer stays
//! queryable). Transfers are forgotten [`KEEP_COMPLETE`] after every rank
//! reported, or [`KEEP_CLOSED`] after the close if some never do (swept
//! lazily, at most once a second, on access).
//!
//! # Restarts
//!
//! Nothing here is persisted. A metadata-server restart fails open rounds:
//! on shutdown their joins are answered 503 (or their connections break) and
//! the members' agents report an error to their applications, which may
//! join again. Transfers in flight keep running between the agents (the
//! plan and the rendezvous are all they need from here), but their `done`
//! reports and status are 404 after the restart. A restarted server never
//! answers a stale plan.
//!
//! Waits use `tokio::sync::watch` (no polling): one channel per round (its
//! close), and per transfer (its rendezvous, its reports). A round's timeout
//! is driven by its members' own requests, so no task outlives them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kt_service::{ApiError, Metrics};
use kt_types::tensor::{
    self as t, BackendKind, Flow, Packing, QuorumDone, QuorumInfo, QuorumJoin, QuorumKey,
    QuorumPlan, QuorumRole, QuorumRound, QuorumStatus, Rank, Rendezvous, TransferPlan,
};
use kt_types::{ErrorCode, Key};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod routes;

pub use routes::{DEFAULT_WAIT_MS, MAX_JOIN_BODY, MAX_WAIT_MS, routes};

/// Most open rounds plus kept transfers; a join opening one more is 503.
pub const MAX_OPEN: usize = 10_000;
/// Longest quorum window.
pub const MAX_TIMEOUT_SECS: f64 = t::MAX_QUORUM_TIMEOUT_SECS;
/// How long a transfer is kept after every rank reported.
pub const KEEP_COMPLETE: Duration = Duration::from_secs(600);
/// How long a transfer is kept after its close when some rank never reports.
pub const KEEP_CLOSED: Duration = Duration::from_secs(3600);
/// Largest rendezvous blob.
pub const MAX_BLOB_LEN: usize = 64 << 10;
const GC_EVERY: Duration = Duration::from_secs(1);
const MAX_AGENT_LEN: usize = 253;
const MAX_ENDPOINT_LEN: usize = 512;
const MAX_VERSION_LEN: usize = 256;
const MAX_KEYS: usize = 4096;
const MAX_IPS: usize = 4096;
const MAX_ERROR_LEN: usize = 4096;

/// Why a round closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClosedBy {
    WorldSize,
    Ips,
    Timeout,
}

impl ClosedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            ClosedBy::WorldSize => "world_size",
            ClosedBy::Ips => "ips",
            ClosedBy::Timeout => "timeout",
        }
    }
}

impl fmt::Display for ClosedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug)]
struct Member {
    /// Join sequence number: unique across rounds.
    seq: u64,
    ip: IpAddr,
    join: QuorumJoin,
}

impl Member {
    fn keys(&self) -> &[QuorumKey] {
        match &self.join.role {
            QuorumRole::Put { keys } | QuorumRole::Get { keys } => keys,
        }
    }

    fn puts(&self) -> bool {
        matches!(self.join.role, QuorumRole::Put { .. })
    }

    fn wants(&self, key: &Key) -> bool {
        !self.puts() && self.keys().iter().any(|k| &k.key == key)
    }
}

/// What a closed round answers its members (by join sequence).
#[derive(Debug)]
struct Closing {
    by: ClosedBy,
    plan: Option<Arc<TransferPlan>>,
    ranks: HashMap<u64, u32>,
    errors: HashMap<u64, ApiError>,
}

impl Closing {
    fn answer(&self, group: &str, seq: u64) -> Result<QuorumPlan, ApiError> {
        if let Some(e) = self.errors.get(&seq) {
            return Err(e.clone());
        }
        match (self.ranks.get(&seq), &self.plan) {
            (Some(rank), Some(plan)) => Ok(QuorumPlan {
                group: group.to_owned(),
                rank: *rank,
                plan: Arc::clone(plan),
                closed_by: self.by.as_str().to_owned(),
            }),
            _ => Err(ApiError::internal(format!(
                "quorum {group} closed without an answer for this member"
            ))),
        }
    }

    /// Answers `e` to every member not answered yet.
    fn fail_rest(&mut self, members: &[Member], e: &ApiError) {
        for m in members {
            self.errors.entry(m.seq).or_insert_with(|| e.clone());
        }
    }
}

#[derive(Debug)]
struct Round {
    /// The join sequence number of its first member.
    id: u64,
    world_size: Option<u32>,
    ips: Vec<IpAddr>,
    deadline: Instant,
    fanout: u32,
    packing: Packing,
    backend: BackendKind,
    members: Vec<Member>,
    closed: watch::Sender<Option<Arc<Closing>>>,
}

impl Round {
    /// A round opened by `j` (already checked).
    fn open(id: u64, j: &QuorumJoin, now: Instant) -> Round {
        let w = &j.window;
        let secs = w.timeout_secs.unwrap_or(t::DEFAULT_QUORUM_TIMEOUT_SECS);
        Round {
            id,
            world_size: w.world_size,
            ips: w.ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
            deadline: now + Duration::from_secs_f64(secs),
            fanout: w.fanout,
            packing: Packing {
                pack: w.pack,
                bucket_bytes: w.bucket_bytes.unwrap_or(t::DEFAULT_BUCKET_BYTES),
            },
            backend: j.backend,
            members: Vec::new(),
            closed: watch::channel(None).0,
        }
    }

    /// Whether `j` may join this round.
    fn admit(&self, group: &str, j: &QuorumJoin) -> Result<(), ApiError> {
        if j.backend != self.backend {
            return Err(ApiError::bad_request(format!(
                "quorum {group} moves {} data; a member on the {} backend cannot join it",
                match self.backend {
                    BackendKind::Host => "host",
                    BackendKind::Nccl => "GPU (nccl)",
                },
                j.backend
            )));
        }
        if self.members.iter().any(|m| m.join.agent == j.agent) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "agent {} already joined the open round of quorum {group} (one rank per pod)",
                    j.agent
                ),
            ));
        }
        if let QuorumRole::Put { keys } = &j.role
            && let Some((k, m)) = keys.iter().find_map(|k| {
                self.members
                    .iter()
                    .find(|m| m.puts() && m.keys().iter().any(|o| o.key == k.key))
                    .map(|m| (k, m))
            })
        {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "agent {} already puts {} in the open round of quorum {group}",
                    m.join.agent, k.key
                ),
            ));
        }
        Ok(())
    }

    /// Why the round closes now, if it does (before its timeout).
    fn closes_now(&self) -> Option<ClosedBy> {
        if self
            .world_size
            .is_some_and(|n| self.members.len() >= n as usize)
        {
            return Some(ClosedBy::WorldSize);
        }
        let all_ips = !self.ips.is_empty()
            && self
                .ips
                .iter()
                .all(|ip| self.members.iter().any(|m| m.ip == *ip));
        all_ips.then_some(ClosedBy::Ips)
    }

    fn info(&self, now: Instant) -> QuorumRound {
        QuorumRound {
            members: self.members.iter().map(|m| m.join.agent.clone()).collect(),
            backend: self.backend,
            world_size: self.world_size,
            ips: self.ips.iter().map(IpAddr::to_string).collect(),
            closes_in_ms: millis(self.deadline.saturating_duration_since(now)),
        }
    }
}

/// The answers of a round closing now, by `by`; `id` names its transfer.
fn plan(group: &str, round: &Round, by: ClosedBy, id: String) -> Closing {
    let mut closing = Closing {
        by,
        plan: None,
        ranks: HashMap::new(),
        errors: HashMap::new(),
    };
    let (mut putters, mut wanting): (Vec<&Member>, Vec<&Member>) =
        round.members.iter().partition(|m| m.puts());
    // Ranks do not depend on who joined first: putters by their first key
    // (no two putters of a round share a key), getters by agent id (one rank
    // per agent), so the same members always make the same plan.
    putters.sort_by(|a, b| a.keys()[0].key.cmp(&b.keys()[0].key));
    wanting.sort_by(|a, b| a.join.agent.cmp(&b.join.agent));
    if putters.is_empty() {
        let e = ApiError::new(
            ErrorCode::NoSource,
            format!("quorum {group} closed by {by} with no putter"),
        );
        closing.fail_rest(&round.members, &e);
        return closing;
    }
    let sources: HashMap<&Key, &QuorumKey> = putters
        .iter()
        .flat_map(|p| p.keys())
        .map(|k| (&k.key, k))
        .collect();
    let mut getters = Vec::new();
    for g in wanting {
        match can_receive(group, g, &sources) {
            Ok(()) => getters.push(g),
            Err(e) => {
                closing.errors.insert(g.seq, e);
            }
        }
    }
    let first_getter = putters.len();
    let mut flows = Vec::new();
    for (root, p) in putters.iter().enumerate() {
        for k in p.keys() {
            let receivers: Vec<u32> = getters
                .iter()
                .enumerate()
                .filter(|(_, g)| g.wants(&k.key))
                .map(|(i, _)| (first_getter + i) as u32)
                .collect();
            if !receivers.is_empty() {
                flows.push(Flow {
                    key: k.key.clone(),
                    version: k.version.clone(),
                    root: root as u32,
                    receivers,
                    tensors: k.tensors.clone(),
                });
            }
        }
    }
    if getters.is_empty() || flows.is_empty() {
        let why = if closing.errors.is_empty() {
            "with no getter"
        } else {
            "and none of its getters can receive what its putters bring"
        };
        let e = ApiError::new(
            ErrorCode::Unavailable,
            format!("quorum {group} closed by {by} {why}: there is nothing to move"),
        );
        closing.fail_rest(&round.members, &e);
        return closing;
    }
    let ranked: Vec<&Member> = putters.iter().chain(&getters).copied().collect();
    let plan = TransferPlan {
        id,
        backend: round.backend,
        ranks: ranked
            .iter()
            .enumerate()
            .map(|(i, m)| Rank {
                rank: i as u32,
                agent: m.join.agent.clone(),
                ip: m.join.ip.clone(),
                endpoint: m.join.endpoint.clone(),
            })
            .collect(),
        flows,
        packing: round.packing,
        fanout: round.fanout,
    };
    if let Err(e) = plan.validate() {
        let e = ApiError::internal(format!("quorum {group} made an invalid plan (a bug): {e}"));
        closing.fail_rest(&round.members, &e);
        return closing;
    }
    closing.ranks = ranked
        .iter()
        .enumerate()
        .map(|(i, m)| (m.seq, i as u32))
        .collect();
    closing.plan = Some(Arc::new(plan));
    closing
}

/// Whether getter `g` can receive every key it wants from the round's putters.
fn can_receive(
    group: &str,
    g: &Member,
    sources: &HashMap<&Key, &QuorumKey>,
) -> Result<(), ApiError> {
    for want in g.keys() {
        let src = sources.get(&want.key).ok_or_else(|| {
            ApiError::not_found(format!("no member of quorum {group} puts key {}", want.key))
        })?;
        t::check_destination(&want.key, &src.tensors, &want.tensors)
            .map_err(ApiError::bad_request)?;
    }
    Ok(())
}

#[derive(Debug)]
struct Transfer {
    world: u32,
    closed_at: Instant,
    completed_at: Option<Instant>,
    rendezvous: watch::Sender<Option<String>>,
    /// Reports by rank: `None` for success, the error otherwise.
    reports: BTreeMap<u32, Option<String>>,
    /// Signalled on every report.
    reported: watch::Sender<()>,
}

impl Transfer {
    fn new(world: u32, now: Instant) -> Transfer {
        Transfer {
            world,
            closed_at: now,
            completed_at: None,
            rendezvous: watch::channel(None).0,
            reports: BTreeMap::new(),
            reported: watch::channel(()).0,
        }
    }

    fn complete(&self) -> bool {
        self.reports.len() >= self.world as usize
    }

    fn expired(&self, now: Instant) -> bool {
        match self.completed_at {
            Some(at) => now.duration_since(at) >= KEEP_COMPLETE,
            None => now.duration_since(self.closed_at) >= KEEP_CLOSED,
        }
    }

    fn status(&self, group: &str, id: &str) -> QuorumStatus {
        QuorumStatus {
            group: group.to_owned(),
            transfer: id.to_owned(),
            world: self.world,
            done: self
                .reports
                .iter()
                .filter(|(_, e)| e.is_none())
                .map(|(r, _)| *r)
                .collect(),
            failed: self
                .reports
                .iter()
                .filter_map(|(r, e)| e.clone().map(|e| (*r, e)))
                .collect(),
            complete: self.complete(),
        }
    }
}

#[derive(Debug)]
struct Quorum {
    open: HashMap<String, Round>,
    /// By (group, transfer id).
    transfers: HashMap<(String, String), Transfer>,
    next_seq: u64,
    last_gc: Instant,
}

impl Quorum {
    /// Forgets expired transfers (at most once per [`GC_EVERY`]).
    fn gc(&mut self, now: Instant) {
        if now.duration_since(self.last_gc) < GC_EVERY {
            return;
        }
        self.last_gc = now;
        let before = self.transfers.len();
        self.transfers.retain(|_, tr| !tr.expired(now));
        let forgotten = before - self.transfers.len();
        if forgotten > 0 {
            tracing::debug!(forgotten, "quorum transfers forgotten");
        }
    }

    /// Takes `group`'s open round out if it is still round `id`: it is
    /// closing, and joins from now on open a new one.
    fn take_round(&mut self, group: &str, id: u64) -> Option<Round> {
        if self.open.get(group).is_some_and(|r| r.id == id) {
            self.open.remove(group)
        } else {
            None
        }
    }

    fn transfer(&mut self, group: &str, id: &str) -> Result<&mut Transfer, ApiError> {
        self.transfers
            .get_mut(&(group.to_owned(), id.to_owned()))
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "quorum {group} has no transfer {id} (unknown, or forgotten after it ended)"
                ))
            })
    }
}

/// The quorum coordinator of one metadata server.
#[derive(Debug)]
pub struct Quorums {
    state: Mutex<Quorum>,
    /// Bumped whenever an open round gains or loses a member.
    membership: watch::Sender<u64>,
    shutdown: CancellationToken,
    metrics: Option<Arc<Metrics>>,
}

impl Quorums {
    /// A coordinator whose long polls end when `shutdown` is cancelled.
    pub fn new(shutdown: CancellationToken) -> Self {
        Quorums {
            state: Mutex::new(Quorum {
                open: HashMap::new(),
                transfers: HashMap::new(),
                next_seq: 0,
                last_gc: Instant::now(),
            }),
            membership: watch::channel(0).0,
            shutdown,
            metrics: None,
        }
    }

    /// Records the duration of completed transfers (close to last report)
    /// as `kt_transfer_duration_seconds{kind="quorum"}`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Never held across an await.
    fn lock(&self) -> MutexGuard<'_, Quorum> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes `round`, already taken out of the open rounds: plans it, keeps
    /// its transfer and answers every member. The plan is made without the
    /// lock: it checks every getter's destination against the putters'
    /// tensors, which for large dicts and many getters takes long enough to
    /// stall every other group's joins and reports.
    fn close(&self, group: &str, round: Round, by: ClosedBy) {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let closing = plan(group, &round, by, id.clone());
        match &closing.plan {
            Some(plan) => {
                tracing::info!(
                    group,
                    transfer = %id,
                    closed_by = %by,
                    ranks = plan.ranks.len(),
                    flows = plan.flows.len(),
                    refused = closing.errors.len(),
                    "quorum closed"
                );
                let tr = Transfer::new(plan.ranks.len() as u32, Instant::now());
                self.lock().transfers.insert((group.to_owned(), id), tr);
            }
            None => tracing::info!(
                group,
                closed_by = %by,
                members = round.members.len(),
                "quorum closed with nothing to move"
            ),
        }
        // Sent only now: no member knows the transfer before it is kept.
        round.closed.send_replace(Some(Arc::new(closing)));
    }

    /// Joins `group`'s open round (opening one if none is); answered when
    /// the round closes. Dropping the future before leaves the round.
    pub async fn join(&self, group: &str, join: QuorumJoin) -> Result<QuorumPlan, ApiError> {
        let ip = check_join(group, &join)?;
        let now = Instant::now();
        let (seq, round, mut closed, deadline, closing) = {
            let mut st = self.lock();
            st.gc(now);
            match st.open.get(group) {
                Some(r) => r.admit(group, &join)?,
                None if st.open.len() + st.transfers.len() >= MAX_OPEN => {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        format!(
                            "{MAX_OPEN} quorum rounds and transfers are open or kept; try again later"
                        ),
                    ));
                }
                None => {}
            }
            st.next_seq += 1;
            let seq = st.next_seq;
            let r = st
                .open
                .entry(group.to_owned())
                .or_insert_with(|| Round::open(seq, &join, now));
            tracing::debug!(group, agent = %join.agent, members = r.members.len() + 1, "quorum join");
            r.members.push(Member { seq, ip, join });
            let closed = r.closed.subscribe();
            let (round, deadline, by) = (r.id, r.deadline, r.closes_now());
            let closing = by.and_then(|by| Some((st.take_round(group, round)?, by)));
            (seq, round, closed, deadline, closing)
        };
        if let Some((r, by)) = closing {
            self.close(group, r, by);
        }
        self.membership.send_modify(|n| *n += 1);
        let _leave = Leave {
            quorums: self,
            group,
            round,
            seq,
        };
        loop {
            if let Some(c) = closed.borrow_and_update().clone() {
                return c.answer(group, seq);
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("the metadata server is shutting down: quorum {group} is abandoned (join again once it is back)"),
                    ));
                }
                r = closed.changed() => {
                    if r.is_err() {
                        return Err(ApiError::internal(format!("the round of quorum {group} ended without an answer")));
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let due = self.lock().take_round(group, round);
                    if let Some(r) = due {
                        self.close(group, r, ClosedBy::Timeout);
                    }
                }
            }
        }
    }

    /// A member of round `round` went away before its close.
    fn leave(&self, group: &str, round: u64, seq: u64) {
        let mut st = self.lock();
        let Some(r) = st.open.get_mut(group).filter(|r| r.id == round) else {
            return;
        };
        let before = r.members.len();
        r.members.retain(|m| m.seq != seq);
        if r.members.len() == before {
            return;
        }
        tracing::info!(
            group,
            members = r.members.len(),
            "a quorum member went away before the close"
        );
        if r.members.is_empty() {
            st.open.remove(group);
        }
        drop(st);
        self.membership.send_modify(|n| *n += 1);
    }

    /// `PUT …/rendezvous`: rank 0's bootstrap blob, once.
    pub fn publish(&self, group: &str, id: &str, r: Rendezvous) -> Result<(), ApiError> {
        if r.blob.is_empty() || r.blob.len() > MAX_BLOB_LEN {
            return Err(ApiError::bad_request(format!(
                "a rendezvous blob is 1 to {MAX_BLOB_LEN} bytes, got {}",
                r.blob.len()
            )));
        }
        let now = Instant::now();
        let mut st = self.lock();
        st.gc(now);
        let tr = st.transfer(group, id)?;
        let same = match &*tr.rendezvous.borrow() {
            Some(b) => Some(*b == r.blob),
            None => None,
        };
        match same {
            Some(true) => Ok(()),
            Some(false) => Err(ApiError::new(
                ErrorCode::Conflict,
                format!("transfer {id} of quorum {group} already has another rendezvous"),
            )),
            None => {
                tr.rendezvous.send_replace(Some(r.blob));
                Ok(())
            }
        }
    }

    /// `GET …/rendezvous`: the blob, waiting up to `wait` for it.
    pub async fn rendezvous(
        &self,
        group: &str,
        id: &str,
        wait: Duration,
    ) -> Result<Rendezvous, ApiError> {
        let deadline = Instant::now() + wait;
        let mut rx = {
            let mut st = self.lock();
            st.gc(Instant::now());
            st.transfer(group, id)?.rendezvous.subscribe()
        };
        loop {
            if let Some(blob) = rx.borrow_and_update().clone() {
                return Ok(Rendezvous { blob });
            }
            tokio::select! {
                r = rx.changed() => {
                    if r.is_err() {
                        return Err(ApiError::not_found(format!("transfer {id} of quorum {group} was forgotten")));
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("rank 0 has not published the rendezvous of transfer {id} yet"),
                    ));
                }
                _ = self.shutdown.cancelled() => {
                    return Err(ApiError::new(ErrorCode::Unavailable, "the metadata server is shutting down"));
                }
            }
        }
    }

    /// `POST …/done`: one rank's report.
    pub fn done(&self, group: &str, id: &str, d: QuorumDone) -> Result<QuorumStatus, ApiError> {
        let now = Instant::now();
        let mut st = self.lock();
        st.gc(now);
        let tr = st.transfer(group, id)?;
        if d.rank >= tr.world {
            return Err(ApiError::bad_request(format!(
                "rank {} is not in transfer {id} of quorum {group} ({} ranks)",
                d.rank, tr.world
            )));
        }
        if tr.reports.contains_key(&d.rank) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("rank {} already reported on transfer {id}", d.rank),
            ));
        }
        let error = d.error.map(|e| match e.is_empty() {
            true => "failed without a message".to_owned(),
            false => e.chars().take(MAX_ERROR_LEN).collect(),
        });
        tr.reports.insert(d.rank, error);
        if tr.complete() {
            tr.completed_at = Some(now);
            let secs = now.duration_since(tr.closed_at).as_secs_f64();
            let failed = tr.reports.values().filter(|e| e.is_some()).count();
            tracing::info!(
                group,
                transfer = id,
                world = tr.world,
                failed,
                secs,
                "quorum transfer over"
            );
            if let Some(m) = &self.metrics {
                m.observe_transfer("quorum", secs);
            }
        }
        tr.reported.send_replace(());
        Ok(tr.status(group, id))
    }

    /// `GET …/{transfer}`: the status, once complete or after `wait`.
    pub async fn status(
        &self,
        group: &str,
        id: &str,
        wait: Duration,
    ) -> Result<QuorumStatus, ApiError> {
        let deadline = Instant::now() + wait;
        let mut rx = {
            let mut st = self.lock();
            st.gc(Instant::now());
            st.transfer(group, id)?.reported.subscribe()
        };
        loop {
            let s = self.lock().transfer(group, id)?.status(group, id);
            if s.complete {
                return Ok(s);
            }
            tokio::select! {
                r = rx.changed() => {
                    if r.is_err() {
                        return Ok(s);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return Ok(s),
                _ = self.shutdown.cancelled() => return Ok(s),
            }
        }
    }

    /// `GET /api/v1/quorums/{group}`: its open round and kept transfers.
    pub fn info(&self, group: &str) -> Result<QuorumInfo, ApiError> {
        let now = Instant::now();
        let mut st = self.lock();
        st.gc(now);
        let open = st.open.get(group).map(|r| r.info(now));
        let mut kept: Vec<(Instant, QuorumStatus)> = st
            .transfers
            .iter()
            .filter(|((g, _), _)| g == group)
            .map(|((g, id), tr)| (tr.closed_at, tr.status(g, id)))
            .collect();
        if open.is_none() && kept.is_empty() {
            return Err(ApiError::not_found(format!(
                "quorum {group} has no open round and no kept transfer"
            )));
        }
        kept.sort_by_key(|(at, _)| *at);
        Ok(QuorumInfo {
            group: group.to_owned(),
            open,
            transfers: kept.into_iter().map(|(_, s)| s).collect(),
        })
    }

    /// Waits until `group`'s open round has `n` members (0: none is open).
    pub async fn wait_members(&self, group: &str, n: usize) {
        let mut rx = self.membership.subscribe();
        loop {
            let has = self.lock().open.get(group).map_or(0, |r| r.members.len());
            if has == n || rx.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Removes its member from the round when the join's future is dropped
/// before the close (a no-op after it).
struct Leave<'a> {
    quorums: &'a Quorums,
    group: &'a str,
    round: u64,
    seq: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.quorums.leave(self.group, self.round, self.seq);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg)
}

fn bounded_text(what: &str, s: &str, max: usize) -> Result<(), ApiError> {
    if s.is_empty() || s.len() > max || s.chars().any(char::is_control) {
        return Err(bad(format!(
            "{what} must be 1 to {max} bytes without control characters, got {s:?}"
        )));
    }
    Ok(())
}

/// Checks a join (nothing changes when it fails); the member's IP.
fn check_join(group: &str, j: &QuorumJoin) -> Result<IpAddr, ApiError> {
    kt_types::broadcast::check_group_id(group).map_err(bad)?;
    bounded_text("agent id", &j.agent, MAX_AGENT_LEN)?;
    let ip =
        j.ip.parse::<IpAddr>()
            .map_err(|_| bad(format!("member ip {:?} is not an IP address", j.ip)))?;
    bounded_text("endpoint", &j.endpoint, MAX_ENDPOINT_LEN)?;
    let w = &j.window;
    if let Some(g) = &w.group_id
        && g != group
    {
        return Err(bad(format!(
            "the window names group {g:?} but the join is for quorum {group}"
        )));
    }
    if let Some(n) = w.world_size
        && n < 2
    {
        return Err(bad(format!(
            "world_size must be 2 or more (a putter and a getter), got {n}"
        )));
    }
    if let Some(s) = w.timeout_secs
        && !(s.is_finite() && s > 0.0 && s <= MAX_TIMEOUT_SECS)
    {
        return Err(bad(format!(
            "timeout_secs must be over 0 and at most {MAX_TIMEOUT_SECS}, got {s}"
        )));
    }
    if w.ips.len() > MAX_IPS {
        return Err(bad(format!(
            "ips lists {} addresses, more than {MAX_IPS}",
            w.ips.len()
        )));
    }
    if let Some(ip) = w.ips.iter().find(|ip| ip.parse::<IpAddr>().is_err()) {
        return Err(bad(format!("ips: {ip:?} is not an IP address")));
    }
    if w.fanout == 0 {
        return Err(bad("fanout must be 1 or more"));
    }
    if let Some(b) = w.bucket_bytes {
        Packing {
            pack: w.pack,
            bucket_bytes: b,
        }
        .validate()
        .map_err(bad)?;
    }
    let keys = match &j.role {
        QuorumRole::Put { keys } | QuorumRole::Get { keys } => keys,
    };
    if keys.is_empty() || keys.len() > MAX_KEYS {
        return Err(bad(format!(
            "a member brings 1 to {MAX_KEYS} keys, got {}",
            keys.len()
        )));
    }
    let mut seen = HashSet::new();
    for k in keys {
        if !seen.insert(&k.key) {
            return Err(bad(format!("key {} is listed twice", k.key)));
        }
        check_key(k)?;
    }
    Ok(ip)
}

fn check_key(k: &QuorumKey) -> Result<(), ApiError> {
    if k.version.len() > MAX_VERSION_LEN {
        return Err(bad(format!(
            "{}: a version is at most {MAX_VERSION_LEN} bytes",
            k.key
        )));
    }
    if k.tensors.is_empty() || k.tensors.len() > t::MAX_TENSORS {
        return Err(bad(format!(
            "{}: 1 to {} tensors, got {}",
            k.key,
            t::MAX_TENSORS,
            k.tensors.len()
        )));
    }
    let mut names = HashSet::new();
    for d in &k.tensors {
        if d.name.len() > t::MAX_NAME_LEN || d.name.chars().any(char::is_control) {
            return Err(bad(format!(
                "{}: tensor name {:?} is longer than {} bytes or has control characters",
                k.key,
                d.name,
                t::MAX_NAME_LEN
            )));
        }
        if !names.insert(d.name.as_str()) {
            return Err(bad(format!(
                "{}: tensor name {:?} appears twice",
                k.key, d.name
            )));
        }
        d.meta
            .nbytes()
            .map_err(|m| bad(format!("{} tensor {:?}: {m}", k.key, d.name)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::BroadcastWindow;
    use kt_types::tensor::{DType, TensorDesc, TensorMeta};

    /// Longest wait for anything in these tests.
    const WAIT: Duration = Duration::from_secs(10);

    fn key(k: &str, len: u64) -> QuorumKey {
        QuorumKey {
            key: Key::parse(k).unwrap(),
            version: format!("v-{k}"),
            tensors: vec![TensorDesc {
                name: "w".into(),
                meta: TensorMeta::new(DType::F32, [len]),
            }],
        }
    }

    fn window(world: Option<u32>, secs: f64) -> BroadcastWindow {
        BroadcastWindow {
            world_size: world,
            timeout_secs: Some(secs),
            fanout: 2,
            ..BroadcastWindow::default()
        }
    }

    fn putter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
        member(agent, QuorumRole::Put { keys }, w)
    }

    fn getter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
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
            agent: agent.into(),
            endpoint: format!("{ip}:8100"),
            ip,
            backend: BackendKind::Host,
            role,
            window: w.clone(),
        }
    }

    fn q() -> Arc<Quorums> {
        Arc::new(Quorums::new(CancellationToken::new()))
    }

    /// A join running in its own task.
    fn spawn(
        q: &Arc<Quorums>,
        group: &str,
        j: QuorumJoin,
    ) -> tokio::task::JoinHandle<Result<QuorumPlan, ApiError>> {
        let (q, group) = (q.clone(), group.to_owned());
        tokio::spawn(async move { q.join(&group, j).await })
    }

    async fn members(q: &Quorums, group: &str, n: usize) {
        tokio::time::timeout(WAIT, q.wait_members(group, n))
            .await
            .unwrap_or_else(|_| panic!("{group} never had {n} members"));
    }

    async fn answer(
        h: tokio::task::JoinHandle<Result<QuorumPlan, ApiError>>,
    ) -> Result<QuorumPlan, ApiError> {
        tokio::time::timeout(WAIT, h)
            .await
            .expect("the join was answered")
            .expect("the join's task")
    }

    // ---- the pure planning step ---------------------------------------------

    /// A round of these members (join order), as if they had joined.
    fn round(joins: Vec<QuorumJoin>) -> Round {
        let mut r = Round::open(1, &joins[0], Instant::now());
        for (i, join) in joins.into_iter().enumerate() {
            let ip = join.ip.parse().unwrap();
            r.members.push(Member {
                seq: i as u64 + 1,
                ip,
                join,
            });
        }
        r
    }

    #[test]
    fn plans_put_putters_first_and_make_one_flow_per_wanted_key() {
        let w = window(None, 5.0);
        let r = round(vec![
            getter("a1", vec![key("x", 4)], &w),
            putter("a2", vec![key("x", 4), key("unwanted", 1)], &w),
            getter("a3", vec![key("x", 4), key("y", 2)], &w),
            putter("a4", vec![key("y", 2)], &w),
            getter("a5", vec![key("y", 2)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::Timeout, "tid".into());
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        let p = c.plan.as_ref().unwrap();
        let agents: Vec<&str> = p.ranks.iter().map(|r| r.agent.as_str()).collect();
        assert_eq!(agents, ["a2", "a4", "a1", "a3", "a5"]);
        assert_eq!(p.ranks[2].ip, "10.0.0.1");
        let flows: Vec<(&str, u32, &[u32])> = p
            .flows
            .iter()
            .map(|f| (f.key.as_str(), f.root, f.receivers.as_slice()))
            .collect();
        assert_eq!(flows, [("x", 0, &[2, 3][..]), ("y", 1, &[3, 4][..])]);
        assert_eq!(p.flows[0].version, "v-x");
        assert_eq!(p.id, "tid");
        assert_eq!(p.fanout, 2);
        assert_eq!(p.packing, Packing::default());
        assert_eq!(c.answer("g", 1).unwrap().rank, 2);
        assert_eq!(c.answer("g", 4).unwrap().rank, 1);
        assert_eq!(c.answer("g", 4).unwrap().closed_by, "timeout");
    }

    #[test]
    fn ranks_do_not_depend_on_join_order() {
        let w = window(None, 5.0);
        let joins = || {
            vec![
                putter("p1", vec![key("x", 4)], &w),
                putter("p2", vec![key("y", 2)], &w),
                getter("g1", vec![key("x", 4), key("y", 2)], &w),
                getter("g2", vec![key("y", 2)], &w),
                getter("g3", vec![key("x", 4)], &w),
            ]
        };
        let shape = |joins: Vec<QuorumJoin>| {
            let c = plan("g", &round(joins), ClosedBy::WorldSize, "t".into());
            let p = c.plan.expect("a plan");
            let agents: Vec<String> = p.ranks.iter().map(|r| r.agent.clone()).collect();
            let flows: Vec<(String, u32, Vec<u32>)> = p
                .flows
                .iter()
                .map(|f| (f.key.to_string(), f.root, f.receivers.clone()))
                .collect();
            (agents, flows)
        };
        let first = shape(joins());
        assert_eq!(first.0, ["p1", "p2", "g1", "g2", "g3"]);
        for order in [[4, 3, 2, 1, 0], [2, 1, 4, 0, 3], [3, 0, 4, 2, 1]] {
            let all = joins();
            let shuffled = order.iter().map(|&i| all[i].clone()).collect();
            assert_eq!(shape(shuffled), first, "joined in order {order:?}");
        }
    }

    #[test]
    fn getters_that_cannot_receive_are_refused_and_take_no_rank() {
        let w = window(None, 5.0);
        let r = round(vec![
            putter("a1", vec![key("k", 4)], &w),
            getter("a2", vec![key("k", 5)], &w),
            getter("a3", vec![key("k", 4), key("other", 4)], &w),
            getter("a4", vec![key("k", 4)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::WorldSize, "t".into());
        let e = c.answer("g", 2).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(
            e.message.contains("f32[4]") && e.message.contains("f32[5]"),
            "{}",
            e.message
        );
        let e = c.answer("g", 3).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert_eq!(e.message, "no member of quorum g puts key other");
        let p = c.answer("g", 4).unwrap();
        assert_eq!((p.rank, p.plan.ranks.len()), (1, 2));
        assert_eq!(p.plan.flows[0].receivers, [1]);
    }

    #[test]
    fn nothing_to_move_fails_every_member() {
        let w = window(None, 5.0);
        // No putter: no_source for all, even a getter whose key is unknown.
        let r = round(vec![
            getter("a1", vec![key("k", 4)], &w),
            getter("a2", vec![key("j", 4)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::Timeout, "t".into());
        for seq in [1, 2] {
            let e = c.answer("g", seq).unwrap_err();
            assert_eq!(e.code, ErrorCode::NoSource);
            assert_eq!(e.message, "quorum g closed by timeout with no putter");
        }
        assert!(c.plan.is_none());
        // Putters only.
        let r = round(vec![
            putter("a1", vec![key("k", 4)], &w),
            putter("a2", vec![key("j", 4)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::WorldSize, "t".into());
        let e = c.answer("g", 2).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("no getter"), "{}", e.message);
        // The only getter is refused: it keeps its own error, the putter
        // gets unavailable.
        let r = round(vec![
            putter("a1", vec![key("k", 4)], &w),
            getter("a2", vec![key("k", 3)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::Ips, "t".into());
        assert_eq!(
            c.answer("g", 2).unwrap_err().code,
            ErrorCode::InvalidRequest
        );
        let e = c.answer("g", 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("none of its getters"), "{}", e.message);
    }

    #[test]
    fn rounds_close_on_world_size_or_every_ip() {
        let mut w = window(Some(3), 5.0);
        w.ips = vec!["10.0.0.1".into(), "::1".into()];
        let mut r = round(vec![putter("a1", vec![key("k", 4)], &w)]);
        assert_eq!(r.closes_now(), None);
        let mut g = getter("a2", vec![key("k", 4)], &w);
        g.ip = "0:0::1".into();
        r.members.push(Member {
            seq: 2,
            ip: g.ip.parse().unwrap(),
            join: g,
        });
        assert_eq!(r.closes_now(), Some(ClosedBy::Ips));
        r.ips.clear();
        assert_eq!(r.closes_now(), None);
        r.members.push(Member {
            seq: 3,
            ip: "10.0.0.3".parse().unwrap(),
            join: getter("a3", vec![key("k", 4)], &w),
        });
        assert_eq!(r.closes_now(), Some(ClosedBy::WorldSize));
    }

    #[test]
    fn joins_are_checked() {
        let w = window(Some(2), 5.0);
        let ok = putter("a1", vec![key("k", 4)], &w);
        check_join("g", &ok).unwrap();
        let mut cases: Vec<(&str, QuorumJoin, &str)> = Vec::new();
        cases.push(("bad group!", ok.clone(), "group id"));
        cases.push(("join", ok.clone(), "reserved"));
        let mut j = ok.clone();
        j.agent = String::new();
        cases.push(("g", j, "agent id"));
        let mut j = ok.clone();
        j.ip = "pod-1".into();
        cases.push(("g", j, "not an IP"));
        for (world, secs, what) in [
            (Some(1), 5.0, "world_size"),
            (None, -1.0, "timeout_secs"),
            (None, 0.0, "timeout_secs"),
            (None, f64::INFINITY, "timeout_secs"),
            (None, 3601.0, "timeout_secs"),
        ] {
            cases.push((
                "g",
                putter("a1", vec![key("k", 4)], &window(world, secs)),
                what,
            ));
        }
        let mut j = ok.clone();
        j.window.ips = vec!["10.0.0.300".into()];
        cases.push(("g", j, "ips"));
        let mut j = ok.clone();
        j.window.fanout = 0;
        cases.push(("g", j, "fanout"));
        let mut j = ok.clone();
        j.window.bucket_bytes = Some(1024);
        cases.push(("g", j, "minimum"));
        let mut j = ok.clone();
        j.window.group_id = Some("other".into());
        cases.push(("g", j, "names group"));
        cases.push(("g", putter("a1", vec![], &w), "keys"));
        cases.push((
            "g",
            putter("a1", vec![key("k", 4), key("k", 4)], &w),
            "twice",
        ));
        let mut k = key("k", 4);
        k.tensors.clear();
        cases.push(("g", putter("a1", vec![k], &w), "tensors"));
        let mut k = key("k", 4);
        k.tensors[0].meta.shape = vec![u64::MAX, 4];
        cases.push(("g", getter("a1", vec![k], &w), "larger than"));
        let mut k = key("k", 4);
        k.tensors.push(k.tensors[0].clone());
        cases.push(("g", getter("a1", vec![k], &w), "appears twice"));
        for (group, j, what) in cases {
            let e = check_join(group, &j).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidRequest);
            assert!(e.message.contains(what), "{what}: {}", e.message);
        }
    }

    // ---- the coordinator ----------------------------------------------------

    #[tokio::test]
    async fn a_round_closes_on_world_size_and_the_next_join_opens_another() {
        let q = q();
        let w = window(Some(3), 60.0);
        let g1 = spawn(&q, "grp", getter("a2", vec![key("k", 4)], &w));
        let g2 = spawn(&q, "grp", getter("a3", vec![key("k", 4)], &w));
        members(&q, "grp", 2).await;
        let p = q
            .join("grp", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        let (a, b) = (answer(g1).await.unwrap(), answer(g2).await.unwrap());
        assert_eq!((p.rank, p.closed_by.as_str()), (0, "world_size"));
        let mut ranks = [a.rank, b.rank];
        ranks.sort();
        assert_eq!(ranks, [1, 2]);
        // One plan, shared by every member's answer rather than copied.
        assert!(Arc::ptr_eq(&p.plan, &a.plan) && Arc::ptr_eq(&p.plan, &b.plan));
        assert_eq!(p.plan.flows[0].receivers, [1, 2]);
        let info = q.info("grp").unwrap();
        assert!(info.open.is_none());
        assert_eq!(info.transfers[0].transfer, p.plan.id);
        // The same agents join again: a new round, a new transfer.
        let g = spawn(
            &q,
            "grp",
            getter("a2", vec![key("k", 4)], &window(Some(2), 60.0)),
        );
        members(&q, "grp", 1).await;
        let p2 = q
            .join("grp", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        assert_eq!(answer(g).await.unwrap().plan.id, p2.plan.id);
        assert_ne!(p2.plan.id, p.plan.id);
        assert_eq!(q.info("grp").unwrap().transfers.len(), 2);
    }

    #[tokio::test]
    async fn a_round_closes_on_ips_and_on_timeout() {
        let q = q();
        let mut w = window(None, 60.0);
        w.ips = vec!["10.0.0.1".into(), "10.0.0.2".into()];
        let g = spawn(&q, "ips", getter("a2", vec![key("k", 4)], &w));
        members(&q, "ips", 1).await;
        let p = q
            .join("ips", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        assert_eq!(p.closed_by, "ips");
        assert_eq!(answer(g).await.unwrap().rank, 1);

        let w = window(Some(10), 0.2);
        let g = spawn(&q, "late", getter("a2", vec![key("k", 4)], &w));
        let p = q
            .join("late", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        assert_eq!(p.closed_by, "timeout");
        assert_eq!(p.plan.ranks.len(), 2);
        assert_eq!(answer(g).await.unwrap().closed_by, "timeout");
    }

    #[tokio::test]
    async fn conflicting_joins_are_refused_and_a_dropped_join_leaves() {
        let q = q();
        let w = window(Some(3), 60.0);
        let first = spawn(&q, "c", putter("a1", vec![key("k", 4)], &w));
        members(&q, "c", 1).await;
        let e = q
            .join("c", getter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict, "{}", e.message);
        assert!(e.message.contains("one rank per pod"), "{}", e.message);
        let e = q
            .join("c", putter("a2", vec![key("j", 1), key("k", 4)], &w))
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict, "{}", e.message);
        assert!(e.message.contains("already puts k"), "{}", e.message);
        let mut nccl = getter("a3", vec![key("k", 4)], &w);
        nccl.backend = BackendKind::Nccl;
        let e = q.join("c", nccl).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest, "{}", e.message);
        assert!(e.message.contains("nccl"), "{}", e.message);
        assert_eq!(q.info("c").unwrap().open.unwrap().members, ["a1"]);
        // A getter joins, then goes away: the round is back to one member.
        let gone = spawn(&q, "c", getter("a2", vec![key("k", 4)], &w));
        members(&q, "c", 2).await;
        gone.abort();
        members(&q, "c", 1).await;
        // So two more are needed to reach world size 3.
        let g3 = spawn(&q, "c", getter("a3", vec![key("k", 4)], &w));
        members(&q, "c", 2).await;
        let p = q
            .join("c", getter("a4", vec![key("k", 4)], &w))
            .await
            .unwrap();
        let agents: Vec<String> = p.plan.ranks.iter().map(|r| r.agent.clone()).collect();
        assert_eq!(agents, ["a1", "a3", "a4"]);
        answer(g3).await.unwrap();
        answer(first).await.unwrap();
        // Every member of a round goes away: the round is forgotten.
        let alone = spawn(&q, "d", putter("a1", vec![key("k", 4)], &w));
        members(&q, "d", 1).await;
        alone.abort();
        members(&q, "d", 0).await;
        assert_eq!(q.info("d").unwrap_err().code, ErrorCode::NotFound);
    }

    #[tokio::test]
    async fn rendezvous_and_completion_are_long_polled() {
        let q = q();
        let w = window(Some(2), 60.0);
        let g = spawn(&q, "r", getter("a2", vec![key("k", 4)], &w));
        let p = q
            .join("r", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        answer(g).await.unwrap();
        let id = p.plan.id.clone();
        let e = q
            .rendezvous("r", &id, Duration::from_millis(20))
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("has not published"), "{}", e.message);
        // A waiter polled before the blob exists gets it once published.
        let waiter = q.rendezvous("r", &id, WAIT);
        tokio::pin!(waiter);
        assert!(
            tokio::time::timeout(Duration::ZERO, &mut waiter)
                .await
                .is_err()
        );
        q.publish("r", &id, Rendezvous { blob: "abc".into() })
            .unwrap();
        assert_eq!(waiter.await.unwrap().blob, "abc");
        q.publish("r", &id, Rendezvous { blob: "abc".into() })
            .unwrap();
        let other = Rendezvous {
            blob: "other".into(),
        };
        assert_eq!(
            q.publish("r", &id, other).unwrap_err().code,
            ErrorCode::Conflict
        );
        let e = q.rendezvous("r", "nope", WAIT).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);

        let report = |rank, error: Option<&str>| QuorumDone {
            rank,
            error: error.map(str::to_owned),
            stats: Default::default(),
        };
        let status = q.status("r", &id, WAIT);
        tokio::pin!(status);
        assert!(
            tokio::time::timeout(Duration::ZERO, &mut status)
                .await
                .is_err()
        );
        let s = q.done("r", &id, report(0, None)).unwrap();
        assert!(!s.complete);
        assert_eq!(
            q.done("r", &id, report(0, None)).unwrap_err().code,
            ErrorCode::Conflict
        );
        assert_eq!(
            q.done("r", &id, report(7, None)).unwrap_err().code,
            ErrorCode::InvalidRequest
        );
        q.done("r", &id, report(1, Some("boom"))).unwrap();
        let s = status.await.unwrap();
        assert!(s.complete);
        assert_eq!((s.world, s.done.as_slice()), (2, &[0][..]));
        assert_eq!(s.failed, [(1, "boom".to_owned())]);
        // Without a wait, the status is answered at once.
        assert_eq!(q.status("r", &id, Duration::ZERO).await.unwrap(), s);
    }

    #[tokio::test]
    async fn transfers_are_forgotten_after_they_are_kept() {
        let q = q();
        let w = window(Some(2), 60.0);
        let g = spawn(&q, "f", getter("a2", vec![key("k", 4)], &w));
        let p = q
            .join("f", putter("a1", vec![key("k", 4)], &w))
            .await
            .unwrap();
        answer(g).await.unwrap();
        let id = p.plan.id.clone();
        {
            let mut st = q.lock();
            let tr = st.transfer("f", &id).unwrap();
            let now = Instant::now();
            assert!(!tr.expired(now + KEEP_CLOSED - Duration::from_secs(1)));
            assert!(tr.expired(now + KEEP_CLOSED));
            tr.completed_at = Some(now);
            assert!(!tr.expired(now + KEEP_COMPLETE - Duration::from_secs(1)));
            assert!(tr.expired(now + KEEP_COMPLETE));
            st.gc(now + KEEP_COMPLETE);
        }
        assert_eq!(
            q.status("f", &id, Duration::ZERO).await.unwrap_err().code,
            ErrorCode::NotFound
        );
    }

    #[tokio::test]
    async fn shutdown_abandons_open_rounds() {
        let shutdown = CancellationToken::new();
        let q = Arc::new(Quorums::new(shutdown.clone()));
        let w = window(Some(2), 60.0);
        let g = spawn(&q, "s", getter("a2", vec![key("k", 4)], &w));
        members(&q, "s", 1).await;
        shutdown.cancel();
        let e = answer(g).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("shutting down"), "{}", e.message);
    }
}
