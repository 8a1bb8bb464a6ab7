//! The quorum coordinator of one metadata server: the open rounds and the
//! kept transfers behind one lock, and the members' waits on them (tokio
//! watch channels: a round's close, a transfer's rendezvous and reports).
//! What a round decides is the pure `round` module's.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kt_service::Metrics;
use kt_types::tensor::{QuorumDone, QuorumInfo, QuorumJoin, QuorumPlan, QuorumStatus, Rendezvous};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::round::{Access, ClosedBy, Closing, Member, QuorumError, Round, check_join, plan};

/// Most open rounds plus kept transfers; a join opening one more is 503.
pub const MAX_OPEN: usize = 10_000;
/// How long a transfer is kept after every rank reported.
pub const KEEP_COMPLETE: Duration = Duration::from_secs(600);
/// How long a transfer is kept after its close when some rank never reports.
pub const KEEP_CLOSED: Duration = Duration::from_secs(3600);
/// Largest rendezvous blob.
pub const MAX_BLOB_LEN: usize = 64 << 10;
const GC_EVERY: Duration = Duration::from_secs(1);
const MAX_ERROR_LEN: usize = 4096;

/// What the open joins may hold, so that no caller can exhaust the
/// server's memory or request slots with them: each open join is a long
/// poll (up to [`MAX_TIMEOUT_SECS`](super::MAX_TIMEOUT_SECS)) holding one
/// of the server's in-flight request slots and its decoded body. A join
/// past a limit is refused at once, 503 `unavailable`, naming the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinLimits {
    /// Most open joins of one agent (over every group; its processes
    /// each hold one per group they join).
    pub per_agent: usize,
    /// Most open joins in all: the server's other calls (heartbeats, key
    /// lookups, registrations) keep the rest of its request slots.
    pub joins: usize,
    /// Most bytes of joins (their bodies as received; decoded, about one
    /// to two times that) held by the open rounds together.
    pub bytes: usize,
}

impl JoinLimits {
    /// Default of [`JoinLimits::per_agent`]: a pod's processes in many
    /// groups at once, well under the server's slots.
    pub const PER_AGENT: usize = 64;
    /// Default of [`JoinLimits::bytes`]: with the body budget and the
    /// joins being decoded, within the metadata server's 512 MiB.
    pub const BYTES: usize = 128 << 20;

    /// The limits of a server serving `max_in_flight` requests at once:
    /// joins take at most three quarters of them.
    pub fn for_server(max_in_flight: usize) -> JoinLimits {
        JoinLimits {
            per_agent: Self::PER_AGENT,
            joins: max_in_flight - max_in_flight / 4,
            bytes: Self::BYTES,
        }
    }
}

impl Default for JoinLimits {
    fn default() -> Self {
        Self::for_server(kt_service::cli::DEFAULT_MAX_CONNECTIONS)
    }
}

/// What the open rounds' members hold, against [`JoinLimits`].
#[derive(Debug, Default)]
struct Held {
    joins: usize,
    bytes: usize,
    by_agent: HashMap<String, usize>,
}

impl Held {
    /// Counts `m`'s join, if `limits` leave room for it.
    fn hold(&mut self, limits: &JoinLimits, m: &Member) -> Result<(), QuorumError> {
        let (agent, bytes) = (&m.join.agent, m.access.bytes);
        let of_agent = self.by_agent.get(agent).copied().unwrap_or_default();
        let refuse = |why: String| Err(QuorumError::Unavailable(why));
        if of_agent >= limits.per_agent {
            return refuse(format!(
                "agent {agent} already has {of_agent} open quorum joins, the most one agent may \
                 hold; join again once some are answered"
            ));
        }
        if self.joins >= limits.joins {
            return refuse(format!(
                "{} quorum joins are open, the most this server holds at once (its other \
                 request slots are kept for other calls); try again later",
                self.joins
            ));
        }
        if self.bytes + bytes > limits.bytes {
            return refuse(format!(
                "the open quorum rounds hold {} bytes of joins; this join's {bytes} would pass \
                 the {} this server holds at once; try again later",
                self.bytes, limits.bytes
            ));
        }
        self.joins += 1;
        self.bytes += bytes;
        *self.by_agent.entry(agent.clone()).or_default() += 1;
        Ok(())
    }

    /// Forgets `m`'s join (it left, or its round closed). Saturating: it
    /// runs in a drop ([`Leave`]), where a panic would abort.
    fn release(&mut self, m: &Member) {
        self.joins = self.joins.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(m.access.bytes);
        if let Some(n) = self.by_agent.get_mut(&m.join.agent) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_agent.remove(&m.join.agent);
            }
        }
    }
}

/// An open round, and where its close is sent to its members.
#[derive(Debug)]
struct Open {
    round: Round,
    closed: watch::Sender<Option<Arc<Closing>>>,
}

#[derive(Debug)]
struct Transfer {
    world: u32,
    /// The agent of each rank (who may publish, read and report).
    agents: Vec<String>,
    closed_at: Instant,
    completed_at: Option<Instant>,
    rendezvous: watch::Sender<Option<String>>,
    /// Reports by rank: `None` for success, the error otherwise.
    reports: BTreeMap<u32, Option<String>>,
    /// Signalled on every report.
    reported: watch::Sender<()>,
}

impl Transfer {
    fn new(agents: Vec<String>, now: Instant) -> Transfer {
        Transfer {
            world: agents.len() as u32,
            agents,
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
    open: HashMap<String, Open>,
    /// By (group, transfer id).
    transfers: HashMap<(String, String), Transfer>,
    /// What the open rounds' members hold.
    held: Held,
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
    /// closing, and joins from now on open a new one. Its members' joins
    /// no longer count against the limits: they are answered now.
    fn take_round(&mut self, group: &str, id: u64) -> Option<Open> {
        if self.open.get(group).is_none_or(|o| o.round.id != id) {
            return None;
        }
        let open = self.open.remove(group)?;
        for m in &open.round.members {
            self.held.release(m);
        }
        Some(open)
    }

    fn transfer(&mut self, group: &str, id: &str) -> Result<&mut Transfer, QuorumError> {
        self.transfers
            .get_mut(&(group.to_owned(), id.to_owned()))
            .ok_or_else(|| {
                QuorumError::NotFound(format!(
                    "quorum {group} has no transfer {id} (unknown, or forgotten after it ended)"
                ))
            })
    }
}

/// The quorum coordinator of one metadata server.
/// How many quorums are in each state ([`Quorums::counts`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct QuorumCounts {
    pub open: usize,
    pub transferring: usize,
    pub complete: usize,
    pub failed: usize,
}

#[derive(Debug)]
pub struct Quorums {
    state: Mutex<Quorum>,
    /// Bumped whenever an open round gains or loses a member.
    membership: watch::Sender<u64>,
    shutdown: CancellationToken,
    metrics: Option<Arc<Metrics>>,
    limits: JoinLimits,
}

impl Quorums {
    /// A coordinator whose long polls end when `shutdown` is cancelled.
    pub fn new(shutdown: CancellationToken) -> Self {
        Quorums {
            state: Mutex::new(Quorum {
                open: HashMap::new(),
                transfers: HashMap::new(),
                held: Held::default(),
                next_seq: 0,
                last_gc: Instant::now(),
            }),
            membership: watch::channel(0).0,
            shutdown,
            metrics: None,
            limits: JoinLimits::default(),
        }
    }

    /// What open joins may hold (default: [`JoinLimits::default`]).
    pub fn with_limits(mut self, limits: JoinLimits) -> Self {
        self.limits = limits;
        self
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
    fn close(&self, group: &str, open: Open, by: ClosedBy) {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let closing = plan(group, &open.round, by, id.clone());
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
                let agents = plan.ranks.iter().map(|r| r.agent.clone()).collect();
                let tr = Transfer::new(agents, Instant::now());
                self.lock().transfers.insert((group.to_owned(), id), tr);
            }
            None => tracing::info!(
                group,
                closed_by = %by,
                members = open.round.members.len(),
                "quorum closed with nothing to move"
            ),
        }
        // Sent only now: no member knows the transfer before it is kept.
        open.closed.send_replace(Some(Arc::new(closing)));
    }

    /// Joins `group`'s open round (opening one if none is); answered when
    /// the round closes. Dropping the future before leaves the round.
    /// `access`: what the member may put and receive, and what it holds
    /// (see [`Access`]), within the coordinator's [`JoinLimits`].
    pub async fn join(
        &self,
        group: &str,
        join: QuorumJoin,
        access: Access,
    ) -> Result<QuorumPlan, QuorumError> {
        let ip = check_join(group, &join)?;
        let now = Instant::now();
        let (seq, round, mut closed, deadline, closing) = {
            let mut st = self.lock();
            st.gc(now);
            match st.open.get(group) {
                Some(o) => o.round.admit(group, &join)?,
                None if st.open.len() + st.transfers.len() >= MAX_OPEN => {
                    return Err(QuorumError::Unavailable(format!(
                        "{MAX_OPEN} quorum rounds and transfers are open or kept; try again later"
                    )));
                }
                None => {}
            }
            let seq = st.next_seq + 1;
            let member = Member {
                seq,
                ip,
                join,
                access,
            };
            st.held.hold(&self.limits, &member)?;
            st.next_seq = seq;
            let o = st.open.entry(group.to_owned()).or_insert_with(|| Open {
                round: Round::open(seq, &member.join, now.into_std()),
                closed: watch::channel(None).0,
            });
            let r = &mut o.round;
            tracing::debug!(group, agent = %member.join.agent, members = r.members.len() + 1, "quorum join");
            r.members.push(member);
            let (round, deadline, by) = (r.id, Instant::from_std(r.deadline), r.closes_now());
            let closed = o.closed.subscribe();
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
            match self.wait_for(&mut closed, deadline, Option::clone).await {
                Ok(c) => return c.answer(group, seq),
                Err(Ended::Shutdown) => {
                    return Err(QuorumError::Unavailable(format!(
                        "the metadata server is shutting down: quorum {group} is abandoned (join again once it is back)"
                    )));
                }
                Err(Ended::Dropped) => {
                    return Err(QuorumError::Internal(format!(
                        "the round of quorum {group} ended without an answer"
                    )));
                }
                Err(Ended::Deadline) => {
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
        let Some(r) = st
            .open
            .get_mut(group)
            .map(|o| &mut o.round)
            .filter(|r| r.id == round)
        else {
            return;
        };
        let Some(at) = r.members.iter().position(|m| m.seq == seq) else {
            return;
        };
        let gone = r.members.remove(at);
        tracing::info!(
            group,
            members = r.members.len(),
            "a quorum member went away before the close"
        );
        let empty = r.members.is_empty();
        st.held.release(&gone);
        if empty {
            st.open.remove(group);
        }
        drop(st);
        self.membership.send_modify(|n| *n += 1);
    }

    /// The agent of each rank of transfer `id` (the routes let only them
    /// publish, read the rendezvous and report).
    pub fn agents(&self, group: &str, id: &str) -> Result<Vec<String>, QuorumError> {
        let mut st = self.lock();
        st.gc(Instant::now());
        Ok(st.transfer(group, id)?.agents.clone())
    }

    /// `PUT …/rendezvous`: rank 0's bootstrap blob, once.
    pub fn publish(&self, group: &str, id: &str, r: Rendezvous) -> Result<(), QuorumError> {
        if r.blob.is_empty() || r.blob.len() > MAX_BLOB_LEN {
            return Err(QuorumError::Invalid(format!(
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
            Some(false) => Err(QuorumError::Conflict(format!(
                "transfer {id} of quorum {group} already has another rendezvous"
            ))),
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
    ) -> Result<Rendezvous, QuorumError> {
        let deadline = Instant::now() + wait;
        let mut rx = self.watch_transfer(group, id, |t| t.rendezvous.subscribe())?;
        match self.wait_for(&mut rx, deadline, Option::clone).await {
            Ok(blob) => Ok(Rendezvous { blob }),
            Err(Ended::Dropped) => Err(QuorumError::NotFound(format!(
                "transfer {id} of quorum {group} was forgotten"
            ))),
            Err(Ended::Deadline) => Err(QuorumError::Unavailable(format!(
                "rank 0 has not published the rendezvous of transfer {id} yet"
            ))),
            Err(Ended::Shutdown) => Err(QuorumError::Unavailable(
                "the metadata server is shutting down".into(),
            )),
        }
    }

    /// `POST …/done`: one rank's report.
    pub fn done(&self, group: &str, id: &str, d: QuorumDone) -> Result<QuorumStatus, QuorumError> {
        let now = Instant::now();
        let mut st = self.lock();
        st.gc(now);
        let tr = st.transfer(group, id)?;
        if d.rank >= tr.world {
            return Err(QuorumError::Invalid(format!(
                "rank {} is not in transfer {id} of quorum {group} ({} ranks)",
                d.rank, tr.world
            )));
        }
        if tr.reports.contains_key(&d.rank) {
            return Err(QuorumError::Conflict(format!(
                "rank {} already reported on transfer {id}",
                d.rank
            )));
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
    ) -> Result<QuorumStatus, QuorumError> {
        let deadline = Instant::now() + wait;
        let mut rx = self.watch_transfer(group, id, |t| t.reported.subscribe())?;
        loop {
            let s = self.lock().transfer(group, id)?.status(group, id);
            // Whatever ended the wait but a report: the status as it is.
            if s.complete || self.next_change(&mut rx, deadline).await.is_some() {
                return Ok(s);
            }
        }
    }

    /// Open rounds, transfers running (closed, not every rank reported),
    /// complete and failed kept transfers: the scrape-time gauges.
    pub fn counts(&self) -> QuorumCounts {
        let st = self.lock();
        let mut c = QuorumCounts {
            open: st.open.len(),
            ..QuorumCounts::default()
        };
        for t in st.transfers.values() {
            if !t.complete() {
                c.transferring += 1;
            } else if t.reports.values().any(Option::is_some) {
                c.failed += 1;
            } else {
                c.complete += 1;
            }
        }
        c
    }

    /// `GET /api/v1/quorums/{group}`: its open round and kept transfers.
    pub fn info(&self, group: &str) -> Result<QuorumInfo, QuorumError> {
        let now = Instant::now();
        let mut st = self.lock();
        st.gc(now);
        let open = st.open.get(group).map(|o| o.round.info(now.into_std()));
        let mut kept: Vec<(Instant, QuorumStatus)> = st
            .transfers
            .iter()
            .filter(|((g, _), _)| g == group)
            .map(|((g, id), tr)| (tr.closed_at, tr.status(g, id)))
            .collect();
        if open.is_none() && kept.is_empty() {
            return Err(QuorumError::NotFound(format!(
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

    /// A receiver of transfer `id`'s channel that `pick` subscribes to
    /// (after the sweep of what expired).
    fn watch_transfer<T>(
        &self,
        group: &str,
        id: &str,
        pick: impl FnOnce(&Transfer) -> watch::Receiver<T>,
    ) -> Result<watch::Receiver<T>, QuorumError> {
        let mut st = self.lock();
        st.gc(Instant::now());
        Ok(pick(st.transfer(group, id)?))
    }

    /// Waits for the next value on `rx` (a round's close, a transfer's
    /// rendezvous or reports), at most until `deadline`, and never past
    /// the server's shutdown. None: a value came; else what ended the wait.
    async fn next_change<T>(
        &self,
        rx: &mut watch::Receiver<T>,
        deadline: Instant,
    ) -> Option<Ended> {
        tokio::select! {
            r = rx.changed() => r.err().map(|_| Ended::Dropped),
            () = tokio::time::sleep_until(deadline) => Some(Ended::Deadline),
            () = self.shutdown.cancelled() => Some(Ended::Shutdown),
        }
    }

    /// What `ready` finds in `rx`'s value, checked now and on each change
    /// ([`Quorums::next_change`]) until it finds something.
    async fn wait_for<T, U>(
        &self,
        rx: &mut watch::Receiver<T>,
        deadline: Instant,
        ready: impl Fn(&T) -> Option<U>,
    ) -> Result<U, Ended> {
        loop {
            if let Some(u) = ready(&rx.borrow_and_update()) {
                return Ok(u);
            }
            if let Some(end) = self.next_change(rx, deadline).await {
                return Err(end);
            }
        }
    }

    /// Waits until `group`'s open round has `n` members (0: none is open).
    pub async fn wait_members(&self, group: &str, n: usize) {
        let mut rx = self.membership.subscribe();
        loop {
            let has = self
                .lock()
                .open
                .get(group)
                .map_or(0, |o| o.round.members.len());
            if has == n || rx.changed().await.is_err() {
                return;
            }
        }
    }
}

/// What ended a wait of [`Quorums::next_change`] before a value came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its sender is gone: the round or transfer was forgotten.
    Dropped,
    /// The deadline passed.
    Deadline,
    /// The server is shutting down.
    Shutdown,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quorum::fixtures::{getter, key, putter, window};
    use kt_types::ErrorCode;
    use kt_types::tensor::BackendKind;

    /// Longest wait for anything in these tests.
    const WAIT: Duration = Duration::from_secs(10);

    fn q() -> Arc<Quorums> {
        Arc::new(Quorums::new(CancellationToken::new()))
    }

    /// A join running in its own task.
    fn spawn(
        q: &Arc<Quorums>,
        group: &str,
        j: QuorumJoin,
    ) -> tokio::task::JoinHandle<Result<QuorumPlan, QuorumError>> {
        let (q, group) = (q.clone(), group.to_owned());
        tokio::spawn(async move { q.join(&group, j, Access::default()).await })
    }

    async fn members(q: &Quorums, group: &str, n: usize) {
        tokio::time::timeout(WAIT, q.wait_members(group, n))
            .await
            .unwrap_or_else(|_| panic!("{group} never had {n} members"));
    }

    async fn answer(
        h: tokio::task::JoinHandle<Result<QuorumPlan, QuorumError>>,
    ) -> Result<QuorumPlan, QuorumError> {
        tokio::time::timeout(WAIT, h)
            .await
            .expect("the join was answered")
            .expect("the join's task")
    }

    #[tokio::test]
    async fn a_round_closes_on_world_size_and_the_next_join_opens_another() {
        let q = q();
        let w = window(Some(3), 60.0);
        let g1 = spawn(&q, "grp", getter("a2", vec![key("k", 4)], &w));
        let g2 = spawn(&q, "grp", getter("a3", vec![key("k", 4)], &w));
        members(&q, "grp", 2).await;
        let p = q
            .join(
                "grp",
                putter("a1", vec![key("k", 4)], &w),
                Access::default(),
            )
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
            .join(
                "grp",
                putter("a1", vec![key("k", 4)], &w),
                Access::default(),
            )
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
            .join(
                "ips",
                putter("a1", vec![key("k", 4)], &w),
                Access::default(),
            )
            .await
            .unwrap();
        assert_eq!(p.closed_by, "ips");
        assert_eq!(answer(g).await.unwrap().rank, 1);

        let w = window(Some(10), 0.2);
        let g = spawn(&q, "late", getter("a2", vec![key("k", 4)], &w));
        let p = q
            .join(
                "late",
                putter("a1", vec![key("k", 4)], &w),
                Access::default(),
            )
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
            .join("c", getter("a1", vec![key("k", 4)], &w), Access::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict, "{e}");
        assert!(e.to_string().contains("one rank per process"), "{e}");
        // Another putter of k brings k's layout, or is refused.
        let e = q
            .join(
                "c",
                putter("a2", vec![key("j", 1), key("k", 5)], &w),
                Access::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert!(e.to_string().contains("a1 already puts it"), "{e}");
        let mut nccl = getter("a3", vec![key("k", 4)], &w);
        nccl.backend = BackendKind::Nccl;
        let e = q.join("c", nccl, Access::default()).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert!(e.to_string().contains("nccl"), "{e}");
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
            .join("c", getter("a4", vec![key("k", 4)], &w), Access::default())
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
        assert_eq!(q.info("d").unwrap_err().code(), ErrorCode::NotFound);
    }

    #[tokio::test]
    async fn rendezvous_and_completion_are_long_polled() {
        let q = q();
        let w = window(Some(2), 60.0);
        let g = spawn(&q, "r", getter("a2", vec![key("k", 4)], &w));
        let p = q
            .join("r", putter("a1", vec![key("k", 4)], &w), Access::default())
            .await
            .unwrap();
        answer(g).await.unwrap();
        let id = p.plan.id.clone();
        let e = q
            .rendezvous("r", &id, Duration::from_millis(20))
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable);
        assert!(e.to_string().contains("has not published"), "{e}");
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
            q.publish("r", &id, other).unwrap_err().code(),
            ErrorCode::Conflict
        );
        let e = q.rendezvous("r", "nope", WAIT).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);

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
            q.done("r", &id, report(0, None)).unwrap_err().code(),
            ErrorCode::Conflict
        );
        assert_eq!(
            q.done("r", &id, report(7, None)).unwrap_err().code(),
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
            .join("f", putter("a1", vec![key("k", 4)], &w), Access::default())
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
            q.status("f", &id, Duration::ZERO).await.unwrap_err().code(),
            ErrorCode::NotFound
        );
    }

    /// An agent past its open joins is refused while others still join;
    /// so is any join past the server's open joins or held bytes; a join
    /// answered or gone no longer counts.
    #[tokio::test]
    async fn joins_past_the_limits_are_refused_and_others_still_join() {
        let limits = JoinLimits {
            per_agent: 2,
            joins: 4,
            bytes: 100,
        };
        let q = Arc::new(Quorums::new(CancellationToken::new()).with_limits(limits));
        let w = window(Some(2), 60.0);
        let get = |agent| getter(agent, vec![key("k", 4)], &w);
        let sized = |bytes| Access {
            bytes,
            ..Access::default()
        };
        let g1 = spawn(&q, "g1", get("a1"));
        let _g2 = spawn(&q, "g2", get("a1"));
        members(&q, "g1", 1).await;
        members(&q, "g2", 1).await;
        let e = q
            .join("g3", get("a1"), Access::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable, "{e}");
        assert!(
            e.to_string()
                .contains("agent a1 already has 2 open quorum joins"),
            "{e}"
        );
        // Another agent joins, and closes g1: a1's join there is answered,
        // so a1 may join once more.
        let putter_a2 = putter("a2", vec![key("k", 4)], &w);
        q.join("g1", putter_a2, Access::default()).await.unwrap();
        answer(g1).await.unwrap();
        let _g3 = spawn(&q, "g3", get("a1"));
        members(&q, "g3", 1).await;
        // The bytes the open joins hold.
        let g4 = {
            let (q, j) = (q.clone(), get("a3"));
            tokio::spawn(async move { q.join("g4", j, sized(60)).await })
        };
        members(&q, "g4", 1).await;
        let e = q.join("g5", get("a4"), sized(60)).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable, "{e}");
        assert!(e.to_string().contains("hold 60 bytes of joins"), "{e}");
        // The server's open joins: four.
        let _g5 = spawn(&q, "g5", get("a4"));
        members(&q, "g5", 1).await;
        let e = q
            .join("g6", get("a5"), Access::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable, "{e}");
        assert!(e.to_string().contains("4 quorum joins are open"), "{e}");
        // A member that goes away frees its share.
        g4.abort();
        members(&q, "g4", 0).await;
        let _g6 = spawn(&q, "g6", get("a5"));
        members(&q, "g6", 1).await;
        let st = q.lock();
        let held = &st.held;
        assert_eq!((held.joins, held.bytes, held.by_agent["a1"]), (4, 0, 2));
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
        assert_eq!(e.code(), ErrorCode::Unavailable);
        assert!(e.to_string().contains("shutting down"), "{e}");
    }
}
