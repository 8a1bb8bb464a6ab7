//! Request and response bodies of the HTTP APIs (all under `/api/v1`).
//!
//! Metadata server:
//! - `POST /api/v1/stores` [`RegisterStore`] — a store announces itself
//! - `GET  /api/v1/store` → [`StoreLocation`]
//! - `PUT  /api/v1/keys/{key}` [`RegisterKey`] → [`KeyRecord`] (called by the store on publish)
//! - `GET  /api/v1/keys/{key}` → [`KeyRecord`]
//! - `GET  /api/v1/keys?prefix=P` → [`ListResponse`]
//! - `DELETE /api/v1/keys/{key}?recursive=true` → [`DeleteResponse`]
//! - `POST /api/v1/keys/{key}/lease` [`LeaseRequest`] → [`SourceLease`]: the
//!   least-loaded live source, held until released or expired
//! - `PUT  /api/v1/leases/{id}` — renew; `DELETE /api/v1/leases/{id}` — release
//! - `POST /api/v1/leases/{id}/failed` [`SourceFailure`] — the source failed this getter
//! - `GET  /api/v1/leases` → [`LeaseList`] (load per source, for operators and tests)
//! - `POST /api/v1/agents` [`AgentHeartbeat`] → [`HeartbeatReply`]
//! - `GET  /api/v1/agents` → [`AgentList`]
//! - `DELETE /api/v1/services/{name}` → [`TeardownResponse`]
//! - `GET  /api/v1/broadcasts/join` — upgrades to the WebSocket of one
//!   broadcast member ([`crate::broadcast`]: join, parents, releases)
//! - `GET  /api/v1/broadcasts/{group}` → [`crate::broadcast::GroupInfo`]
//! - `POST /api/v1/quorums/{group}/join` [`crate::tensor::QuorumJoin`] →
//!   [`crate::tensor::QuorumPlan`], long-polled until the group's open round
//!   closes (GPU broadcasts; in memory only)
//! - `GET  /api/v1/quorums/{group}` → [`crate::tensor::QuorumInfo`] (open
//!   round, kept transfers)
//! - `PUT  /api/v1/quorums/{group}/{transfer}/rendezvous`
//!   [`crate::tensor::Rendezvous`] (rank 0, once); `GET` of it, long-polled
//!   (`?wait_ms=N`)
//! - `POST /api/v1/quorums/{group}/{transfer}/done` [`crate::tensor::QuorumDone`]
//!   → [`crate::tensor::QuorumStatus`] (once per rank)
//! - `GET  /api/v1/quorums/{group}/{transfer}?wait_ms=N` →
//!   [`crate::tensor::QuorumStatus`], long-polled until every rank reported
//!
//! Node agent (read-only): the read half of the store protocol below
//! (`/api/v1/trees/{key}`, `/api/v1/reads/...`), for what it exports.
//!
//! Store server (the sync protocol):
//! - `POST /api/v1/puts` (a codec document: [`PutRequest`] + manifest) → [`PutPlan`]
//! - `PUT  /api/v1/puts/{session}/batch` (frame stream, see [`crate::frame`]) → [`BatchAck`]
//! - `PUT  /api/v1/puts/{session}/files/{index}/chunks/{n}` (raw bytes) → [`BatchAck`]
//! - `POST /api/v1/puts/{session}/commit` → [`CommitResponse`]
//! - `DELETE /api/v1/puts/{session}` — abort
//! - `GET  /api/v1/trees/{key}` → [`ReadManifest`] as a codec document (opens a read lease pinning the version)
//! - `POST /api/v1/reads/{lease}/batch` [`BatchRequest`] → frame stream
//! - `GET  /api/v1/reads/{lease}/files/{index}?offset=O&len=L` → raw bytes
//! - `DELETE /api/v1/reads/{lease}` — release
//! - `DELETE /api/v1/trees/{key}` → [`DeleteResponse`]
//! - `GET  /api/v1/trees` → [`TreeList`]

use serde::{Deserialize, Serialize};

use crate::key::Key;
use crate::manifest::{Hash, Manifest};
use crate::model::{KeyRecord, Lifespan, Locale, Source};

pub const API_PREFIX: &str = "/api/v1";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterStore {
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreLocation {
    pub url: String,
}

/// Lifecycle options of a put, carried into the key record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutOptions {
    #[serde(default)]
    pub lifespan: Lifespan,
    /// Time to live in seconds; `None` keeps the key until deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    /// Owning service; defaults to the key's first segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// Sent to the metadata server when a version is published: by the store,
/// or by a node agent for a `locale=local` put (with `holder` its id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterKey {
    pub locale: Locale,
    pub source: String,
    /// The agent holding the origin copy; absent for the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    pub version: String,
    pub is_dir: bool,
    pub size: u64,
    pub files: u64,
    /// GPU data: the key's tensors (the record keeps this summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<crate::tensor::TensorSummary>,
    #[serde(flatten)]
    pub options: PutOptions,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListEntry {
    /// The segment below the listed prefix.
    pub name: String,
    /// Full key (or key prefix) of this entry.
    pub key: String,
    /// True when other keys lie below this name.
    pub has_children: bool,
    /// The key's record when `key` itself is a key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<KeyRecord>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListResponse {
    pub prefix: String,
    pub entries: Vec<ListEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteResponse {
    pub deleted: Vec<Key>,
}

/// Starts a put: the header of the `POST /api/v1/puts` body, which is a
/// [`crate::codec`] document (this header, then the encoded manifest).
///
/// The first request may carry the header alone: when the store's current
/// version has the same digest nothing moves; otherwise the store answers
/// `need_manifest` and the client sends the document again with the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PutRequest {
    pub key: Key,
    /// blake3 of the encoded manifest (see `kt_sync::manifest_digest`).
    pub digest: Hash,
    #[serde(default)]
    pub options: PutOptions,
}

/// The store's answer to a put: which entries it needs the content of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutPlan {
    /// Upload session; absent when the tree is unchanged and nothing is to be done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Manifest indices of files whose content must be sent.
    pub needed: Vec<u32>,
    /// Files larger than this are sent in chunks of this size.
    pub chunk_size: u64,
    /// The tree changed (or is new): send the request again with the manifest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub need_manifest: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchAck {
    pub files: u64,
    pub bytes: u64,
}

/// What a transfer moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    pub files_sent: u64,
    pub bytes_sent: u64,
    pub bytes_skipped: u64,
}

/// The machine-readable summary `kt put|get -o json` prints on stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferSummary {
    /// `put` or `get`.
    pub op: String,
    pub key: String,
    /// Files in the key.
    pub files: u64,
    #[serde(flatten)]
    pub stats: TransferStats,
    /// True when a put found the store already holding exactly this content.
    #[serde(default)]
    pub unchanged: bool,
    pub seconds: f64,
    /// Where a get wrote the data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dest: Option<String>,
    /// For a broadcast get: its place in the tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broadcast: Option<BroadcastPlace>,
}

/// A broadcast getter's place in its tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BroadcastPlace {
    pub group: String,
    pub rank: u32,
    /// Ranks fetched from, in order (more than one when a parent was replaced).
    pub parents: Vec<u32>,
    /// Bytes its relay served to its children.
    pub relayed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitResponse {
    pub record: KeyRecord,
}

/// The answer to `GET /api/v1/trees/{key}`: a [`crate::codec`] document whose
/// header is [`ReadHeader`] and whose body is the version's manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadManifest {
    pub version: String,
    pub lease: String,
    pub chunk_size: u64,
    pub manifest: Manifest,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadHeader {
    pub version: String,
    pub lease: String,
    pub chunk_size: u64,
}

impl ReadManifest {
    pub fn to_document(&self) -> Vec<u8> {
        let header = ReadHeader {
            version: self.version.clone(),
            lease: self.lease.clone(),
            chunk_size: self.chunk_size,
        };
        crate::codec::encode_document(&header, &self.manifest)
    }

    pub fn from_document(bytes: &[u8]) -> Result<Self, crate::codec::CodecError> {
        let (h, encoded): (ReadHeader, &[u8]) = crate::codec::split_document(bytes)?;
        Ok(ReadManifest {
            version: h.version,
            lease: h.lease,
            chunk_size: h.chunk_size,
            manifest: crate::codec::decode(encoded)?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRequest {
    pub indices: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeQuery {
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeList {
    pub keys: Vec<Key>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteQuery {
    #[serde(default)]
    pub recursive: bool,
    /// Only this version of the key (409 when it has moved on); not with
    /// `recursive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// `DELETE /api/v1/trees/{key}?version=V`: with a version, only that version
/// is deleted (409 when the key has moved on).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeDeleteQuery {
    #[serde(default)]
    pub version: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    pub prefix: String,
}

/// A getter asks for a source of a key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRequest {
    /// Source ids that already failed this getter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// The getter's own agent id (never handed itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub getter: Option<String>,
}

/// A source handed to one getter, counted in that source's load until the
/// lease is released or expires (a crashed getter never leaks a slot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceLease {
    pub lease: String,
    pub source: Source,
    /// Renew (`PUT /api/v1/leases/{id}`) well within this.
    pub ttl_ms: u64,
    pub record: KeyRecord,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFailure {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    pub lease: String,
    pub key: Key,
    pub source: String,
    pub expires_in_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseList {
    pub leases: Vec<LeaseInfo>,
}

/// What an agent serves: one key's version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    pub key: Key,
    pub version: String,
}

/// An agent's periodic announcement: who it is and everything it serves.
/// The metadata server reconciles its peers with it on every beat, so an
/// agent or metadata restart heals by itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentHeartbeat {
    /// Unique per pod (the pod's name).
    pub id: String,
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(default)]
    pub serves: Vec<Served>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// Beat at least this often; an agent silent for `ttl_ms` is evicted.
    pub interval_ms: u64,
    pub ttl_ms: u64,
    /// Served keys the agent should drop: deleted, or superseded by a newer
    /// version.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<Key>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub id: String,
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    pub last_seen_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentList {
    pub agents: Vec<AgentInfo>,
}

/// What `DELETE /api/v1/services/{name}` removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TeardownResponse {
    /// The service's `resource` keys.
    pub deleted: Vec<Key>,
    /// The service's agents, no longer sources.
    pub evicted: Vec<String>,
}
