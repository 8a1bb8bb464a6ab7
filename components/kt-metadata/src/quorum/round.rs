//! Rounds and plans as a plain state machine: no I/O, no clock (callers pass
//! `now`), no locks or channels (the coordinator holds the rounds and wakes
//! their members).
//!
//! A [`Round`] is a group's open round: the settings its first join fixed,
//! and its members. [`check_join`] checks a join before it reaches any
//! round, [`Round::admit`] whether it fits the open one, [`Round::closes_now`]
//! whether its members close it, and [`plan`] what a closing round answers
//! every member ([`Closing`]). The rules are those of the module
//! documentation of [`crate::quorum`].

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kt_types::auth::Principal;
use kt_types::tensor::{
    self as t, BackendKind, Flow, Packing, QuorumJoin, QuorumKey, QuorumPlan, QuorumRole,
    QuorumRound, Rank, TransferPlan,
};
use kt_types::{ErrorCode, Key};

/// Longest quorum window.
pub const MAX_TIMEOUT_SECS: f64 = t::MAX_QUORUM_TIMEOUT_SECS;
const MAX_ENDPOINT_LEN: usize = 512;
const MAX_VERSION_LEN: usize = 256;
const MAX_KEYS: usize = 4096;
const MAX_IPS: usize = 4096;
/// Most ranks a held communicator may list.
const MAX_MEMBERS: usize = 4096;

/// Why a quorum request is refused, or a member of a closed round gets no
/// rank: its message, and ([`QuorumError::code`]) its error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuorumError {
    /// Bad input, a member on another backend, a destination that does not
    /// match its source.
    #[error("{0}")]
    Invalid(String),
    /// A second rank of one agent, a second putter of a key, another
    /// rendezvous, a second report.
    #[error("{0}")]
    Conflict(String),
    /// An unknown transfer or group; a wanted key no putter brings.
    #[error("{0}")]
    NotFound(String),
    /// A getter whose token may not read a key it wants.
    #[error("{0}")]
    Forbidden(String),
    /// The round closed with no putter.
    #[error("{0}")]
    NoSource(String),
    /// Nothing to move, too many rounds, no rendezvous yet, shutting down.
    #[error("{0}")]
    Unavailable(String),
    /// A bug.
    #[error("{0}")]
    Internal(String),
}

impl QuorumError {
    /// The error code the request is answered with.
    pub fn code(&self) -> ErrorCode {
        match self {
            QuorumError::Invalid(_) => ErrorCode::InvalidRequest,
            QuorumError::Conflict(_) => ErrorCode::Conflict,
            QuorumError::NotFound(_) => ErrorCode::NotFound,
            QuorumError::Forbidden(_) => ErrorCode::Forbidden,
            QuorumError::NoSource(_) => ErrorCode::NoSource,
            QuorumError::Unavailable(_) => ErrorCode::Unavailable,
            QuorumError::Internal(_) => ErrorCode::Internal,
        }
    }
}

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

/// A member of a round.
#[derive(Debug)]
pub(super) struct Member {
    /// Join sequence number: unique across rounds.
    pub(super) seq: u64,
    pub(super) ip: IpAddr,
    pub(super) join: QuorumJoin,
    pub(super) access: Access,
}

/// Who may receive what in a round, and how much its join holds, as the
/// join route found it (the plan is made only of members allowed to take
/// part).
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// A putter's keys, each with the service owning it (`None`: not
    /// registered when the putter joined).
    pub owners: HashMap<Key, Option<String>>,
    /// A getter whose token reads only some services; `None`: it reads
    /// every one.
    pub reader: Option<Principal>,
    /// The join's size as it came (its body's bytes): what the member's
    /// round holds for it until it closes ([`JoinLimits::bytes`]).
    ///
    /// [`JoinLimits::bytes`]: super::JoinLimits::bytes
    pub bytes: usize,
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

    /// Whether this getter wants `key` from the putter of rank `root`.
    fn wants(&self, key: &Key, root: u32) -> bool {
        !self.puts()
            && self.keys().iter().any(|k| {
                &k.key == key
                    && match &k.from {
                        Some(t::FromPutters::ByRank { ranks }) => ranks.contains(&root),
                        _ => true,
                    }
            })
    }

    /// `agent`, or `agent/member`.
    fn label(&self) -> String {
        t::member_label(&self.join.agent, &self.join.member)
    }

    /// Whether `j` comes from this member's process.
    fn same_member(&self, j: &QuorumJoin) -> bool {
        self.join.agent == j.agent && self.join.member == j.member
    }

    /// The order of ranks among putters (by first key, then pod, then
    /// process) and among getters (pod, then process).
    fn order(&self) -> (&Key, &str, &str) {
        (&self.keys()[0].key, &self.join.agent, &self.join.member)
    }
}

/// What a closed round answers its members (by join sequence).
#[derive(Debug)]
pub(super) struct Closing {
    by: ClosedBy,
    pub(super) plan: Option<Arc<TransferPlan>>,
    ranks: HashMap<u64, u32>,
    pub(super) errors: HashMap<u64, QuorumError>,
    /// The communicator the ranks reuse (see [`reusable`]).
    reuse: Option<String>,
}

impl Closing {
    /// The answer of the member of join sequence `seq`.
    pub(super) fn answer(&self, group: &str, seq: u64) -> Result<QuorumPlan, QuorumError> {
        if let Some(e) = self.errors.get(&seq) {
            return Err(e.clone());
        }
        match (self.ranks.get(&seq), &self.plan) {
            (Some(rank), Some(plan)) => Ok(QuorumPlan {
                group: group.to_owned(),
                rank: *rank,
                plan: Arc::clone(plan),
                closed_by: self.by.as_str().to_owned(),
                reuse: self.reuse.clone(),
            }),
            _ => Err(QuorumError::Internal(format!(
                "quorum {group} closed without an answer for this member"
            ))),
        }
    }

    /// Answers `e` to every member not answered yet.
    fn fail_rest(&mut self, members: &[Member], e: &QuorumError) {
        for m in members {
            self.errors.entry(m.seq).or_insert_with(|| e.clone());
        }
    }
}

/// A group's open round.
#[derive(Debug)]
pub(super) struct Round {
    /// The join sequence number of its first member.
    pub(super) id: u64,
    world_size: Option<u32>,
    ips: Vec<IpAddr>,
    /// When its timeout closes it.
    pub(super) deadline: Instant,
    fanout: u32,
    packing: Packing,
    backend: BackendKind,
    pub(super) members: Vec<Member>,
}

impl Round {
    /// A round opened by `j` (already checked) at `now`.
    pub(super) fn open(id: u64, j: &QuorumJoin, now: Instant) -> Round {
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
        }
    }

    /// Whether `j` may join this round.
    pub(super) fn admit(&self, group: &str, j: &QuorumJoin) -> Result<(), QuorumError> {
        if j.backend != self.backend {
            return Err(QuorumError::Invalid(format!(
                "quorum {group} moves {} data; a member on the {} backend cannot join it",
                match self.backend {
                    BackendKind::Host => "host",
                    BackendKind::Nccl => "GPU (nccl)",
                },
                j.backend
            )));
        }
        if let Some(m) = self.members.iter().find(|m| m.same_member(j)) {
            return Err(QuorumError::Conflict(format!(
                "{} already joined the open round of quorum {group} (one rank per process; \
                 another process of the pod takes a rank of its own)",
                m.label()
            )));
        }
        if let QuorumRole::Put { keys } = &j.role {
            // Several putters of a key each send their own tensors: all of
            // one layout, or no getter could take them into one destination.
            for k in keys {
                let other = self.members.iter().find_map(|m| {
                    m.puts()
                        .then(|| m.keys().iter().find(|o| o.key == k.key))
                        .flatten()
                        .map(|o| (m, o))
                });
                if let Some((m, o)) = other
                    && let Err(why) = t::check_destination(&k.key, &o.tensors, &k.tensors)
                {
                    return Err(QuorumError::Invalid(format!(
                        "{} cannot put {} in quorum {group}: {} already puts it, and every \
                         putter of a key brings the same layout ({} is its source, this \
                         putter the destination: {why})",
                        t::member_label(&j.agent, &j.member),
                        k.key,
                        m.label(),
                        m.label()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Why the round closes now, if it does (before its timeout).
    pub(super) fn closes_now(&self) -> Option<ClosedBy> {
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

    /// What `GET /api/v1/quorums/{group}` shows of it at `now`.
    pub(super) fn info(&self, now: Instant) -> QuorumRound {
        QuorumRound {
            members: self.members.iter().map(Member::label).collect(),
            backend: self.backend,
            world_size: self.world_size,
            ips: self.ips.iter().map(IpAddr::to_string).collect(),
            closes_in_ms: millis(self.deadline.saturating_duration_since(now)),
        }
    }
}

/// The answers of a round closing now, by `by`; `id` names its transfer.
pub(super) fn plan(group: &str, round: &Round, by: ClosedBy, id: String) -> Closing {
    let mut closing = Closing {
        by,
        plan: None,
        ranks: HashMap::new(),
        errors: HashMap::new(),
        reuse: None,
    };
    let (mut putters, mut wanting): (Vec<&Member>, Vec<&Member>) =
        round.members.iter().partition(|m| m.puts());
    // Ranks do not depend on who joined first: putters by their first key,
    // then pod, then process; getters by pod, then process (one rank per
    // process), so the same members always make the same plan.
    putters.sort_by(|a, b| a.order().cmp(&b.order()));
    wanting.sort_by(|a, b| {
        a.order()
            .1
            .cmp(b.order().1)
            .then(a.order().2.cmp(b.order().2))
    });
    if putters.is_empty() {
        let e = QuorumError::NoSource(format!("quorum {group} closed by {by} with no putter"));
        closing.fail_rest(&round.members, &e);
        return closing;
    }
    // Each key's putters, by rank (a putter's rank is its index).
    let mut sources: HashMap<&Key, Vec<(u32, &Member, &QuorumKey)>> = HashMap::new();
    for (rank, p) in putters.iter().enumerate() {
        for k in p.keys() {
            sources.entry(&k.key).or_default().push((rank as u32, p, k));
        }
    }
    let owners: HashMap<&Key, Option<&str>> = putters
        .iter()
        .flat_map(|p| &p.access.owners)
        .map(|(k, s)| (k, s.as_deref()))
        .collect();
    let mut getters = Vec::new();
    for g in wanting {
        match can_receive(group, g, &sources).and_then(|()| may_read(group, g, &owners)) {
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
                .filter(|(_, g)| g.wants(&k.key, root as u32))
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
        let e = QuorumError::Unavailable(format!(
            "quorum {group} closed by {by} {why}: there is nothing to move"
        ));
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
                member: m.join.member.clone(),
                ip: m.join.ip.clone(),
                endpoint: m.join.endpoint.clone(),
                node: m.join.node.clone(),
            })
            .collect(),
        flows,
        packing: round.packing,
        fanout: round.fanout,
    };
    if let Err(e) = plan.validate() {
        let e = QuorumError::Internal(format!("quorum {group} made an invalid plan (a bug): {e}"));
        closing.fail_rest(&round.members, &e);
        return closing;
    }
    closing.ranks = ranked
        .iter()
        .enumerate()
        .map(|(i, m)| (m.seq, i as u32))
        .collect();
    if plan.backend == BackendKind::Nccl {
        closing.reuse = reusable(&ranked, &plan);
    }
    closing.plan = Some(Arc::new(plan));
    closing
}

/// A communicator every ranked member keeps for exactly the plan's ranks
/// (NCCL's take 0.1 to several seconds to build; a group that moves the
/// same members' weights every step reuses one). The first member's order
/// breaks ties.
fn reusable(ranked: &[&Member], plan: &TransferPlan) -> Option<String> {
    let held_by = |m: &Member, id: &str| m.join.comms.iter().any(|c| c.id == id && c.fits(plan));
    ranked
        .first()?
        .join
        .comms
        .iter()
        .map(|c| c.id.as_str())
        .find(|id| ranked.iter().all(|m| held_by(m, id)))
        .map(str::to_owned)
}

/// Whether getter `g` can receive every key it wants from the round's
/// putters (`sources`: each key's, by rank): the layouts match, and a key
/// several putters put is asked for as all of them, some by rank, or a
/// reduction.
fn can_receive(
    group: &str,
    g: &Member,
    sources: &HashMap<&Key, Vec<(u32, &Member, &QuorumKey)>>,
) -> Result<(), QuorumError> {
    for want in g.keys() {
        let srcs = sources.get(&want.key).ok_or_else(|| {
            QuorumError::NotFound(format!("no member of quorum {group} puts key {}", want.key))
        })?;
        // Every putter of a key brings one layout (checked as they join).
        t::check_destination(&want.key, &srcs[0].2.tensors, &want.tensors)
            .map_err(QuorumError::Invalid)?;
        let putters = || {
            let v: Vec<String> = srcs
                .iter()
                .map(|(r, m, _)| format!("{r} ({})", m.label()))
                .collect();
            v.join(", ")
        };
        match &want.from {
            None if srcs.len() > 1 => {
                return Err(QuorumError::Conflict(format!(
                    "key {} has {} putters in quorum {group} (ranks {}): a getter of one \
                     tensor set cannot take them all; ask for every putter's (dest a list, \
                     or a dict by rank) or for a reduction (reduce=\"sum\" or \"mean\")",
                    want.key,
                    srcs.len(),
                    putters()
                )));
            }
            Some(t::FromPutters::All { count }) if *count as usize != srcs.len() => {
                return Err(QuorumError::Invalid(format!(
                    "key {} has {} putters in quorum {group} (ranks {}), the destination \
                     lists {count} tensor sets",
                    want.key,
                    srcs.len(),
                    putters()
                )));
            }
            Some(t::FromPutters::ByRank { ranks }) => {
                if let Some(r) = ranks.iter().find(|r| !srcs.iter().any(|(s, _, _)| s == *r)) {
                    return Err(QuorumError::Invalid(format!(
                        "rank {r} does not put key {} in quorum {group} (its putters are \
                         ranks {})",
                        want.key,
                        putters()
                    )));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Whether getter `g`'s token reads the service of every key it wants
/// (checked before the plan is made: a refused getter never takes a rank,
/// so no other member ever sends it anything).
fn may_read(
    group: &str,
    g: &Member,
    owners: &HashMap<&Key, Option<&str>>,
) -> Result<(), QuorumError> {
    let Some(reader) = &g.access.reader else {
        return Ok(());
    };
    for want in g.keys() {
        let why = match owners.get(&want.key).copied().flatten() {
            Some(service) => reader.refuses_read(&want.key, service),
            None => Some(format!(
                "key {} was not registered when its putter joined quorum {group}, so its \
                 service is unknown, and this token reads only some services",
                want.key
            )),
        };
        if let Some(why) = why {
            return Err(QuorumError::Forbidden(why));
        }
    }
    Ok(())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn bad(msg: impl Into<String>) -> QuorumError {
    QuorumError::Invalid(msg.into())
}

fn bounded_text(what: &str, s: &str, max: usize) -> Result<(), QuorumError> {
    if s.is_empty() || s.len() > max || s.chars().any(char::is_control) {
        return Err(bad(format!(
            "{what} must be 1 to {max} bytes without control characters, got {s:?}"
        )));
    }
    Ok(())
}

/// Checks a join (nothing changes when it fails); the member's IP.
pub(super) fn check_join(group: &str, j: &QuorumJoin) -> Result<IpAddr, QuorumError> {
    kt_types::broadcast::check_group_id(group).map_err(bad)?;
    if let Some(why) = kt_types::agent_id_problem(&j.agent) {
        return Err(bad(why));
    }
    if !j.member.is_empty()
        && let Some(why) = t::member_id_problem(&j.member)
    {
        return Err(bad(why));
    }
    let ip =
        j.ip.parse::<IpAddr>()
            .map_err(|_| bad(format!("member ip {:?} is not an IP address", j.ip)))?;
    bounded_text("endpoint", &j.endpoint, MAX_ENDPOINT_LEN)?;
    if !j.node.is_empty()
        && let Some(why) = t::node_name_problem(&j.node)
    {
        return Err(bad(why));
    }
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
    if j.comms.len() > t::MAX_HELD_COMMS {
        return Err(bad(format!(
            "comms lists {} communicators, more than {}",
            j.comms.len(),
            t::MAX_HELD_COMMS
        )));
    }
    for c in &j.comms {
        bounded_text("a held communicator's id", &c.id, MAX_ENDPOINT_LEN)?;
        if c.members.len() < 2 || c.members.len() > MAX_MEMBERS {
            return Err(bad(format!(
                "held communicator {}: {} members (2 to {MAX_MEMBERS})",
                c.id,
                c.members.len()
            )));
        }
        if let Some(why) = c.members.iter().find_map(|m| label_problem(m)) {
            return Err(bad(format!("held communicator {}: {why}", c.id)));
        }
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
        match (&j.role, &k.from) {
            (QuorumRole::Put { .. }, Some(_)) => {
                return Err(bad(format!(
                    "{}: a putter brings one tensor set; `from` is a getter's",
                    k.key
                )));
            }
            (QuorumRole::Get { .. }, Some(from)) => from.check(&k.key, &k.tensors).map_err(bad)?,
            _ => {}
        }
    }
    Ok(ip)
}

/// Why a held communicator's member label (`agent` or `agent/member`) is
/// not valid, if it is not.
fn label_problem(label: &str) -> Option<String> {
    let (agent, member) = label.split_once('/').unwrap_or((label, ""));
    kt_types::agent_id_problem(agent).or_else(|| {
        (label.contains('/'))
            .then(|| t::member_id_problem(member))
            .flatten()
    })
}

fn check_key(k: &QuorumKey) -> Result<(), QuorumError> {
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
    use crate::quorum::fixtures::{getter, key, putter, window};
    use kt_types::tensor::HeldComm;

    /// A round of these members (join order), as if they had joined.
    fn round(joins: Vec<QuorumJoin>) -> Round {
        let mut r = Round::open(1, &joins[0], Instant::now());
        for (i, join) in joins.into_iter().enumerate() {
            let ip = join.ip.parse().unwrap();
            r.members.push(Member {
                seq: i as u64 + 1,
                ip,
                join,
                access: Access::default(),
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

    /// Members on two nodes, two pods each: every rank carries the node
    /// its agent reported, and the plan groups them by node; a member of
    /// unknown node shares it with no one.
    #[test]
    fn plans_say_which_members_share_a_node() {
        let w = window(None, 5.0);
        let on = |node: &str, mut j: QuorumJoin| {
            j.node = node.into();
            j
        };
        let r = round(vec![
            on("node-b", getter("a3", vec![key("x", 4)], &w)),
            on("node-a", putter("a1", vec![key("x", 4)], &w)),
            on("node-b", getter("a4", vec![key("x", 4)], &w)),
            on("node-a", getter("a2", vec![key("x", 4)], &w)),
            getter("a5", vec![key("x", 4)], &w),
        ]);
        check_join("g", &r.members[0].join).unwrap();
        let c = plan("g", &r, ClosedBy::Timeout, "tid".into());
        let p = c.plan.as_ref().unwrap();
        let placed: Vec<(&str, &str)> = p
            .ranks
            .iter()
            .map(|r| (r.agent.as_str(), r.node.as_str()))
            .collect();
        assert_eq!(
            placed,
            [
                ("a1", "node-a"),
                ("a2", "node-a"),
                ("a3", "node-b"),
                ("a4", "node-b"),
                ("a5", "")
            ]
        );
        assert_eq!(p.nodes(), [("node-a", vec![0, 1]), ("node-b", vec![2, 3])]);
        assert!(p.same_node(2, 3) && !p.same_node(1, 2) && !p.same_node(4, 4));
        // Older agents send no node, and the plan then names none.
        let json = serde_json::to_value(&p.ranks[4]).unwrap();
        assert!(json.get("node").is_none(), "{json}");
    }

    /// A getter whose token reads only some services takes no rank for a
    /// key of another service, nor for one whose service is unknown; the
    /// round goes on without it.
    #[test]
    fn getters_receive_only_what_their_tokens_read() {
        use kt_types::auth::{Principal, Role};
        let w = window(None, 5.0);
        let mut r = round(vec![
            putter("a1", vec![key("train/w", 4)], &w),
            putter("a2", vec![key("unregistered", 4)], &w),
            getter("a3", vec![key("train/w", 4)], &w),
            getter("a4", vec![key("train/w", 4)], &w),
            getter("a5", vec![key("unregistered", 4)], &w),
            getter("a6", vec![key("unregistered", 4)], &w),
        ]);
        let reader = |services: &[&str]| {
            Some(Principal {
                role: Role::Workload,
                services: Some(services.iter().map(|s| s.to_string()).collect()),
                reads: Some(Vec::new()),
                ..Principal::admin()
            })
        };
        let k = |s: &str| Key::parse(s).unwrap();
        r.members[0].access.owners = HashMap::from([(k("train/w"), Some("train".into()))]);
        r.members[1].access.owners = HashMap::from([(k("unregistered"), None)]);
        // a3 writes and so reads train; a4 reads only eval; a5 reads only
        // eval and wants a key of no known service; a6 reads every service.
        r.members[2].access.reader = reader(&["train"]);
        r.members[3].access.reader = reader(&["eval"]);
        r.members[4].access.reader = reader(&["eval"]);
        let c = plan("g", &r, ClosedBy::Timeout, "tid".into());
        let p = c.plan.as_ref().unwrap();
        let agents: Vec<&str> = p.ranks.iter().map(|r| r.agent.as_str()).collect();
        assert_eq!(agents, ["a1", "a2", "a3", "a6"]);
        let e = c.answer("g", 4).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Forbidden);
        assert!(
            e.to_string().contains("belongs to service \"train\""),
            "{e}"
        );
        let e = c.answer("g", 5).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Forbidden);
        assert!(e.to_string().contains("service is unknown"), "{e}");
    }

    /// NCCL rounds reuse a communicator every member keeps for exactly
    /// the plan's ranks; nothing else does.
    #[test]
    fn a_communicator_every_rank_keeps_is_reused() {
        let w = window(None, 5.0);
        let held = |id: &str, members: &[&str]| HeldComm {
            id: id.into(),
            members: members.iter().map(|m| m.to_string()).collect(),
        };
        let joins = |comms: [Vec<HeldComm>; 3], backend| {
            let mut v = vec![
                getter("a1", vec![key("x", 4)], &w),
                putter("a2", vec![key("x", 4)], &w),
                getter("a3", vec![key("x", 4)], &w),
            ];
            for (j, c) in v.iter_mut().zip(comms) {
                j.comms = c;
                j.backend = backend;
            }
            v
        };
        let reuse = |comms, backend| {
            let c = plan(
                "g",
                &round(joins(comms, backend)),
                ClosedBy::Timeout,
                "t".into(),
            );
            c.answer("g", 1).unwrap().reuse
        };
        let ranks = ["a2", "a1", "a3"];
        let all = || {
            [
                vec![held("c1", &ranks)],
                vec![held("c1", &ranks)],
                vec![held("c1", &ranks)],
            ]
        };
        assert_eq!(reuse(all(), BackendKind::Nccl).as_deref(), Some("c1"));
        // The host backend connects per transfer.
        assert_eq!(reuse(all(), BackendKind::Host), None);
        // One member lacks it (restarted, evicted, busy).
        let mut some = all();
        some[2].clear();
        assert_eq!(reuse(some, BackendKind::Nccl), None);
        // Same id, other ranks: another member set, or another order.
        let mut other = all();
        other[0] = vec![held("c1", &["a1", "a2", "a3"])];
        assert_eq!(reuse(other, BackendKind::Nccl), None);
        // Of several, the one all share.
        let mut two = all();
        two[0].insert(0, held("c0", &ranks));
        two[1] = vec![held("c0", &ranks)];
        two[2] = vec![held("c9", &ranks), held("c0", &ranks), held("c1", &ranks)];
        assert_eq!(reuse(two, BackendKind::Nccl).as_deref(), Some("c0"));
    }

    /// `join` as process `member` of its pod.
    fn of(member: &str, mut join: QuorumJoin) -> QuorumJoin {
        join.member = member.into();
        join
    }

    fn wanting(mut join: QuorumJoin, from: t::FromPutters) -> QuorumJoin {
        if let QuorumRole::Get { keys } = &mut join.role {
            for k in keys {
                k.from = Some(from.clone());
            }
        }
        join
    }

    /// Two pods of four processes, each putting `g`: eight ranks, putters
    /// by pod then process whatever the join order, one flow each; getters
    /// of every putter, some by rank, or a reduction, receive the flows
    /// they asked for.
    #[test]
    fn processes_of_a_pod_take_ranks_of_their_own_and_putters_of_a_key_a_flow_each() {
        let w = window(None, 5.0);
        let mut joins = Vec::new();
        for pod in ["b9", "a9"] {
            for m in ["3", "1", "2", "0"] {
                joins.push(of(m, putter(pod, vec![key("g", 4)], &w)));
            }
        }
        joins.push(of(
            "7",
            wanting(
                getter("r1", vec![key("g", 4)], &w),
                t::FromPutters::All { count: 8 },
            ),
        ));
        joins.push(of(
            "7",
            wanting(
                getter("r2", vec![key("g", 4)], &w),
                t::FromPutters::ByRank { ranks: vec![1, 6] },
            ),
        ));
        joins.push(of(
            "8",
            wanting(
                getter("r1", vec![key("g", 4)], &w),
                t::FromPutters::Reduce {
                    op: t::ReduceOp::Sum,
                },
            ),
        ));
        let shape = |joins: Vec<QuorumJoin>| {
            let c = plan("g", &round(joins), ClosedBy::WorldSize, "t".into());
            assert!(c.errors.is_empty(), "{:?}", c.errors);
            let p = c.plan.expect("a plan");
            let ranks: Vec<String> = p.ranks.iter().map(Rank::label).collect();
            let flows: Vec<(u32, Vec<u32>)> = p
                .flows
                .iter()
                .map(|f| (f.root, f.receivers.clone()))
                .collect();
            (ranks, flows)
        };
        let (ranks, flows) = shape(joins.clone());
        assert_eq!(
            ranks,
            [
                "a9/0", "a9/1", "a9/2", "a9/3", "b9/0", "b9/1", "b9/2", "b9/3", "r1/7", "r1/8",
                "r2/7"
            ]
        );
        let want: Vec<(u32, Vec<u32>)> = (0..8)
            .map(|root| {
                let by_rank = [1, 6].contains(&root);
                (root, if by_rank { vec![8, 9, 10] } else { vec![8, 9] })
            })
            .collect();
        assert_eq!(flows, want);
        joins.reverse();
        assert_eq!(shape(joins), (ranks, flows));
    }

    /// A plain getter of a key several putters put is refused, naming the
    /// ways to ask; so is one asking for another number of putters, or a
    /// rank that does not put the key. The others go on.
    #[test]
    fn getters_of_several_putters_ask_for_all_of_them_some_or_a_reduction() {
        let w = window(None, 5.0);
        let r = round(vec![
            of("1", putter("a1", vec![key("g", 4)], &w)),
            of("2", putter("a1", vec![key("g", 4)], &w)),
            putter("a2", vec![key("h", 4)], &w),
            getter("a3", vec![key("g", 4)], &w),
            wanting(
                getter("a4", vec![key("g", 4)], &w),
                t::FromPutters::All { count: 3 },
            ),
            wanting(
                getter("a5", vec![key("g", 4)], &w),
                t::FromPutters::ByRank { ranks: vec![2] },
            ),
            wanting(
                getter("a6", vec![key("g", 4)], &w),
                t::FromPutters::All { count: 2 },
            ),
            // One putter: a reduction of one is its tensor.
            wanting(
                getter("a7", vec![key("h", 4)], &w),
                t::FromPutters::Reduce {
                    op: t::ReduceOp::Mean,
                },
            ),
        ]);
        let c = plan("g", &r, ClosedBy::Timeout, "t".into());
        let e = c.answer("g", 4).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        let m = e.to_string();
        assert!(
            m.contains("2 putters") && m.contains("0 (a1/1), 1 (a1/2)") && m.contains("reduce"),
            "{m}"
        );
        let e = c.answer("g", 5).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        assert!(e.to_string().contains("lists 3 tensor sets"), "{e}");
        let e = c.answer("g", 6).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        assert!(e.to_string().contains("rank 2 does not put key g"), "{e}");
        let p = c.plan.as_ref().unwrap();
        let ranks: Vec<String> = p.ranks.iter().map(Rank::label).collect();
        assert_eq!(ranks, ["a1/1", "a1/2", "a2", "a6", "a7"]);
        assert_eq!(c.answer("g", 7).unwrap().rank, 3);
        assert_eq!(c.answer("g", 8).unwrap().rank, 4);
    }

    /// One process joins a round once; another process of the pod takes
    /// a rank of its own; a putter of another layout than the key's first
    /// putter is refused at once, naming both.
    #[test]
    fn a_process_joins_once_and_putters_of_a_key_bring_one_layout() {
        let w = window(None, 5.0);
        let r = round(vec![of("1", putter("a1", vec![key("g", 4)], &w))]);
        let e = r
            .admit("q", &of("1", getter("a1", vec![key("g", 4)], &w)))
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        assert!(e.to_string().contains("a1/1 already joined"), "{e}");
        r.admit("q", &of("2", getter("a1", vec![key("g", 4)], &w)))
            .unwrap();
        r.admit("q", &of("2", putter("a1", vec![key("g", 4)], &w)))
            .unwrap();
        let e = r
            .admit("q", &of("2", putter("a2", vec![key("g", 5)], &w)))
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        let m = e.to_string();
        assert!(
            m.contains("a2/2")
                && m.contains("a1/1")
                && m.contains("f32[4]")
                && m.contains("f32[5]"),
            "{m}"
        );
        // A putter asks for nothing; a getter's reduction must exist for
        // its dtype; a member id is checked.
        let mut j = putter("a1", vec![key("g", 4)], &w);
        if let QuorumRole::Put { keys } = &mut j.role {
            keys[0].from = Some(t::FromPutters::All { count: 2 });
        }
        assert!(
            check_join("q", &j)
                .unwrap_err()
                .to_string()
                .contains("getter's")
        );
        let mut k = key("g", 4);
        k.tensors[0].meta.dtype = t::DType::Bool;
        let j = wanting(
            getter("a1", vec![k], &w),
            t::FromPutters::Reduce {
                op: t::ReduceOp::Sum,
            },
        );
        assert!(
            check_join("q", &j)
                .unwrap_err()
                .to_string()
                .contains("bool")
        );
        let j = wanting(
            getter("a1", vec![key("g", 4)], &w),
            t::FromPutters::ByRank { ranks: vec![2, 1] },
        );
        assert!(
            check_join("q", &j)
                .unwrap_err()
                .to_string()
                .contains("ascending")
        );
        let j = of("pid/1", getter("a1", vec![key("g", 4)], &w));
        assert!(
            check_join("q", &j)
                .unwrap_err()
                .to_string()
                .contains("member id")
        );
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
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        assert!(
            e.to_string().contains("f32[4]") && e.to_string().contains("f32[5]"),
            "{e}"
        );
        let e = c.answer("g", 3).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(e.to_string(), "no member of quorum g puts key other");
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
            assert_eq!(e.code(), ErrorCode::NoSource);
            assert_eq!(e.to_string(), "quorum g closed by timeout with no putter");
        }
        assert!(c.plan.is_none());
        // Putters only.
        let r = round(vec![
            putter("a1", vec![key("k", 4)], &w),
            putter("a2", vec![key("j", 4)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::WorldSize, "t".into());
        let e = c.answer("g", 2).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable);
        assert!(e.to_string().contains("no getter"), "{e}");
        // The only getter is refused: it keeps its own error, the putter
        // gets unavailable.
        let r = round(vec![
            putter("a1", vec![key("k", 4)], &w),
            getter("a2", vec![key("k", 3)], &w),
        ]);
        let c = plan("g", &r, ClosedBy::Ips, "t".into());
        assert_eq!(
            c.answer("g", 2).unwrap_err().code(),
            ErrorCode::InvalidRequest
        );
        let e = c.answer("g", 1).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable);
        assert!(e.to_string().contains("none of its getters"), "{e}");
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
            access: Access::default(),
        });
        assert_eq!(r.closes_now(), Some(ClosedBy::Ips));
        r.ips.clear();
        assert_eq!(r.closes_now(), None);
        r.members.push(Member {
            seq: 3,
            ip: "10.0.0.3".parse().unwrap(),
            join: getter("a3", vec![key("k", 4)], &w),
            access: Access::default(),
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
        for agent in ["", "store", "pod a"] {
            let mut j = ok.clone();
            j.agent = agent.into();
            cases.push(("g", j, "agent id"));
        }
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
        let too_long = "n".repeat(254);
        for node in ["Node-A", "-a", "a b", "a/b", too_long.as_str()] {
            let mut j = ok.clone();
            j.node = node.into();
            cases.push(("g", j, "node name"));
        }
        let held = |members: &[&str]| HeldComm {
            id: "c".into(),
            members: members.iter().map(|m| m.to_string()).collect(),
        };
        let mut j = ok.clone();
        j.comms = vec![held(&["a1", "a2"]); 9];
        cases.push(("g", j, "more than 8"));
        let mut j = ok.clone();
        j.comms = vec![held(&["a1"])];
        cases.push(("g", j, "1 members"));
        let mut j = ok.clone();
        j.comms = vec![held(&["a1", "pod a"])];
        cases.push(("g", j, "held communicator c"));
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
            assert_eq!(e.code(), ErrorCode::InvalidRequest);
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
    }
}
