//! Broadcast groups as a plain state machine: no I/O, no clock (callers pass
//! `now_ms`), no randomness (callers pass the ids of unnamed groups).
//!
//! The protocol is [`kt_types::broadcast`]'s; this module decides what the
//! server answers. A group is a tree over ranks: rank 0 is the key's origin,
//! rank `r > 0` fetches from [`parent_rank`]`(r)` or, when that member cannot
//! serve, the nearest ancestor that can. A member can serve (is *usable*)
//! while it is downloading and connected (it relays what it has), or once it
//! is done: from its relay until it is released, from its agent
//! (`served_by`) after that. The origin is always usable, except for a getter
//! that reported it failed; such a getter is handed a finished member.
//!
//! Every operation returns the messages it makes due, as `(rank, message)`
//! pairs of one group: [`GroupMessage::Parent`] for the downloading children
//! of a member that can no longer serve them, and [`GroupMessage::Release`]
//! for a finished, connected member none of whose children still downloads.
//!
//! A connection is a *session*: a rejoin on a new connection supersedes the
//! old one, whose later reports (and its close) are then ignored.
//!
//! Persistence: a [`GroupRecord`] (no members) is written when a group is
//! created and whenever its rank reservation grows, [`RANK_BLOCK`] ranks at a
//! time: a rank is only handed out below a committed reservation. A group
//! keeps a block reserved ahead of the one in use: when the last block
//! starts, [`Joined::reserve_ahead`] asks for the next one, which the caller
//! commits in the background and acknowledges
//! ([`Groups::reservation_committed`]), so joins never wait on the disk
//! unless they outrun it (then [`Joined::persist`] must be committed before
//! the answer). After a restart ([`Groups::restore`]) groups come back empty, new
//! joiners get ranks from the reservation on (never a rank a member that has
//! not rejoined yet holds), and rejoins rebuild the members. For
//! [`RESTORE_HOLD_MS`] after a restart no member is released: its children
//! may not have rejoined yet (a member released too early costs a child that
//! still fetched from it a parent switch, no data).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, UNIX_EPOCH};

use kt_types::broadcast::{
    DEFAULT_FANOUT, DEFAULT_WINDOW_MS, GroupInfo, GroupMessage, JoinRequest, MemberInfo,
    MemberState, Parent, Rejoin, auto_fanout, check_group_id, parent_rank,
};
use kt_types::{ErrorCode, Key};
use serde::{Deserialize, Serialize};

/// Largest fanout a group may have.
pub const MAX_FANOUT: u32 = 10_000;
/// Longest join window a group may have.
pub const MAX_WINDOW_MS: u64 = 24 * 3600 * 1000;
/// Ranks reserved (and persisted) at a time.
pub const RANK_BLOCK: u32 = 256;
/// How long a group with no connected member is kept after its window
/// closed (and, after a restart, how long members have to rejoin before
/// finished ones are released).
pub const REJOIN_GRACE_MS: u64 = 60_000;
/// How long after a restart finished members are not released, while the
/// members reconnect.
pub const RESTORE_HOLD_MS: u64 = 5_000;
/// How long the id of a finished named group keeps being refused.
pub const FINISHED_TTL_MS: u64 = 24 * 3600 * 1000;
/// Groups held at most, ended named ones included (as quorums'
/// `MAX_OPEN`): a new group past it is refused as unavailable.
pub const MAX_GROUPS: usize = 10_000;

/// Why a join (or a member's next parent) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    NoSource(String),
    /// Too many groups are held: retried later.
    #[error("{0}")]
    Unavailable(String),
}

impl JoinError {
    /// The error code the getter is sent.
    pub fn code(&self) -> ErrorCode {
        match self {
            JoinError::Invalid(_) => ErrorCode::InvalidRequest,
            JoinError::Conflict(_) => ErrorCode::Conflict,
            JoinError::NotFound(_) => ErrorCode::NotFound,
            JoinError::NoSource(_) => ErrorCode::NoSource,
            JoinError::Unavailable(_) => ErrorCode::Unavailable,
        }
    }

    /// The [`GroupMessage::Error`] that tells the getter.
    pub fn message(&self) -> GroupMessage {
        GroupMessage::Error {
            code: self.code(),
            message: self.to_string(),
        }
    }
}

/// What is persisted of a group: everything but its members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub id: String,
    pub key: Key,
    pub version: String,
    pub fanout: u32,
    pub origin: Parent,
    pub created_ms: u64,
    pub window_ms: u64,
    pub named: bool,
    /// Ranks below this one may have been handed out (it never shrinks).
    pub reserved: u32,
    /// The fanout was kt's choice, by the payload's size ([`auto_fanout`]),
    /// not the first getter's: a later getter naming another joins anyway.
    #[serde(default)]
    pub auto_fanout: bool,
    /// The key members' secrets are made with (hex, 32 bytes): a rejoin
    /// after a restart is checked with it. Empty in groups an older server
    /// made (their rejoins are not checked).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_key: String,
}

/// A fresh key for a group's member secrets, from four fresh ids (the
/// server's are random: UUID v4 bits).
fn fresh_key(make_id: &mut dyn FnMut() -> u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    for part in k.chunks_exact_mut(8) {
        part.copy_from_slice(&make_id().to_le_bytes());
    }
    // Spread whatever the ids share (a UUID's fixed version bits).
    *blake3::hash(&k).as_bytes()
}

/// The secret of rank `rank` of group `group` under `key`.
fn member_secret(key: &[u8; 32], group: &str, rank: u32) -> blake3::Hash {
    blake3::keyed_hash(key, format!("{group}\0{rank}").as_bytes())
}

/// How long a parent that failed a member transiently is not handed to
/// it again.
pub const PAUSE_MS: u64 = 30_000;

/// A member's report that its parent failed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentFailure {
    /// The parent's rank.
    pub parent: u32,
    /// Refused, reset, stalled or 5xx: it may serve again soon.
    pub transient: bool,
}

impl ParentFailure {
    /// A failure for good (corrupt data, another version).
    pub fn permanent(parent: u32) -> ParentFailure {
        ParentFailure {
            parent,
            transient: false,
        }
    }
}

/// One getter of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub rank: u32,
    /// The rank it fetches from now.
    pub parent: u32,
    pub state: MemberState,
    pub relay_url: String,
    /// What its relay accepts from the children it serves.
    pub relay_key: Option<String>,
    /// Where its agent serves the finished copy (from `Done`).
    pub served_by: Option<String>,
    /// Its node agent id.
    pub getter: Option<String>,
    /// Parents it reported failed: never handed to it again.
    pub failed: BTreeSet<u32>,
    /// Parents it reported failed transiently (a stall, a reset), with the
    /// time (ms) until which they are not handed to it again: a relay that
    /// stalled because its own parent did is healthy once that one is back.
    pub paused: BTreeMap<u32, u64>,
    /// Parents it moved away from, in order.
    pub replaced: Vec<u32>,
    pub connected: bool,
    /// Told it may stop serving.
    pub released: bool,
    /// The connection it holds (see the module docs).
    pub session: u64,
}

impl Member {
    /// The parents it refuses at `now_ms`: the failed and the paused ones.
    pub fn refused(&self, now_ms: u64) -> BTreeSet<u32> {
        let mut r = self.failed.clone();
        r.extend(
            self.paused
                .iter()
                .filter(|&(_, &until)| until > now_ms)
                .map(|(&p, _)| p),
        );
        r
    }

    /// Where it serves others, when it can, and the key its relay takes
    /// (none for its agent, which checks the children's own tokens).
    fn url(&self) -> Option<(&str, Option<&str>)> {
        let relay = (self.relay_url.as_str(), self.relay_key.as_deref());
        match self.state {
            MemberState::Active if self.connected => Some(relay),
            MemberState::Done if self.connected && !self.released => Some(relay),
            MemberState::Done => self.served_by.as_deref().map(|u| (u, None)),
            MemberState::Active | MemberState::Gone => None,
        }
    }

    fn info(&self) -> MemberInfo {
        MemberInfo {
            rank: self.rank,
            parent: self.parent,
            state: self.state,
            getter: self.getter.clone(),
            replaced: self.replaced.clone(),
        }
    }
}

/// One broadcast group.
#[derive(Debug, Clone)]
pub struct Group {
    pub id: String,
    pub key: Key,
    /// Fixed at creation: every member gets this version.
    pub version: String,
    pub fanout: u32,
    /// See [`GroupRecord::auto_fanout`].
    pub auto_fanout: bool,
    /// Rank 0.
    pub origin: Parent,
    pub created_ms: u64,
    pub window_ms: u64,
    pub named: bool,
    members: BTreeMap<u32, Member>,
    /// Downloading members by the rank they fetch from: kept to them, so
    /// that every question about a member's children costs its live
    /// children only (never the ones that finished or left).
    children: BTreeMap<u32, BTreeSet<u32>>,
    /// Committed: ranks below it may be handed out.
    reserved: u32,
    /// A reservation ahead is being committed.
    reserving: bool,
    next_rank: u32,
    /// Members with a connection.
    connected: usize,
    /// When the last member left (or the group was restored).
    idle_since_ms: u64,
    /// Until then nothing is released (members are still rejoining).
    restored_until_ms: u64,
    /// See [`GroupRecord::secret_key`].
    pub secret_key: Option<[u8; 32]>,
}

/// Messages due to members of one group, by rank.
pub type Events = Vec<(u32, GroupMessage)>;

impl Group {
    fn from_record(r: GroupRecord) -> Self {
        Group {
            id: r.id,
            key: r.key,
            version: r.version,
            fanout: r.fanout,
            auto_fanout: r.auto_fanout,
            origin: r.origin,
            created_ms: r.created_ms,
            window_ms: r.window_ms,
            named: r.named,
            members: BTreeMap::new(),
            children: BTreeMap::new(),
            reserved: r.reserved,
            reserving: false,
            next_rank: r.reserved.max(1),
            connected: 0,
            idle_since_ms: r.created_ms,
            restored_until_ms: 0,
            secret_key: blake3::Hash::from_hex(&r.secret_key)
                .ok()
                .map(|h| *h.as_bytes()),
        }
    }

    /// The secret of member `rank`, when the group has a key.
    fn secret_of(&self, rank: u32) -> Option<String> {
        self.secret_key
            .map(|k| member_secret(&k, &self.id, rank).to_hex().to_string())
    }

    pub fn record(&self) -> GroupRecord {
        GroupRecord {
            id: self.id.clone(),
            key: self.key.clone(),
            version: self.version.clone(),
            fanout: self.fanout,
            auto_fanout: self.auto_fanout,
            origin: self.origin.clone(),
            created_ms: self.created_ms,
            window_ms: self.window_ms,
            named: self.named,
            reserved: self.reserved,
            secret_key: self
                .secret_key
                .map(|k| blake3::Hash::from(k).to_hex().to_string())
                .unwrap_or_default(),
        }
    }

    /// When the group stops accepting joins.
    pub fn closes_at_ms(&self) -> u64 {
        self.created_ms.saturating_add(self.window_ms)
    }

    pub fn is_open(&self, now_ms: u64) -> bool {
        now_ms < self.closes_at_ms()
    }

    pub fn member(&self, rank: u32) -> Option<&Member> {
        self.members.get(&rank)
    }

    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// Ranks below this one may be held by members.
    pub fn reserved(&self) -> u32 {
        self.reserved
    }

    /// The record with the next block reserved, once `rank` is in the last
    /// reserved block and no reservation is being committed.
    fn reservation_ahead(&mut self, rank: u32) -> Option<GroupRecord> {
        if self.reserving || self.reserved.saturating_sub(rank) > RANK_BLOCK {
            return None;
        }
        self.reserving = true;
        let mut record = self.record();
        record.reserved = self.reserved.saturating_add(RANK_BLOCK);
        Some(record)
    }

    pub fn info(&self, now_ms: u64) -> GroupInfo {
        GroupInfo {
            group: self.id.clone(),
            key: self.key.clone(),
            version: self.version.clone(),
            fanout: self.fanout,
            origin: self.origin.id.clone(),
            open: self.is_open(now_ms),
            members: self.members.values().map(Member::info).collect(),
        }
    }

    /// `rank` as a parent, when it can serve (whoever asks).
    fn parent_at(&self, rank: u32) -> Option<Parent> {
        if rank == 0 {
            return Some(self.origin.clone());
        }
        let (url, key) = self.members.get(&rank)?.url()?;
        Some(Parent {
            rank,
            url: url.to_owned(),
            id: format!("rank-{rank}"),
            key: key.map(str::to_owned),
        })
    }

    /// The parent for the member at `rank`, which refuses the ranks in
    /// `failed`: its tree parent, or the nearest usable ancestor, or the
    /// origin; when the origin failed it, the first finished member.
    fn pick_parent(&self, rank: u32, failed: &BTreeSet<u32>) -> Result<Parent, JoinError> {
        let mut candidate = parent_rank(rank, self.fanout).unwrap_or(0);
        while candidate != 0 {
            if !failed.contains(&candidate)
                && let Some(p) = self.parent_at(candidate)
            {
                return Ok(p);
            }
            candidate = parent_rank(candidate, self.fanout).unwrap_or(0);
        }
        if !failed.contains(&0) {
            return Ok(self.origin.clone());
        }
        self.members
            .values()
            .filter(|m| m.rank != rank && m.state == MemberState::Done && !failed.contains(&m.rank))
            .find_map(|m| self.parent_at(m.rank))
            .ok_or_else(|| {
                JoinError::NoSource(format!(
                    "the origin of broadcast group {:?} failed rank {rank} and no finished \
                     member can serve it",
                    self.id
                ))
            })
    }

    /// Adds `rank` to the children index when it is downloading.
    fn index(&mut self, rank: u32) {
        if let Some(m) = self.members.get(&rank)
            && m.state == MemberState::Active
        {
            self.children.entry(m.parent).or_default().insert(rank);
        }
    }

    /// Removes `rank` from the children index (before it finishes, leaves,
    /// or moves).
    fn unindex(&mut self, rank: u32) {
        let Some(parent) = self.members.get(&rank).map(|m| m.parent) else {
            return;
        };
        if let Some(set) = self.children.get_mut(&parent) {
            set.remove(&rank);
            if set.is_empty() {
                self.children.remove(&parent);
            }
        }
    }

    /// Points `child` at `parent`, keeping the children index in step.
    fn set_parent(&mut self, child: u32, parent: u32) {
        self.unindex(child);
        if let Some(m) = self.members.get_mut(&child) {
            m.parent = parent;
        }
        self.index(child);
    }

    /// Whether a member fetching from `rank` is still downloading.
    fn has_active_child(&self, rank: u32) -> bool {
        self.children.contains_key(&rank)
    }

    /// Releases `rank` when it is finished, connected, not yet released and
    /// none of its children still downloads.
    fn maybe_release(&mut self, rank: u32, now_ms: u64, events: &mut Events) {
        if rank == 0 || now_ms < self.restored_until_ms || self.has_active_child(rank) {
            return;
        }
        if let Some(m) = self.members.get_mut(&rank)
            && m.state == MemberState::Done
            && m.connected
            && !m.released
        {
            m.released = true;
            events.push((rank, GroupMessage::Release));
        }
    }

    /// Downloading children of `rank`.
    fn active_children(&self, rank: u32) -> Vec<u32> {
        self.children
            .get(&rank)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Moves the downloading children of `rank`, which can no longer serve.
    fn reassign_children(&mut self, rank: u32, now_ms: u64, events: &mut Events) {
        for child in self.active_children(rank) {
            let failed = self.members[&child].refused(now_ms);
            match self.pick_parent(child, &failed) {
                Ok(p) => {
                    self.set_parent(child, p.rank);
                    if let Some(m) = self.members.get_mut(&child) {
                        m.replaced.push(rank);
                    }
                    events.push((child, GroupMessage::Parent { parent: p }));
                }
                Err(e) => events.push((child, e.message())),
            }
        }
    }

    /// The member at `rank` if `session` still holds it.
    fn session_member(&mut self, rank: u32, session: u64) -> Option<&mut Member> {
        self.members
            .get_mut(&rank)
            .filter(|m| m.session == session && m.connected)
    }
}

/// A named group that has ended: its id stays refused for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Finished {
    closed_at_ms: u64,
    window_ms: u64,
}

/// What a join made of the getter.
#[derive(Debug, Clone, PartialEq)]
pub struct Joined {
    pub group: String,
    pub rank: u32,
    pub version: String,
    pub fanout: u32,
    pub parent: Parent,
    /// The connection's session, for its later reports.
    pub session: u64,
    /// True when this join started the group.
    pub created: bool,
    /// True for a rejoin.
    pub rejoined: bool,
    /// The member's secret ([`GroupMessage::Assigned`]).
    pub secret: Option<String>,
    /// To commit before the getter is answered (and before anything else
    /// happens to the group: undo the join if that fails).
    pub persist: Option<GroupRecord>,
    /// To commit in the background, then acknowledge with
    /// [`Groups::reservation_committed`] (or [`Groups::reservation_failed`]).
    pub reserve_ahead: Option<GroupRecord>,
    /// Messages due to other members (or to this one, after its `Assigned`).
    pub events: Events,
    /// The reservation before this join, when it grew (see [`Groups::undo_join`]).
    prev_reserved: Option<u32>,
}

impl Joined {
    /// The answer to the getter.
    pub fn assigned(&self) -> GroupMessage {
        GroupMessage::Assigned {
            group: self.group.clone(),
            rank: self.rank,
            version: self.version.clone(),
            fanout: self.fanout,
            parent: self.parent.clone(),
            digest: None,
            secret: self.secret.clone(),
        }
    }
}

/// What a sweep changed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Swept {
    /// Messages due, by group.
    pub events: Vec<(String, Events)>,
    /// Groups no longer in memory (their connections, if any, are stale).
    pub dropped: Vec<String>,
    /// Group records to delete from the database.
    pub forget: Vec<String>,
}

/// Every broadcast group of the server, by id.
#[derive(Debug, Clone, Default)]
pub struct Groups {
    groups: BTreeMap<String, Group>,
    /// Ended named groups, by id.
    finished: BTreeMap<String, Finished>,
    /// The unnamed groups by key and version (a join looks at these only).
    unnamed: BTreeMap<(Key, String), BTreeSet<String>>,
    next_session: u64,
}

fn seconds(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.3}s", ms as f64 / 1000.0)
    }
}

fn closed_error(id: &str, closed_at_ms: u64, window_ms: u64) -> JoinError {
    let at = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(closed_at_ms));
    JoinError::Conflict(format!(
        "broadcast group {id:?} closed to joins at {at} (its window was {}); group ids are \
         unique per run — start a new group",
        seconds(window_ms)
    ))
}

/// `req` as the first getter of a new group: its fanout, or the one the
/// payload's `size` calls for ([`auto_fanout`]).
fn shaped(req: &JoinRequest, size: u64) -> JoinRequest {
    JoinRequest {
        fanout: Some(req.fanout.unwrap_or_else(|| auto_fanout(size))),
        ..req.clone()
    }
}

impl Groups {
    /// Marks group `id`, just created for `req`, as shaped by kt when `req`
    /// named no fanout.
    fn note_auto_fanout(&mut self, id: &str, req: &JoinRequest) {
        if req.fanout.is_none()
            && let Some(g) = self.groups.get_mut(id)
        {
            g.auto_fanout = true;
        }
    }
}

fn changed_error(g: &Group, key: &Key, version: &str) -> JoinError {
    JoinError::Conflict(format!(
        "key {key} changed since broadcast group {:?} began: the group broadcasts version {}, \
         the key is now at {version}; start a new group",
        g.id, g.version
    ))
}

impl Groups {
    /// Groups as the database held them: no members, ranks from each
    /// reservation on, no release for [`RESTORE_HOLD_MS`].
    pub fn restore(records: impl IntoIterator<Item = GroupRecord>, now_ms: u64) -> Self {
        let mut this = Groups::default();
        for r in records {
            let mut g = Group::from_record(r);
            g.idle_since_ms = now_ms;
            g.restored_until_ms = now_ms.saturating_add(RESTORE_HOLD_MS);
            this.insert(g);
        }
        this
    }

    /// Holds `g` (indexed when unnamed).
    fn insert(&mut self, g: Group) {
        if !g.named {
            let by = (g.key.clone(), g.version.clone());
            self.unnamed.entry(by).or_default().insert(g.id.clone());
        }
        self.groups.insert(g.id.clone(), g);
    }

    /// Stops holding group `id` (and unindexes it).
    fn remove(&mut self, id: &str) -> Option<Group> {
        let g = self.groups.remove(id)?;
        if !g.named {
            let by = (g.key.clone(), g.version.clone());
            if let Some(ids) = self.unnamed.get_mut(&by) {
                ids.remove(id);
                if ids.is_empty() {
                    self.unnamed.remove(&by);
                }
            }
        }
        Some(g)
    }

    /// Refuses a new group when [`MAX_GROUPS`] are held.
    fn check_room(&self) -> Result<(), JoinError> {
        let held = self.groups.len() + self.finished.len();
        if held >= MAX_GROUPS {
            return Err(JoinError::Unavailable(format!(
                "{held} broadcast groups are open or recently ended (at most {MAX_GROUPS}); \
                 try again later"
            )));
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn get(&self, id: &str) -> Option<&Group> {
        self.groups.get(id)
    }

    /// Every group held (the scrape-time gauges count them by state).
    pub fn iter(&self) -> impl Iterator<Item = &Group> {
        self.groups.values()
    }

    /// The agent of the member at `rank` of group `id` (the getter's own
    /// agent id, as it joined): who serves its copy once it is done.
    pub fn agent_of(&self, id: &str, rank: u32) -> Option<String> {
        self.groups.get(id)?.members.get(&rank)?.getter.clone()
    }

    pub fn info(&self, id: &str, now_ms: u64) -> Option<GroupInfo> {
        self.groups.get(id).map(|g| g.info(now_ms))
    }

    /// Whether `id` names a named group that has ended.
    pub fn has_ended(&self, id: &str) -> bool {
        self.finished.contains_key(id)
    }

    /// Admits a getter: `origin` is the key's rank 0 now, `version` its
    /// current version and `size` that version's bytes (a new group's shape
    /// when the getter names no fanout: [`auto_fanout`]); `make_id` supplies
    /// random bits for the id of a new unnamed group.
    pub fn join(
        &mut self,
        req: &JoinRequest,
        origin: Parent,
        version: &str,
        size: u64,
        now_ms: u64,
        make_id: &mut dyn FnMut() -> u64,
    ) -> Result<Joined, JoinError> {
        if let Some(rejoin) = &req.rejoin {
            return self.rejoin(req, rejoin, origin, version, now_ms);
        }
        let (id, created) = match &req.group {
            Some(id) => {
                check_group_id(id).map_err(JoinError::Invalid)?;
                if let Some(f) = self.finished.get(id.as_str()) {
                    return Err(closed_error(id, f.closed_at_ms, f.window_ms));
                }
                match self.groups.get(id.as_str()) {
                    Some(g) => {
                        Self::check_open_group(g, req, version, now_ms)?;
                        (id.clone(), false)
                    }
                    None => {
                        self.create(
                            id.clone(),
                            true,
                            &shaped(req, size),
                            origin.clone(),
                            version,
                            now_ms,
                        )?;
                        self.note_auto_fanout(id, req);
                        (id.clone(), true)
                    }
                }
            }
            None => {
                let by = (req.key.clone(), version.to_owned());
                let open = self
                    .unnamed
                    .get(&by)
                    .into_iter()
                    .flatten()
                    .filter_map(|id| self.groups.get(id))
                    .find(|g| {
                        g.is_open(now_ms)
                            && req.fanout.is_none_or(|f| f == g.fanout || g.auto_fanout)
                    });
                match open {
                    Some(g) => (g.id.clone(), false),
                    None => {
                        let id = loop {
                            let id = format!("auto-{:012x}", make_id() & 0xffff_ffff_ffff);
                            if !self.groups.contains_key(&id) && !self.finished.contains_key(&id) {
                                break id;
                            }
                        };
                        self.create(
                            id.clone(),
                            false,
                            &shaped(req, size),
                            origin.clone(),
                            version,
                            now_ms,
                        )?;
                        self.note_auto_fanout(&id, req);
                        (id, true)
                    }
                }
            }
        };
        self.next_session += 1;
        let session = self.next_session;
        let Some(g) = self.groups.get_mut(&id) else {
            return Err(JoinError::NotFound(format!(
                "broadcast group {id:?} is unknown"
            )));
        };
        if created {
            g.secret_key = Some(fresh_key(make_id));
        }
        let rank = g.next_rank;
        let Some(next) = rank.checked_add(1) else {
            return Err(JoinError::Conflict(format!(
                "broadcast group {id:?} is full; start a new group"
            )));
        };
        let mut persist = created;
        if g.origin != origin {
            g.origin = origin;
            persist = true;
        }
        let mut prev_reserved = None;
        if rank >= g.reserved {
            // Created, or joins outran the reservation ahead.
            prev_reserved = Some(g.reserved);
            g.reserved = rank.saturating_add(if created { 2 } else { 1 } * RANK_BLOCK);
            persist = true;
        }
        g.next_rank = next;
        // With nothing failed yet the origin is always usable.
        let parent = g.pick_parent(rank, &BTreeSet::new())?;
        g.members.insert(
            rank,
            Member {
                rank,
                parent: parent.rank,
                state: MemberState::Active,
                relay_url: req.relay_url.clone(),
                relay_key: req.relay_key.clone(),
                served_by: None,
                getter: req.getter.clone(),
                failed: BTreeSet::new(),
                paused: BTreeMap::new(),
                replaced: Vec::new(),
                connected: true,
                released: false,
                session,
            },
        );
        g.index(rank);
        g.connected += 1;
        let persist = persist.then(|| g.record());
        let reserve_ahead = g.reservation_ahead(rank);
        Ok(Joined {
            group: id,
            rank,
            version: g.version.clone(),
            fanout: g.fanout,
            parent,
            session,
            created,
            rejoined: false,
            secret: g.secret_of(rank),
            persist,
            reserve_ahead,
            events: Vec::new(),
            prev_reserved,
        })
    }

    /// Refuses a join into an existing group that cannot take it.
    fn check_open_group(
        g: &Group,
        req: &JoinRequest,
        version: &str,
        now_ms: u64,
    ) -> Result<(), JoinError> {
        if !g.is_open(now_ms) {
            return Err(closed_error(&g.id, g.closes_at_ms(), g.window_ms));
        }
        if let Some(f) = req.fanout
            && f != g.fanout
            && !g.auto_fanout
        {
            return Err(JoinError::Conflict(format!(
                "broadcast group {:?} has fanout {}, not {f}; omit the fanout or start a new group",
                g.id, g.fanout
            )));
        }
        if g.key != req.key {
            return Err(JoinError::Conflict(format!(
                "broadcast group {:?} broadcasts key {}, not {}",
                g.id, g.key, req.key
            )));
        }
        if g.version != version {
            return Err(changed_error(g, &req.key, version));
        }
        Ok(())
    }

    fn create(
        &mut self,
        id: String,
        named: bool,
        req: &JoinRequest,
        origin: Parent,
        version: &str,
        now_ms: u64,
    ) -> Result<(), JoinError> {
        self.check_room()?;
        let fanout = req.fanout.unwrap_or(DEFAULT_FANOUT);
        if !(1..=MAX_FANOUT).contains(&fanout) {
            return Err(JoinError::Invalid(format!(
                "fanout must be 1 to {MAX_FANOUT}, got {fanout}"
            )));
        }
        let window_ms = req.window_ms.unwrap_or(DEFAULT_WINDOW_MS);
        if !(1..=MAX_WINDOW_MS).contains(&window_ms) {
            return Err(JoinError::Invalid(format!(
                "a broadcast window must be 1 ms to {}, got {window_ms} ms",
                seconds(MAX_WINDOW_MS)
            )));
        }
        let g = Group::from_record(GroupRecord {
            id: id.clone(),
            key: req.key.clone(),
            version: version.to_owned(),
            fanout,
            origin,
            created_ms: now_ms,
            window_ms,
            named,
            reserved: 1,
            auto_fanout: false,
            secret_key: String::new(),
        });
        self.insert(g);
        Ok(())
    }

    fn rejoin(
        &mut self,
        req: &JoinRequest,
        rj: &Rejoin,
        origin: Parent,
        version: &str,
        now_ms: u64,
    ) -> Result<Joined, JoinError> {
        if let Some(named) = &req.group
            && *named != rj.group
        {
            return Err(JoinError::Invalid(format!(
                "a rejoin names group {:?} twice differently ({named:?})",
                rj.group
            )));
        }
        check_group_id(&rj.group).map_err(JoinError::Invalid)?;
        if rj.rank == 0 {
            return Err(JoinError::Invalid(
                "rank 0 is the origin; a getter never holds it".into(),
            ));
        }
        let Some(g) = self.groups.get_mut(&rj.group) else {
            return Err(JoinError::NotFound(
                if self.finished.contains_key(&rj.group) {
                    format!("broadcast group {:?} has ended", rj.group)
                } else {
                    format!("broadcast group {:?} is unknown", rj.group)
                },
            ));
        };
        if g.key != req.key {
            return Err(JoinError::Conflict(format!(
                "broadcast group {:?} broadcasts key {}, not {}",
                g.id, g.key, req.key
            )));
        }
        if rj.version != g.version {
            return Err(JoinError::Conflict(format!(
                "rank {} of broadcast group {:?} holds version {}, the group broadcasts {}",
                rj.rank, g.id, rj.version, g.version
            )));
        }
        if g.version != version {
            return Err(changed_error(g, &req.key, version));
        }
        // Only the getter that was given the rank may take it again.
        if let Some(key) = &g.secret_key {
            let want = member_secret(key, &g.id, rj.rank);
            let shown = rj
                .secret
                .as_deref()
                .and_then(|s| blake3::Hash::from_hex(s).ok());
            // `Hash` compares in constant time.
            if shown != Some(want) {
                return Err(JoinError::Conflict(format!(
                    "rank {} of broadcast group {:?} is another getter's: a rejoin must present the secret its join was given",
                    rj.rank, g.id
                )));
            }
        }
        let existing = g.members.get(&rj.rank);
        let failed = existing.map(|m| m.failed.clone()).unwrap_or_default();
        let usable = rj.parent != rj.rank && !failed.contains(&rj.parent);
        // Right after a restart its parent may not have rejoined yet: the
        // member keeps fetching from it (were it gone, the member would say
        // so with `ParentFailed`). The url is then unknown here: empty.
        let awaited = now_ms < g.restored_until_ms && !g.members.contains_key(&rj.parent);
        let kept = usable
            .then(|| {
                g.parent_at(rj.parent).or_else(|| {
                    awaited.then(|| Parent {
                        rank: rj.parent,
                        url: String::new(),
                        id: format!("rank-{}", rj.parent),
                        key: None,
                    })
                })
            })
            .flatten();
        let parent = match kept {
            Some(p) => p,
            None => match g.pick_parent(rj.rank, &failed) {
                Ok(p) => p,
                // A finished member needs no parent.
                Err(_) if rj.done => g.origin.clone(),
                Err(e) => return Err(e),
            },
        };

        let mut persist = false;
        if g.origin != origin {
            g.origin = origin;
            persist = true;
        }
        let mut prev_reserved = None;
        g.next_rank = g.next_rank.max(rj.rank.saturating_add(1));
        if g.next_rank > g.reserved {
            prev_reserved = Some(g.reserved);
            g.reserved = g.next_rank.saturating_add(RANK_BLOCK);
            persist = true;
        }
        self.next_session += 1;
        let session = self.next_session;
        let was_connected = existing.is_some_and(|m| m.connected);
        let (served_by, replaced, released) = existing
            .map(|m| (m.served_by.clone(), m.replaced.clone(), m.released))
            .unwrap_or_default();
        // After a restart only the member knows where its agent serves.
        let served_by = served_by.or_else(|| rj.served_by.clone());
        let member = Member {
            rank: rj.rank,
            parent: rj.parent,
            state: if rj.done {
                MemberState::Done
            } else {
                MemberState::Active
            },
            relay_url: req.relay_url.clone(),
            relay_key: req.relay_key.clone(),
            served_by,
            getter: req.getter.clone(),
            failed,
            paused: BTreeMap::new(),
            replaced,
            connected: true,
            released: released && rj.done,
            session,
        };
        // Index it under the parent it claims, then move it if needed.
        g.unindex(rj.rank);
        g.members.insert(rj.rank, member);
        g.index(rj.rank);
        if parent.rank != rj.parent {
            g.set_parent(rj.rank, parent.rank);
            if let Some(m) = g.members.get_mut(&rj.rank) {
                m.replaced.push(rj.parent);
            }
        }
        if !was_connected {
            g.connected += 1;
        }
        let mut events = Vec::new();
        if rj.done && released {
            // Its release may have been lost with the old connection.
            events.push((rj.rank, GroupMessage::Release));
        } else if rj.done {
            g.maybe_release(rj.rank, now_ms, &mut events);
        }
        if parent.rank != rj.parent {
            g.maybe_release(rj.parent, now_ms, &mut events);
        }
        Ok(Joined {
            group: g.id.clone(),
            rank: rj.rank,
            version: g.version.clone(),
            fanout: g.fanout,
            parent,
            session,
            created: false,
            rejoined: true,
            secret: g.secret_of(rj.rank),
            persist: persist.then(|| g.record()),
            reserve_ahead: None,
            events,
            prev_reserved,
        })
    }

    /// Takes back a join whose record could not be committed (nothing else
    /// happened in between): a new group is dropped, a new member removed,
    /// the reservation restored; a rejoin just leaves.
    pub fn undo_join(&mut self, j: &Joined, now_ms: u64) -> Events {
        if j.created {
            self.remove(&j.group);
            return Vec::new();
        }
        let Some(g) = self.groups.get_mut(&j.group) else {
            return Vec::new();
        };
        if let Some(r) = j.prev_reserved {
            g.reserved = r;
        }
        if j.reserve_ahead.is_some() {
            g.reserving = false;
        }
        if j.rejoined {
            return self.disconnected(&j.group, j.rank, j.session, now_ms);
        }
        g.unindex(j.rank);
        if g.members.remove(&j.rank).is_some() {
            g.connected = g.connected.saturating_sub(1);
            if g.connected == 0 {
                g.idle_since_ms = now_ms;
            }
        }
        if g.next_rank == j.rank.saturating_add(1) {
            g.next_rank = j.rank;
        }
        Vec::new()
    }

    /// A reservation ahead ([`Joined::reserve_ahead`]) was committed.
    pub fn reservation_committed(&mut self, group: &str, reserved: u32) {
        if let Some(g) = self.groups.get_mut(group) {
            g.reserved = g.reserved.max(reserved);
            g.reserving = false;
        }
    }

    /// A reservation ahead could not be committed: a later join asks again.
    pub fn reservation_failed(&mut self, group: &str) {
        if let Some(g) = self.groups.get_mut(group) {
            g.reserving = false;
        }
    }

    /// The member at `rank` finished its copy.
    pub fn done(
        &mut self,
        group: &str,
        rank: u32,
        session: u64,
        served_by: Option<String>,
        now_ms: u64,
    ) -> Events {
        let mut events = Vec::new();
        let Some(g) = self.groups.get_mut(group) else {
            return events;
        };
        let Some(m) = g.session_member(rank, session) else {
            return events;
        };
        if m.state == MemberState::Gone {
            return events;
        }
        if served_by.is_some() {
            m.served_by = served_by;
        }
        let parent = m.parent;
        g.unindex(rank);
        if let Some(m) = g.members.get_mut(&rank) {
            m.state = MemberState::Done;
        }
        g.maybe_release(rank, now_ms, &mut events);
        g.maybe_release(parent, now_ms, &mut events);
        events
    }

    /// The member at `rank` reports that a parent failed it: it is handed
    /// another parent (never that one again, or not for [`PAUSE_MS`] after
    /// a transient failure), or an error when none is left.
    pub fn parent_failed(
        &mut self,
        group: &str,
        rank: u32,
        session: u64,
        failure: ParentFailure,
        now_ms: u64,
    ) -> Events {
        let parent = failure.parent;
        let mut events = Vec::new();
        let Some(g) = self.groups.get_mut(group) else {
            return events;
        };
        let Some(m) = g.session_member(rank, session) else {
            return events;
        };
        if m.state != MemberState::Active || parent == rank {
            return events;
        }
        if failure.transient {
            m.paused.insert(parent, now_ms + PAUSE_MS);
        } else {
            m.failed.insert(parent);
        }
        let current = m.parent;
        let failed = m.refused(now_ms);
        // A stale report (it moved already): confirm the current parent.
        if current != parent
            && !failed.contains(&current)
            && let Some(p) = g.parent_at(current)
        {
            events.push((rank, GroupMessage::Parent { parent: p }));
            return events;
        }
        match g.pick_parent(rank, &failed) {
            Ok(p) => {
                g.set_parent(rank, p.rank);
                if let Some(m) = g.members.get_mut(&rank) {
                    m.replaced.push(current);
                }
                events.push((rank, GroupMessage::Parent { parent: p }));
                g.maybe_release(current, now_ms, &mut events);
            }
            Err(e) => events.push((rank, e.message())),
        }
        events
    }

    /// The connection of the member at `rank` closed. A downloading member
    /// is gone (its children move); a finished one stays a parent through its
    /// agent when it has one (its children are told the new URL), else it is
    /// gone too.
    pub fn disconnected(&mut self, group: &str, rank: u32, session: u64, now_ms: u64) -> Events {
        let mut events = Vec::new();
        let Some(g) = self.groups.get_mut(group) else {
            return events;
        };
        let Some(m) = g.session_member(rank, session) else {
            return events;
        };
        m.connected = false;
        let parent = m.parent;
        let (state, released, served_by) = (m.state, m.released, m.served_by.clone());
        g.connected = g.connected.saturating_sub(1);
        if g.connected == 0 {
            g.idle_since_ms = now_ms;
        }
        match (state, served_by) {
            (MemberState::Done, Some(url)) => {
                if !released {
                    for child in g.active_children(rank) {
                        let p = Parent {
                            rank,
                            url: url.clone(),
                            id: format!("rank-{rank}"),
                            key: None,
                        };
                        events.push((child, GroupMessage::Parent { parent: p }));
                    }
                }
            }
            (MemberState::Active | MemberState::Done, _) => {
                g.unindex(rank);
                // A finished member stays `done` (its copy is complete), but
                // with no agent serving it, it is nobody's parent any more.
                if let Some(m) = g.members.get_mut(&rank)
                    && m.state == MemberState::Active
                {
                    m.state = MemberState::Gone;
                }
                g.reassign_children(rank, now_ms, &mut events);
                g.maybe_release(parent, now_ms, &mut events);
            }
            (MemberState::Gone, _) => {}
        }
        events
    }

    /// Releases finished members nobody needs (a catch-all, and the end of
    /// the grace after a restart); drops groups that no member has been
    /// connected to for [`REJOIN_GRACE_MS`] once their window closed, or
    /// before when no member can serve a later joiner (nothing is lost: such
    /// a joiner fetches from the origin anyway, in a new group of the same
    /// id); forgets ended named groups after [`FINISHED_TTL_MS`].
    pub fn sweep(&mut self, now_ms: u64) -> Swept {
        let mut out = Swept::default();
        let mut drop = Vec::new();
        let mut idle = Vec::new();
        for g in self.groups.values_mut() {
            let mut events = Vec::new();
            let done: Vec<u32> = g
                .members
                .values()
                .filter(|m| m.state == MemberState::Done && m.connected && !m.released)
                .map(|m| m.rank)
                .collect();
            for rank in done {
                g.maybe_release(rank, now_ms, &mut events);
            }
            if !events.is_empty() {
                out.events.push((g.id.clone(), events));
            }
            if g.connected == 0 && now_ms >= g.idle_since_ms.saturating_add(REJOIN_GRACE_MS) {
                if !g.is_open(now_ms) {
                    drop.push(g.id.clone());
                } else if !g.members.values().any(|m| m.served_by.is_some()) {
                    idle.push(g.id.clone());
                }
            }
        }
        for id in idle {
            if self.remove(&id).is_some() {
                out.forget.push(id.clone());
                out.dropped.push(id);
            }
        }
        for id in drop {
            if let Some(g) = self.remove(&id) {
                if g.named {
                    // The record stays until the id is forgotten, so that it
                    // stays refused across restarts.
                    self.finished.insert(
                        id.clone(),
                        Finished {
                            closed_at_ms: g.closes_at_ms(),
                            window_ms: g.window_ms,
                        },
                    );
                } else {
                    out.forget.push(id.clone());
                }
                out.dropped.push(id);
            }
        }
        self.finished.retain(|id, f| {
            let keep = now_ms < f.closed_at_ms.saturating_add(FINISHED_TTL_MS);
            if !keep {
                out.forget.push(id.clone());
            }
            keep
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_700_000_000_000;

    fn key() -> Key {
        Key::parse("ml/weights").unwrap()
    }

    fn origin() -> Parent {
        Parent {
            rank: 0,
            url: "http://store".into(),
            id: "store".into(),
            key: None,
        }
    }

    fn relay(rank_hint: usize) -> String {
        format!("http://getter-{rank_hint}")
    }

    fn req(group: Option<&str>, fanout: Option<u32>, i: usize) -> JoinRequest {
        JoinRequest {
            key: key(),
            group: group.map(Into::into),
            fanout,
            window_ms: None,
            relay_url: relay(i),
            relay_key: None,
            getter: Some(format!("pod-{i}")),
            rejoin: None,
        }
    }

    fn ids() -> impl FnMut() -> u64 {
        let mut n = 0x1234_5678_9abc_u64;
        move || {
            n += 1;
            n
        }
    }

    /// `n` getters join `group` with `fanout`; their assignments.
    fn join_n(gs: &mut Groups, group: &str, fanout: u32, n: usize) -> Vec<Joined> {
        let mut make = ids();
        (1..=n)
            .map(|i| {
                gs.join(
                    &req(Some(group), Some(fanout), i),
                    origin(),
                    "v1",
                    0,
                    T0,
                    &mut make,
                )
                .unwrap()
            })
            .collect()
    }

    /// The writes of joins: rank, reservation committed before the answer,
    /// reservation committed in the background.
    type Writes = Vec<(u32, Option<u32>, Option<u32>)>;

    fn writes_of(js: &[Joined]) -> Writes {
        js.iter()
            .filter(|j| j.persist.is_some() || j.reserve_ahead.is_some())
            .map(|j| {
                (
                    j.rank,
                    j.persist.as_ref().map(|r| r.reserved),
                    j.reserve_ahead.as_ref().map(|r| r.reserved),
                )
            })
            .collect()
    }

    /// Like [`join_n`], committing every reservation ahead at once.
    fn join_committed(
        gs: &mut Groups,
        group: &str,
        fanout: u32,
        n: usize,
    ) -> (Vec<Joined>, Writes) {
        let mut make = ids();
        let js: Vec<Joined> = (1..=n)
            .map(|i| {
                let j = gs
                    .join(
                        &req(Some(group), Some(fanout), i),
                        origin(),
                        "v1",
                        0,
                        T0,
                        &mut make,
                    )
                    .unwrap();
                if let Some(r) = &j.reserve_ahead {
                    gs.reservation_committed(group, r.reserved);
                }
                j
            })
            .collect();
        let writes = writes_of(&js);
        (js, writes)
    }

    fn parent_of(events: &Events, rank: u32) -> Option<u32> {
        events.iter().find_map(|(r, m)| match m {
            GroupMessage::Parent { parent } if *r == rank => Some(parent.rank),
            _ => None,
        })
    }

    fn released(events: &Events) -> Vec<u32> {
        events
            .iter()
            .filter(|(_, m)| *m == GroupMessage::Release)
            .map(|(r, _)| *r)
            .collect()
    }

    fn parents(gs: &Groups, group: &str) -> Vec<u32> {
        gs.get(group).unwrap().members().map(|m| m.parent).collect()
    }

    #[test]
    fn tree_shape_fanout_2() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "run-1", 2, 6);
        let ranks: Vec<u32> = js.iter().map(|j| j.rank).collect();
        assert_eq!(ranks, [1, 2, 3, 4, 5, 6]);
        let ps: Vec<u32> = js.iter().map(|j| j.parent.rank).collect();
        assert_eq!(ps, [0, 0, 1, 1, 2, 2]);
        assert_eq!(js[0].parent, origin());
        assert_eq!(
            js[2].parent,
            Parent {
                rank: 1,
                url: relay(1),
                id: "rank-1".into(),
                key: None,
            }
        );
        assert!(js[0].created && !js[1].created);
        assert!(js[0].persist.is_some(), "a new group is persisted");
        assert!(js[1..].iter().all(|j| j.persist.is_none()));
        assert_eq!(
            js[5].assigned(),
            GroupMessage::Assigned {
                group: "run-1".into(),
                rank: 6,
                version: "v1".into(),
                fanout: 2,
                parent: js[5].parent.clone(),
                digest: None,
                secret: gs.get("run-1").unwrap().secret_of(6),
            }
        );
        // Every member has its own secret.
        let secrets: BTreeSet<Option<String>> = js.iter().map(|j| j.secret.clone()).collect();
        assert_eq!(secrets.len(), js.len());
        assert!(
            secrets
                .iter()
                .all(|s| s.as_ref().is_some_and(|s| s.len() == 64))
        );
        let info = gs.info("run-1", T0).unwrap();
        assert_eq!(info.origin, "store");
        assert!(info.open);
        assert_eq!(info.members.len(), 6);
        assert_eq!(info.members[3].getter.as_deref(), Some("pod-4"));
    }

    #[test]
    fn tree_shape_fanout_50() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "run-1", 50, 2600);
        for j in &js {
            assert_eq!(
                j.parent.rank,
                parent_rank(j.rank, 50).unwrap(),
                "{}",
                j.rank
            );
        }
        assert_eq!(js[49].parent.rank, 0);
        assert_eq!(js[50].parent.rank, 1);
        assert_eq!(js[2549].parent.rank, 50);
        assert_eq!(js[2550].parent.rank, 51);
    }

    /// A group whose first getter names no fanout takes its shape from the
    /// payload's size: a chain for a large one, a wide tree for a small one;
    /// a named fanout wins, and later getters naming none join either.
    #[test]
    fn the_default_shape_follows_the_payload_size() {
        use kt_types::broadcast::CHAIN_MIN_BYTES;
        let mut gs = Groups::default();
        let mut make = ids();
        let mut first = |gs: &mut Groups, g: &str, fanout, size| {
            gs.join(
                &req(Some(g), fanout, 1),
                origin(),
                "v1",
                size,
                T0,
                &mut make,
            )
            .unwrap()
        };
        assert_eq!(first(&mut gs, "big", None, CHAIN_MIN_BYTES).fanout, 1);
        assert_eq!(
            first(&mut gs, "small", None, CHAIN_MIN_BYTES - 1).fanout,
            DEFAULT_FANOUT
        );
        assert_eq!(first(&mut gs, "named", Some(2), 1 << 40).fanout, 2);
        // A chain: each member's parent is the one before it.
        let later: Vec<Joined> = (2..6)
            .map(|i| {
                gs.join(
                    &req(Some("big"), None, i),
                    origin(),
                    "v1",
                    0,
                    T0 + 1,
                    &mut ids(),
                )
                .unwrap()
            })
            .collect();
        for j in &later {
            assert_eq!(j.fanout, 1);
            assert_eq!(j.parent.rank, j.rank - 1, "rank {}", j.rank);
        }
        // kt chose the chain: a getter naming a fanout joins it anyway
        // (an older client always named 50), and the choice survives a
        // restart; a fanout a getter named still conflicts.
        let j = gs
            .join(
                &req(Some("big"), Some(50), 9),
                origin(),
                "v1",
                0,
                T0 + 1,
                &mut ids(),
            )
            .unwrap();
        assert_eq!((j.fanout, j.parent.rank), (1, j.rank - 1));
        assert!(gs.get("big").unwrap().record().auto_fanout);
        let e = gs
            .join(
                &req(Some("named"), Some(3), 9),
                origin(),
                "v1",
                0,
                T0 + 1,
                &mut ids(),
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict, "{e}");
    }

    #[test]
    fn default_fanout_and_window_bounds() {
        let mut gs = Groups::default();
        let mut make = ids();
        let j = gs
            .join(&req(Some("g"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        assert_eq!(j.fanout, DEFAULT_FANOUT);
        assert_eq!(gs.get("g").unwrap().window_ms, DEFAULT_WINDOW_MS);
        for fanout in [0, MAX_FANOUT + 1] {
            let e = gs
                .join(
                    &req(Some("h"), Some(fanout), 1),
                    origin(),
                    "v1",
                    0,
                    T0,
                    &mut make,
                )
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        }
        let mut r = req(Some("h"), None, 1);
        r.window_ms = Some(MAX_WINDOW_MS + 1);
        let e = gs.join(&r, origin(), "v1", 0, T0, &mut make).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        let e = gs
            .join(&req(Some("a/b"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        assert!(gs.get("h").is_none(), "a refused group is not created");
    }

    #[test]
    fn rolling_joins_skip_members_that_left() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 2);
        // Rank 1 leaves before rank 3 and 4 arrive: they go to the origin.
        let ev = gs.disconnected("g", 1, js[0].session, T0 + 1);
        assert!(ev.is_empty());
        let mut make = ids();
        let late: Vec<Joined> = (3..=5)
            .map(|i| {
                gs.join(
                    &req(Some("g"), None, i),
                    origin(),
                    "v1",
                    0,
                    T0 + 2,
                    &mut make,
                )
                .unwrap()
            })
            .collect();
        let ps: Vec<(u32, u32)> = late.iter().map(|j| (j.rank, j.parent.rank)).collect();
        assert_eq!(ps, [(3, 0), (4, 0), (5, 2)]);
        assert_eq!(
            gs.info("g", T0).unwrap().members[0].state,
            MemberState::Gone
        );
    }

    #[test]
    fn parent_death_moves_children_to_grandparent_and_origin() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 14);
        // 3 has children 7 and 8; 7 has 15, 16 (not joined). Kill 3.
        let ev = gs.disconnected("g", 3, js[2].session, T0 + 1);
        assert_eq!(parent_of(&ev, 7), Some(1));
        assert_eq!(parent_of(&ev, 8), Some(1));
        assert_eq!(ev.len(), 2);
        let m7 = gs.get("g").unwrap().member(7).unwrap();
        assert_eq!((m7.parent, m7.replaced.clone()), (1, vec![3]));
        // Now kill 1: its children 3 (gone), 4, 7, 8 move to the origin.
        let ev = gs.disconnected("g", 1, js[0].session, T0 + 2);
        let mut moved: Vec<(u32, u32)> = ev
            .iter()
            .filter_map(|(r, _)| parent_of(&ev, *r).map(|p| (*r, p)))
            .collect();
        moved.sort_unstable();
        assert_eq!(moved, [(4, 0), (7, 0), (8, 0)]);
        let info = gs.info("g", T0).unwrap();
        assert_eq!(info.members[6].replaced, vec![3, 1]);
        // A late joiner whose parent and grandparent are gone goes higher.
        let j = gs
            .join(
                &req(Some("g"), None, 15),
                origin(),
                "v1",
                0,
                T0 + 3,
                &mut ids(),
            )
            .unwrap();
        assert_eq!((j.rank, j.parent.rank), (15, 7));
    }

    #[test]
    fn parent_failed_walks_up_and_excludes() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 8);
        // 8's parent is 3, grandparent 1.
        let s8 = js[7].session;
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(3), T0 + 1);
        assert_eq!(ev.len(), 1);
        assert_eq!(parent_of(&ev, 8), Some(1));
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(1), T0 + 2);
        assert_eq!(parent_of(&ev, 8), Some(0));
        // The origin fails it: no finished member yet → no source.
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(0), T0 + 3);
        assert!(
            matches!(
                &ev[..],
                [(
                    8,
                    GroupMessage::Error {
                        code: ErrorCode::NoSource,
                        ..
                    }
                )]
            ),
            "{ev:?}"
        );
        let m = gs.get("g").unwrap().member(8).unwrap();
        assert_eq!(m.failed, BTreeSet::from([0, 1, 3]));
        assert_eq!(m.replaced, vec![3, 1]);
        // Once rank 2 is done (and keeps serving: it has children), 8 gets it.
        let ev = gs.done("g", 2, js[1].session, None, T0 + 4);
        assert!(ev.is_empty(), "2 still has downloading children: {ev:?}");
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(0), T0 + 5);
        assert_eq!(parent_of(&ev, 8), Some(2));
        // A stale report (about a parent it already left) confirms the current one.
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(3), T0 + 6);
        assert_eq!(parent_of(&ev, 8), Some(2));
        // Another rank's failure does not exclude for others: 7 still goes to 3.
        assert_eq!(gs.get("g").unwrap().member(7).unwrap().parent, 3);
        // A report from a stale session is ignored.
        assert!(
            gs.parent_failed("g", 7, 9999, ParentFailure::permanent(3), T0)
                .is_empty()
        );
    }

    #[test]
    fn a_transient_parent_failure_avoids_the_parent_only_for_a_while() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 8);
        let s8 = js[7].session;
        let stalled = ParentFailure {
            parent: 3,
            transient: true,
        };
        let ev = gs.parent_failed("g", 8, s8, stalled, T0 + 1);
        assert_eq!(parent_of(&ev, 8), Some(1));
        let m = gs.get("g").unwrap().member(8).unwrap();
        assert!(m.failed.is_empty(), "{m:?}");
        assert_eq!(m.refused(T0 + 2), BTreeSet::from([3]));
        // Once the pause is over, 3 is its parent again when 1 fails it.
        assert!(m.refused(T0 + 1 + PAUSE_MS).is_empty());
        let ev = gs.parent_failed("g", 8, s8, ParentFailure::permanent(1), T0 + 2 + PAUSE_MS);
        assert_eq!(parent_of(&ev, 8), Some(3));
    }

    #[test]
    fn release_when_the_last_child_finishes() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 4);
        // 1 has children 3 and 4. 1 finishes first: it keeps serving.
        assert!(gs.done("g", 1, js[0].session, None, T0).is_empty());
        assert!(
            gs.done("g", 3, js[2].session, None, T0)
                .contains(&(3, GroupMessage::Release))
        );
        // 3 had no children: released at once; 1 still has 4 downloading.
        let ev = gs.done("g", 4, js[3].session, None, T0);
        assert_eq!(released(&ev), [4, 1]);
        assert!(gs.get("g").unwrap().member(1).unwrap().released);
        // Released once only.
        assert!(gs.sweep(T0 + 1).events.is_empty());
        // A member whose last child left (instead of finishing) is released too.
        let js = join_n(&mut gs, "h", 2, 3);
        assert!(gs.done("h", 1, js[0].session, None, T0).is_empty());
        let ev = gs.disconnected("h", 3, js[2].session, T0);
        assert_eq!(released(&ev), [1]);
    }

    #[test]
    fn late_joiner_gets_served_by_of_a_finished_parent() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 3);
        // 1 finishes with its agent serving, then leaves while 3 still downloads.
        gs.done("g", 1, js[0].session, Some("http://agent-1".into()), T0);
        let ev = gs.disconnected("g", 1, js[0].session, T0 + 1);
        assert_eq!(
            ev,
            vec![(
                3,
                GroupMessage::Parent {
                    parent: Parent {
                        rank: 1,
                        url: "http://agent-1".into(),
                        id: "rank-1".into(),
                        key: None,
                    }
                }
            )]
        );
        assert_eq!(
            gs.get("g").unwrap().member(1).unwrap().state,
            MemberState::Done
        );
        let j = gs
            .join(
                &req(Some("g"), None, 4),
                origin(),
                "v1",
                0,
                T0 + 2,
                &mut ids(),
            )
            .unwrap();
        assert_eq!((j.rank, j.parent.rank), (4, 1));
        assert_eq!(j.parent.url, "http://agent-1");
        // Without an agent, a finished member that leaves stays done but
        // parents nobody.
        gs.done("g", 2, js[1].session, None, T0);
        gs.disconnected("g", 2, js[1].session, T0 + 3);
        assert_eq!(
            gs.get("g").unwrap().member(2).unwrap().state,
            MemberState::Done
        );
        let j = gs
            .join(
                &req(Some("g"), None, 5),
                origin(),
                "v1",
                0,
                T0 + 4,
                &mut ids(),
            )
            .unwrap();
        assert_eq!((j.rank, j.parent.rank), (5, 0));
        // A finished, released member without an agent is no parent either.
        let j6 = gs
            .join(
                &req(Some("g"), None, 6),
                origin(),
                "v1",
                0,
                T0 + 4,
                &mut ids(),
            )
            .unwrap();
        assert_eq!(j6.parent.rank, 0, "6's tree parent 2 is gone");
        assert_eq!(released(&gs.done("g", 6, j6.session, None, T0 + 5)), [6]);
        let mut make = ids();
        let j13 = (7..=13)
            .map(|i| {
                gs.join(
                    &req(Some("g"), None, i),
                    origin(),
                    "v1",
                    0,
                    T0 + 6,
                    &mut make,
                )
                .unwrap()
            })
            .last()
            .unwrap();
        assert_eq!(
            (j13.rank, j13.parent.rank),
            (13, 0),
            "6 is released, 2 gone"
        );
    }

    #[test]
    fn named_group_is_unique_per_run() {
        let mut gs = Groups::default();
        let mut make = ids();
        let mut r = req(Some("run-7"), Some(2), 1);
        r.window_ms = Some(10_000);
        gs.join(&r, origin(), "v1", 0, T0, &mut make).unwrap();
        // Open: another fanout, key or version is a conflict.
        let e = gs
            .join(
                &req(Some("run-7"), Some(3), 2),
                origin(),
                "v1",
                0,
                T0 + 1,
                &mut make,
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        assert!(e.to_string().contains("fanout 2, not 3"), "{e}");
        let mut other = req(Some("run-7"), None, 2);
        other.key = Key::parse("ml/other").unwrap();
        let e = gs
            .join(&other, origin(), "v1", 0, T0 + 1, &mut make)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        let e = gs
            .join(
                &req(Some("run-7"), None, 2),
                origin(),
                "v2",
                0,
                T0 + 1,
                &mut make,
            )
            .unwrap_err();
        assert!(e.to_string().contains("changed since"), "{e}");
        // Closed: a conflict naming when and why.
        let e = gs
            .join(
                &req(Some("run-7"), None, 2),
                origin(),
                "v1",
                0,
                T0 + 10_000,
                &mut make,
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        assert_eq!(
            e.to_string(),
            "broadcast group \"run-7\" closed to joins at 2023-11-14T22:13:30Z (its window \
             was 10s); group ids are unique per run — start a new group"
        );
        assert!(!gs.info("run-7", T0 + 10_000).unwrap().open);
        // Still refused once the group is swept, until forgotten.
        let s1 = gs.get("run-7").unwrap().member(1).unwrap().session;
        gs.disconnected("run-7", 1, s1, T0 + 11_000);
        let swept = gs.sweep(T0 + 11_000 + REJOIN_GRACE_MS);
        assert_eq!(swept.dropped, ["run-7"]);
        assert!(
            swept.forget.is_empty(),
            "kept so that restarts refuse it too"
        );
        assert!(gs.info("run-7", T0).is_none() && gs.has_ended("run-7"));
        let e = gs
            .join(
                &req(Some("run-7"), None, 2),
                origin(),
                "v1",
                0,
                T0 + 100_000,
                &mut make,
            )
            .unwrap_err();
        assert!(e.to_string().contains("closed to joins"), "{e}");
        let swept = gs.sweep(T0 + 10_000 + FINISHED_TTL_MS);
        assert_eq!(swept.forget, ["run-7"]);
        assert!(!gs.has_ended("run-7"));
    }

    #[test]
    fn unnamed_groups_roll_over() {
        let mut gs = Groups::default();
        let mut make = ids();
        let a = gs
            .join(&req(None, None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        assert_eq!(a.group, "auto-123456789abd");
        assert!(a.created);
        let b = gs
            .join(&req(None, None, 2), origin(), "v1", 0, T0 + 1, &mut make)
            .unwrap();
        assert_eq!((b.group.as_str(), b.rank), (a.group.as_str(), 2));
        // A new version starts a new group.
        let c = gs
            .join(&req(None, None, 3), origin(), "v2", 0, T0 + 2, &mut make)
            .unwrap();
        assert_ne!(c.group, a.group);
        // A named fanout joins a group kt shaped, not one a getter shaped
        // with another fanout.
        let d = gs
            .join(&req(None, Some(7), 4), origin(), "v1", 0, T0 + 2, &mut make)
            .unwrap();
        assert_eq!(d.group, a.group);
        let f2 = gs
            .join(&req(None, Some(2), 6), origin(), "v2", 0, T0 + 2, &mut make)
            .unwrap();
        assert_eq!(f2.group, c.group);
        let own = gs
            .join(&req(None, Some(7), 7), origin(), "v3", 0, T0 + 2, &mut make)
            .unwrap();
        let other = gs
            .join(&req(None, Some(9), 8), origin(), "v3", 0, T0 + 2, &mut make)
            .unwrap();
        assert_ne!(own.group, other.group);
        // After the window, a new group.
        let later = T0 + DEFAULT_WINDOW_MS + 2;
        let e = gs
            .join(&req(None, None, 5), origin(), "v1", 0, later, &mut make)
            .unwrap();
        assert_ne!(e.group, a.group);
        assert_eq!(e.rank, 1);
        // Unnamed groups are forgotten with their record when swept.
        for j in [&a, &b, &d] {
            gs.disconnected(&j.group, j.rank, j.session, T0 + 3);
        }
        let swept = gs.sweep(T0 + DEFAULT_WINDOW_MS + REJOIN_GRACE_MS);
        assert!(swept.forget.contains(&a.group), "{swept:?}");
        assert!(!gs.has_ended(&a.group));
    }

    #[test]
    fn ranks_are_reserved_a_block_ahead() {
        // The commits ahead land in time: joins never wait on one.
        let mut gs = Groups::default();
        let (js, writes) = join_committed(&mut gs, "g", 50, 800);
        assert_eq!(js.len(), 800);
        assert_eq!(
            writes,
            [
                (1, Some(513), None),
                (257, None, Some(769)),
                (513, None, Some(1025)),
                (769, None, Some(1281))
            ]
        );
        // Joins that outrun the reservation ahead commit one themselves.
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 50, 600);
        assert_eq!(
            writes_of(&js),
            [
                (1, Some(513), None),
                (257, None, Some(769)),
                (513, Some(769), None)
            ]
        );
        // The late commit ahead never shrinks the reservation.
        gs.reservation_committed("g", 769);
        assert_eq!(gs.get("g").unwrap().reserved(), 769);
        // A failed one is asked for again.
        gs.reservation_failed("g");
        let j = gs
            .join(
                &req(Some("g"), None, 601),
                origin(),
                "v1",
                0,
                T0,
                &mut ids(),
            )
            .unwrap();
        assert_eq!(
            (j.rank, j.reserve_ahead.map(|r| r.reserved)),
            (601, Some(1025))
        );
    }

    #[test]
    fn a_rejoin_restores_served_by_and_repeats_a_lost_release() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 1);
        assert_eq!(released(&gs.done("g", 1, js[0].session, None, T0)), [1]);
        // The Release went out on a connection that then dropped.
        let again = JoinRequest {
            rejoin: Some(Rejoin {
                group: "g".into(),
                rank: 1,
                version: "v1".into(),
                parent: 0,
                done: true,
                served_by: Some("http://agent-1".into()),
                secret: js[0].secret.clone(),
            }),
            ..req(None, None, 1)
        };
        let r = gs
            .join(&again, origin(), "v1", 0, T0 + 10, &mut ids())
            .unwrap();
        assert_eq!(released(&r.events), [1]);
        assert_eq!(
            gs.get("g").unwrap().member(1).unwrap().served_by.as_deref(),
            Some("http://agent-1")
        );
    }

    #[test]
    fn restart_keeps_ranks_and_rebuilds_members() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 10);
        gs.done("g", 1, js[0].session, None, T0);
        let record = gs.get("g").unwrap().record();
        assert_eq!(record.reserved, 1 + 2 * RANK_BLOCK);

        let mut gs = Groups::restore([record], T0 + 1_000);
        assert!(gs.get("g").unwrap().members().next().is_none());
        // A new getter never collides with a member yet to rejoin.
        let mut make = ids();
        let new = gs
            .join(
                &req(Some("g"), None, 99),
                origin(),
                "v1",
                0,
                T0 + 1_000,
                &mut make,
            )
            .unwrap();
        assert_eq!(new.rank, 513);
        assert_eq!(
            new.persist.as_ref().map(|r| r.reserved),
            Some(769),
            "the next block is committed first"
        );
        assert_eq!(new.parent.rank, 0, "its ancestors have not rejoined");
        // Rejoins keep their rank; a kept parent is a usable one.
        // Secrets are checked after the restart too (the key is in the record).
        let key = gs.get("g").unwrap().secret_key.expect("a key");
        let rejoin = |rank: u32, parent: u32, done: bool| JoinRequest {
            rejoin: Some(Rejoin {
                group: "g".into(),
                rank,
                version: "v1".into(),
                parent,
                done,
                served_by: None,
                secret: Some(member_secret(&key, "g", rank).to_hex().to_string()),
            }),
            ..req(None, None, rank as usize)
        };
        let mut stolen = rejoin(2, 1, false);
        if let Some(r) = stolen.rejoin.as_mut() {
            r.secret = rejoin(3, 1, false).rejoin.and_then(|r| r.secret);
        }
        let e = gs
            .join(&stolen, origin(), "v1", 0, T0 + 1_000, &mut ids())
            .unwrap_err();
        assert!(e.to_string().contains("another getter's"), "{e}");
        let r1 = gs
            .join(
                &rejoin(1, 0, true),
                origin(),
                "v1",
                0,
                T0 + 1_100,
                &mut make,
            )
            .unwrap();
        assert_eq!((r1.rank, r1.parent.rank, r1.rejoined), (1, 0, true));
        assert!(r1.events.is_empty(), "no release while members rejoin");
        let r10 = gs
            .join(
                &rejoin(10, 4, true),
                origin(),
                "v1",
                0,
                T0 + 1_150,
                &mut make,
            )
            .unwrap();
        assert!(r10.events.is_empty(), "no release while members rejoin");
        let r3 = gs
            .join(
                &rejoin(3, 1, false),
                origin(),
                "v1",
                0,
                T0 + 1_200,
                &mut make,
            )
            .unwrap();
        assert_eq!(r3.parent.rank, 1);
        // 7's parent 3 is back; 9's parent 4 is not yet, but may be on its
        // way: during the hold 9 keeps fetching from it.
        let r7 = gs
            .join(
                &rejoin(7, 3, false),
                origin(),
                "v1",
                0,
                T0 + 1_300,
                &mut make,
            )
            .unwrap();
        assert_eq!(r7.parent.rank, 3);
        let r9 = gs
            .join(
                &rejoin(9, 4, false),
                origin(),
                "v1",
                0,
                T0 + 1_300,
                &mut make,
            )
            .unwrap();
        assert_eq!(r9.parent.rank, 4);
        assert!(gs.get("g").unwrap().member(9).unwrap().replaced.is_empty());
        // Once 4 is reported failed, 9 goes to an ancestor.
        let moved = gs.parent_failed("g", 9, r9.session, ParentFailure::permanent(4), T0 + 1_400);
        assert!(
            moved.iter().any(|(r, m)| *r == 9
                && matches!(m, GroupMessage::Parent { parent } if parent.rank == 1)),
            "{moved:?}"
        );
        // Rejoin works after the window closed; a bad version does not.
        let late = T0 + DEFAULT_WINDOW_MS + 5;
        let r5 = gs
            .join(&rejoin(5, 2, false), origin(), "v1", 0, late, &mut make)
            .unwrap();
        assert_eq!(r5.parent.rank, 0);
        let mut bad = rejoin(6, 2, false);
        if let Some(r) = bad.rejoin.as_mut() {
            r.version = "v0".into();
        }
        let e = gs
            .join(&bad, origin(), "v1", 0, late, &mut make)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        let e = gs
            .join(&rejoin(6, 2, false), origin(), "v2", 0, late, &mut make)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        let mut unknown = rejoin(6, 2, false);
        if let Some(r) = unknown.rejoin.as_mut() {
            r.group = "nope".into();
        }
        let e = gs
            .join(&unknown, origin(), "v1", 0, late, &mut make)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(e.to_string(), "broadcast group \"nope\" is unknown");
        // After the hold, a finished member nobody downloads from is
        // released; 1 still has 3 and 9; 5, rejoining after the hold, is
        // moved off its parent 2, which never came back.
        let swept = gs.sweep(T0 + 1_000 + RESTORE_HOLD_MS);
        assert_eq!(
            swept.events,
            vec![("g".to_owned(), vec![(10, GroupMessage::Release)])]
        );
        // A rank beyond the reservation (the database lost it) grows it.
        let far = gs
            .join(&rejoin(900, 449, false), origin(), "v1", 0, late, &mut make)
            .unwrap();
        assert_eq!(far.persist.map(|r| r.reserved), Some(901 + RANK_BLOCK));
    }

    #[test]
    fn a_rejoin_supersedes_the_old_connection() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 3);
        let r = JoinRequest {
            rejoin: Some(Rejoin {
                group: "g".into(),
                rank: 1,
                version: "v1".into(),
                parent: 0,
                done: false,
                served_by: None,
                secret: js[0].secret.clone(),
            }),
            ..req(Some("g"), None, 1)
        };
        let again = gs.join(&r, origin(), "v1", 0, T0 + 1, &mut ids()).unwrap();
        assert_ne!(again.session, js[0].session);
        // The old connection closing changes nothing.
        assert!(gs.disconnected("g", 1, js[0].session, T0 + 2).is_empty());
        let m = gs.get("g").unwrap().member(1).unwrap();
        assert!(m.connected && m.state == MemberState::Active);
        assert_eq!(parents(&gs, "g"), [0, 0, 1]);
        // The new one does.
        let ev = gs.disconnected("g", 1, again.session, T0 + 3);
        assert_eq!(parent_of(&ev, 3), Some(0));
    }

    #[test]
    fn undo_takes_a_join_back() {
        let mut gs = Groups::default();
        let mut make = ids();
        let j = gs
            .join(&req(Some("g"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        gs.undo_join(&j, T0);
        assert!(gs.get("g").is_none());
        // 512 joins, the reservation ahead never committed: 513 needs its own.
        let js = join_n(&mut gs, "g", 2, 512);
        let j = gs
            .join(&req(Some("g"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        assert_eq!(
            (j.rank, j.persist.as_ref().map(|r| r.reserved)),
            (513, Some(769))
        );
        gs.undo_join(&j, T0);
        let g = gs.get("g").unwrap();
        assert_eq!((g.reserved(), g.members().count()), (513, 512));
        let again = gs
            .join(&req(Some("g"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        assert_eq!(again.rank, 513);
        assert!(again.persist.is_some());
        assert_eq!(js.len(), 512);
    }

    #[test]
    fn origin_changes_are_persisted() {
        let mut gs = Groups::default();
        let mut make = ids();
        gs.join(&req(Some("g"), None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        let peer = Parent {
            rank: 0,
            url: "http://peer".into(),
            id: "p1".into(),
            key: None,
        };
        let j = gs
            .join(
                &req(Some("g"), None, 2),
                peer.clone(),
                "v1",
                0,
                T0,
                &mut make,
            )
            .unwrap();
        assert_eq!(j.parent, peer);
        assert_eq!(j.persist.map(|r| r.origin), Some(peer));
        assert_eq!(gs.info("g", T0).unwrap().origin, "p1");
    }

    #[test]
    fn idle_groups_are_kept_for_the_grace() {
        let mut gs = Groups::default();
        let js = join_n(&mut gs, "g", 2, 1);
        let closed = T0 + DEFAULT_WINDOW_MS;
        // Closed but a member is connected: kept.
        assert!(gs.sweep(closed + REJOIN_GRACE_MS).dropped.is_empty());
        gs.disconnected("g", 1, js[0].session, closed + 1);
        assert!(gs.sweep(closed + REJOIN_GRACE_MS).dropped.is_empty());
        assert_eq!(gs.sweep(closed + 1 + REJOIN_GRACE_MS).dropped, ["g"]);
        assert!(gs.is_empty());
    }

    /// [`req`] with fanout 2 and an hour's window.
    fn long(group: Option<&str>, i: usize) -> JoinRequest {
        JoinRequest {
            window_ms: Some(3_600_000),
            ..req(group, Some(2), i)
        }
    }

    #[test]
    fn groups_are_capped() {
        let mut gs = Groups::default();
        let mut make = ids();
        let mut sessions = Vec::new();
        for i in 0..MAX_GROUPS {
            let id = format!("g-{i}");
            let j = gs.join(&long(Some(&id), 1), origin(), "v1", 0, T0, &mut make);
            sessions.push((id, j.unwrap().session));
        }
        assert_eq!(gs.len(), MAX_GROUPS);
        // Past the cap a new group is refused, named or not; an existing
        // one still takes joins.
        for group in [Some("one-more"), None] {
            let e = gs
                .join(&req(group, Some(2), 1), origin(), "v1", 0, T0, &mut make)
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::Unavailable, "{e}");
            assert!(e.to_string().contains("10000 broadcast groups"), "{e}");
        }
        assert!(gs.get("one-more").is_none());
        let j = gs.join(
            &req(Some("g-7"), Some(2), 2),
            origin(),
            "v1",
            0,
            T0,
            &mut make,
        );
        assert_eq!(j.unwrap().rank, 2);
        // Ended named groups count too, until forgotten.
        let mut w = req(Some("g-short"), Some(2), 1);
        w.window_ms = Some(1_000);
        gs.remove("g-0");
        let short = gs.join(&w, origin(), "v1", 0, T0, &mut make).unwrap();
        let s = gs.get("g-short").unwrap().member(1).unwrap().session;
        assert_eq!(s, short.session);
        gs.disconnected("g-short", 1, s, T0 + 2_000);
        assert_eq!(gs.sweep(T0 + 2_000 + REJOIN_GRACE_MS).dropped, ["g-short"]);
        assert!(gs.has_ended("g-short"));
        let e = gs
            .join(
                &req(Some("one-more"), Some(2), 1),
                origin(),
                "v1",
                0,
                T0,
                &mut make,
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable, "{e}");
        // A group nobody is connected to and nobody could serve from is
        // dropped after the grace, window open or not: room again.
        let (id, session) = &sessions[1];
        gs.disconnected(id, 1, *session, T0 + 3_000);
        let swept = gs.sweep(T0 + 3_000 + REJOIN_GRACE_MS);
        assert_eq!(swept.dropped, std::slice::from_ref(id));
        assert_eq!(
            swept.forget,
            std::slice::from_ref(id),
            "its record goes too"
        );
        assert!(!gs.has_ended(id), "its id may start a new group");
        gs.join(
            &req(Some("one-more"), Some(2), 1),
            origin(),
            "v1",
            0,
            T0,
            &mut make,
        )
        .unwrap();
    }

    #[test]
    fn an_idle_group_that_can_serve_is_kept_while_open() {
        let mut gs = Groups::default();
        let mut make = ids();
        let js: Vec<Joined> = (1..=2)
            .map(|i| gs.join(&long(Some("g"), i), origin(), "v1", 0, T0, &mut make))
            .collect::<Result<_, _>>()
            .unwrap();
        // Rank 1 finished and its agent serves; rank 2 left downloading.
        gs.done("g", 1, js[0].session, Some("http://agent-1".into()), T0 + 1);
        gs.disconnected("g", 1, js[0].session, T0 + 2);
        gs.disconnected("g", 2, js[1].session, T0 + 2);
        let later = T0 + 2 + REJOIN_GRACE_MS;
        assert!(gs.sweep(later).dropped.is_empty(), "rank 1 still serves");
        // A late joiner within the window gets rank 1's agent.
        let j = gs
            .join(
                &req(Some("g"), Some(2), 3),
                origin(),
                "v1",
                0,
                later,
                &mut make,
            )
            .unwrap();
        assert_eq!((j.rank, j.parent.url.as_str()), (3, "http://agent-1"));
    }

    #[test]
    fn unnamed_groups_are_found_by_key_and_version() {
        let mut gs = Groups::default();
        let mut make = ids();
        let a = gs
            .join(&req(None, None, 1), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        let b = gs
            .join(&req(None, None, 2), origin(), "v2", 0, T0, &mut make)
            .unwrap();
        let c = gs
            .join(&req(None, None, 3), origin(), "v1", 0, T0, &mut make)
            .unwrap();
        assert_ne!(a.group, b.group);
        assert_eq!(a.group, c.group);
        let undone = gs
            .join(&req(None, None, 4), origin(), "v3", 0, T0, &mut make)
            .unwrap();
        gs.undo_join(&undone, T0);
        assert!(gs.get(&undone.group).is_none());
        assert_eq!(gs.unnamed.len(), 2, "an undone group is unindexed");
        for j in [&a, &b, &c] {
            gs.disconnected(&j.group, j.rank, j.session, T0);
        }
        gs.sweep(T0 + REJOIN_GRACE_MS);
        assert!(gs.is_empty() && gs.unnamed.is_empty());
    }

    #[test]
    fn ten_thousand_joins() {
        let mut gs = Groups::default();
        let started = std::time::Instant::now();
        let (js, writes) = join_committed(&mut gs, "big", 50, 10_000);
        let elapsed = started.elapsed();
        eprintln!("10,000 joins in the state machine: {elapsed:?}");
        assert_eq!(js.last().map(|j| j.rank), Some(10_000));
        // One write per block, and only the first one waited for.
        assert_eq!(writes.len(), 40);
        assert_eq!(writes.iter().filter(|w| w.1.is_some()).count(), 1);
        let info = gs.info("big", T0).unwrap();
        assert_eq!(info.members.len(), 10_000);
        // Kill rank 1: its 50 children move to the origin.
        let ev = gs.disconnected("big", 1, js[0].session, T0);
        assert_eq!(ev.len(), 50);
        assert!(ev.iter().all(|(r, _)| parent_of(&ev, *r) == Some(0)));
    }
}
