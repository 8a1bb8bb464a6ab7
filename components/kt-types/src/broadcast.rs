//! Filesystem broadcasts: the protocol between getters and the metadata
//! server that arranges them in a tree.
//!
//! `GET /api/v1/broadcasts/join` upgrades to a WebSocket (bearer token as on
//! every route). Messages are JSON text frames, tagged by `op`:
//!
//! 1. the getter sends [`GetterMessage::Join`] (with [`JoinRequest::rejoin`]
//!    set when it reconnects after losing the connection, e.g. across a
//!    metadata-server restart: it keeps its rank);
//! 2. the server answers [`GroupMessage::Assigned`]: the group, this getter's
//!    rank and its parent. Rank 0 is the key's origin (the store or the
//!    producer's agent); rank `r > 0` gets parent `(r - 1) / fanout`, or the
//!    nearest ancestor still there;
//! 3. the getter fetches from its parent, which may still be downloading
//!    (cut-through: a parent serves every chunk it has as soon as it has it,
//!    from its relay), and serves what it has at its own `relay_url`;
//! 4. when its parent fails it, the getter sends
//!    [`GetterMessage::ParentFailed`]; when a parent leaves without finishing
//!    the server moves its children. Either way the server sends
//!    [`GroupMessage::Parent`] with a replacement (an ancestor, a finished
//!    member, or the origin) and the getter resumes, keeping every chunk it has;
//! 5. the getter sends [`GetterMessage::Done`] once its copy is complete and
//!    keeps serving until [`GroupMessage::Release`]: none of its children still
//!    needs it. A finished member whose agent serves the copy (`served_by`)
//!    stays a parent for later joiners after it leaves.
//!
//! A group accepts joins for its window (`window_ms` from its first join).
//! Named groups are unique: joining a group whose window has closed is a
//! `conflict`, never a stale answer. Getters that name no group join the
//! key's open unnamed group, or start a new one.
//!
//! `GET /api/v1/broadcasts/{group}` → [`GroupInfo`]: the tree as it stands.

use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;
use crate::key::Key;

/// Children per node of a small payload's group when the first getter
/// names none (see [`auto_fanout`]).
pub const DEFAULT_FANOUT: u32 = 50;
/// Payloads from this size on go down a pipelined chain when the first
/// getter names no fanout (see [`auto_fanout`]).
pub const CHAIN_MIN_BYTES: u64 = 64 << 20;

/// The fanout of a new group whose first getter names none, by the size of
/// the payload: 1 (a pipelined chain) from [`CHAIN_MIN_BYTES`] on, else
/// [`DEFAULT_FANOUT`].
///
/// With links of `B` bytes/s and `N` members, a tree of fanout `f` finishes
/// its last member after about `f·S/B + depth·h` (every interior member
/// sends `f` copies; `h` is a hop's lag: a piece, a round trip), a chain
/// after `S/B + (N−1)·h`. Relays forward pieces (256 KiB), so `h` is a few
/// milliseconds and a large payload's time is its bandwidth term: the
/// chain's `S/B` is the least any shape can do. A small payload's time is
/// its latency term, which a wide tree keeps at two hops for up to 2,550
/// members. docs/broadcast.md ("Shape") derives it.
pub fn auto_fanout(size: u64) -> u32 {
    if size >= CHAIN_MIN_BYTES {
        1
    } else {
        DEFAULT_FANOUT
    }
}
/// How long a group accepts joins when the first getter names no window.
pub const DEFAULT_WINDOW_MS: u64 = 60_000;
/// Longest accepted group id.
pub const MAX_GROUP_ID: usize = 128;

/// Parent rank of `rank` in a tree of `fanout` children per node; rank 0 (the
/// origin) has none.
pub fn parent_rank(rank: u32, fanout: u32) -> Option<u32> {
    (rank > 0).then(|| (rank - 1) / fanout.max(1))
}

/// Checks a group id: 1 to [`MAX_GROUP_ID`] characters of `[A-Za-z0-9._-]`.
pub fn check_group_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_GROUP_ID {
        return Err(format!(
            "group id must be 1 to {MAX_GROUP_ID} characters, got {}",
            id.len()
        ));
    }
    if id == "join" {
        return Err("group id \"join\" is reserved (it names the join route)".into());
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "group id {id:?} holds {c:?}; use letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

/// A message a getter sends on its WebSocket, tagged by `op`: `join`,
/// `done` or `parent_failed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
// One message per WebSocket frame, parsed and dropped: the size of the
// largest variant (a join) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum GetterMessage {
    /// The connection's first message, and only once per connection: join
    /// a group, or rejoin it ([`JoinRequest::rejoin`]). The request's
    /// fields sit beside `op`.
    Join(JoinRequest),
    /// This getter's copy is complete; from now on (once it has left) its
    /// agent serves it at `served_by`, when given.
    Done {
        /// Base URL of the getter's node agent, which serves the copy (an
        /// http(s) URL); absent when no agent serves it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        served_by: Option<String>,
    },
    /// The parent at `parent` (a rank) failed this getter.
    ParentFailed {
        /// Rank of the parent that failed; it is never handed to this
        /// getter again (unless `transient`).
        parent: u32,
        /// What went wrong, for the server's log.
        reason: String,
        /// It refused, reset, stalled or answered 5xx: it may serve again
        /// soon (a relay waiting on its own parent), so it is only avoided
        /// for a while.
        #[serde(default)]
        transient: bool,
    },
}

/// The `join` message: what a getter wants and where it relays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// The key to fetch. A group broadcasts the version that was current
    /// when it was created.
    pub key: Key,
    /// A named group (unique per run); `None` joins the key's unnamed group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Children per node; set by the group's first getter (later getters
    /// asking for another fanout are refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fanout: Option<u32>,
    /// How long the group accepts joins, in milliseconds from its first
    /// join; set by the group's first getter ([`DEFAULT_WINDOW_MS`] when it
    /// names none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ms: Option<u64>,
    /// Where this getter serves what it has so far (the read protocol).
    pub relay_url: String,
    /// What its relay accepts as a bearer token besides the getter's own
    /// (16 to 128 printable characters): handed to the children it serves
    /// ([`Parent::key`]), who present it and never their own tokens.
    /// Required with a `relay_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_key: Option<String>,
    /// This getter's node agent id, when it has one (for the tree's listing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub getter: Option<String>,
    /// Set when reconnecting: the membership this getter already holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejoin: Option<Rejoin>,
}

/// A reconnecting getter's membership, as the server assigned it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejoin {
    /// The group it joined.
    pub group: String,
    /// Its rank (never 0).
    pub rank: u32,
    /// The version it fetches: the group's.
    pub version: String,
    /// The rank it fetches from now.
    pub parent: u32,
    /// True once it sent `Done`.
    pub done: bool,
    /// Where its agent serves the finished copy (as its `Done` said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
    /// The secret its join was given ([`GroupMessage::Assigned`]): a rank
    /// is rejoined only with it, so no other getter can take it over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// Where a getter fetches from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parent {
    /// The parent's rank; 0 for the origin.
    pub rank: u32,
    /// Base URL of the read protocol (an origin, a relay, or an agent).
    /// Empty in the answer to a rejoin just after a server restart, while
    /// the parent has not rejoined: the getter keeps fetching from the
    /// parent it has.
    pub url: String,
    /// `store`, an agent id, or `rank-N` for a relay.
    pub id: String,
    /// What to present to this parent: a relay's key
    /// ([`JoinRequest::relay_key`]) or a capability for an agent
    /// ([`crate::auth::Capability`]). `None` only for the store, which is
    /// shown the getter's own token: no bearer token goes to a peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// A message the server sends a member, tagged by `op`: `assigned`,
/// `parent`, `release` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum GroupMessage {
    /// The answer to a join (or rejoin): the getter's place in the tree.
    Assigned {
        /// The group's id (for an unnamed group, the one the server made).
        group: String,
        /// The getter's rank (1 or more); a rejoin keeps its rank.
        rank: u32,
        /// The version every member of the group gets.
        version: String,
        /// The group's fanout.
        fanout: u32,
        /// Where to fetch from.
        parent: Parent,
        /// The digest of the version's manifest, from the key's record
        /// ([`crate::model::KeyRecord::digest`]): a manifest from any parent
        /// is used only if it hashes to this.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        digest: Option<crate::Hash>,
        /// This member's secret (hex): a rejoin of its rank must present it
        /// ([`Rejoin::secret`]). Absent in groups made by an older server.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        secret: Option<String>,
    },
    /// Fetch from this parent from now on (the previous one failed or left).
    Parent {
        /// The replacement.
        parent: Parent,
    },
    /// No child needs this member any more: it may stop serving.
    Release,
    /// The join was refused, or the group cannot go on; the connection closes.
    Error {
        /// Why, as a code (`conflict` for a closed group or a changed key,
        /// `not_found`, `no_source`, `invalid_request`, ...).
        code: ErrorCode,
        /// What went wrong, for people.
        message: String,
    },
}

/// What a member is doing, as [`MemberInfo`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// Downloading (and relaying what it has).
    Active,
    /// Its copy is complete (once it has left, it is a parent only when its
    /// agent serves the copy).
    Done,
    /// Left before finishing.
    Gone,
}

impl MemberState {
    /// The name on the wire: `active`, `done` or `gone`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Active => "active",
            MemberState::Done => "done",
            MemberState::Gone => "gone",
        }
    }
}

/// One member of a group, in [`GroupInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Its rank.
    pub rank: u32,
    /// The rank it fetches from now (or fetched from last).
    pub parent: u32,
    /// Downloading, done or gone.
    pub state: MemberState,
    /// Its node agent id, when it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub getter: Option<String>,
    /// Parents this member moved away from, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaced: Vec<u32>,
}

/// The answer to `GET /api/v1/broadcasts/{group}`: the tree as it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    /// The group's id.
    pub group: String,
    /// The key it broadcasts.
    pub key: Key,
    /// The version it broadcasts, fixed when the group was created.
    pub version: String,
    /// Children per node.
    pub fanout: u32,
    /// The origin at rank 0 (`store` or the producer's agent id).
    pub origin: String,
    /// Whether the group still accepts joins.
    pub open: bool,
    /// By rank.
    pub members: Vec<MemberInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_parents() {
        assert_eq!(parent_rank(0, 2), None);
        assert_eq!(
            (1..=6)
                .map(|r| parent_rank(r, 2).unwrap())
                .collect::<Vec<_>>(),
            vec![0, 0, 1, 1, 2, 2]
        );
        assert_eq!(parent_rank(51, 50), Some(1));
        assert_eq!(parent_rank(3, 0), Some(2), "fanout 0 reads as 1");
    }

    #[test]
    fn group_ids() {
        assert!(check_group_id("run-42.a_b").is_ok());
        assert!(check_group_id("").is_err());
        assert!(check_group_id("a/b").is_err());
        assert!(check_group_id("join").is_err());
        assert!(check_group_id(&"x".repeat(MAX_GROUP_ID + 1)).is_err());
    }

    #[test]
    fn member_state_names_are_the_wire_names() {
        for s in [MemberState::Active, MemberState::Done, MemberState::Gone] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }

    #[test]
    fn messages_are_tagged() {
        let m = GroupMessage::Release;
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"op":"release"}"#);
        let j: GetterMessage =
            serde_json::from_str(r#"{"op":"done","served_by":"http://a"}"#).unwrap();
        assert_eq!(
            j,
            GetterMessage::Done {
                served_by: Some("http://a".into())
            }
        );
    }
}
