//! Request and response bodies of the HTTP APIs (all under `/api/v1`).
//!
//! Metadata server:
//! - `POST /api/v1/stores` [`RegisterStore`] — a store announces itself
//! - `GET  /api/v1/store` → [`StoreLocation`]
//! - `PUT  /api/v1/keys/{key}` [`RegisterKey`] → [`KeyRecord`] (called by the store on publish)
//! - `GET  /api/v1/keys/{key}` → [`KeyRecord`]
//! - `GET  /api/v1/keys?prefix=P[&recursive=true]` → [`ListResponse`]
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
//! - `POST /api/v1/puts/{session}/commit` [`CommitRequest`] (optional) → [`CommitResponse`]
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

/// The prefix of every API route.
pub const API_PREFIX: &str = "/api/v1";

/// `POST /api/v1/stores`: the store announces where clients reach it (at
/// start, retried until the metadata server answers). The metadata server
/// keeps the last store announced, across restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterStore {
    /// The store's base URL (its advertised URL); must be http(s).
    pub url: String,
}

/// The answer to `GET /api/v1/store` (`no_store` until a store announced
/// itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreLocation {
    /// The store's base URL, as it announced it.
    pub url: String,
}

/// Lifecycle options of a put, carried into the key record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutOptions {
    /// How long the key lives; absent: by the rule of
    /// [`crate::model::Lifespan`] (the metadata server decides: `resource`
    /// under a service's base path and for zero-copy puts, else `cluster`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifespan: Option<Lifespan>,
    /// Time to live in seconds; `None` keeps the key until deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    /// Owning service; defaults to the key's first segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// The answer to `GET /api/v1/owners/{key}` (the store's alone): which
/// service may write a key, asked before the store takes a put from a
/// token limited to some services.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyOwner {
    /// The key asked about.
    pub key: Key,
    /// The service whose base path holds the key (its first segment names
    /// a service the metadata server knows), else the service of the key's
    /// record; `None`: neither (anyone who may put may put it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// True when `service` owns the key by its base path: only that
    /// service's identities (or admin) write there.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub base_path: bool,
}

/// Sent to the metadata server when a version is published: by the store,
/// or by a node agent for a `locale=local` put (with `holder` its id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterKey {
    /// `store` when the store registers (`holder` absent or `store`);
    /// `local` when an agent does, for a local put or GPU data (`holder`
    /// required).
    pub locale: Locale,
    /// Base URL of the origin's read protocol (the store's or the agent's);
    /// http(s), at most 2048 bytes.
    pub source: String,
    /// The agent holding the origin copy; absent for the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Opaque id of the published version. The same version registered
    /// again keeps the key's peers; a new one starts without.
    pub version: String,
    /// True for a directory tree; false for a single file and for GPU data.
    pub is_dir: bool,
    /// Sum of the file sizes, in bytes (of the tensors' sizes for GPU data).
    pub size: u64,
    /// Number of files (of tensors for GPU data).
    pub files: u64,
    /// GPU data: the key's tensors (the record keeps this summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<crate::tensor::TensorSummary>,
    /// Filesystem data: the digest of the version's manifest (blake3 of its
    /// binary encoding, [`crate::codec::to_bytes`]), as its publisher holds
    /// it. Required unless `tensors` is set: the record carries it, and
    /// every getter checks the manifest any source sends against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<crate::Hash>,
    /// The put's lifecycle options, flattened: `lifespan`, `ttl_secs` and
    /// `service` sit at the top level of the object.
    #[serde(flatten)]
    pub options: PutOptions,
    /// A condition on the key's current record; unmet, the registration is
    /// refused with `conflict` and changes nothing. Absent: it applies
    /// whatever the record (a fresh publish: the latest put wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub only_if: Option<RegisterIf>,
}

/// When a conditional [`RegisterKey`] applies. The store retries a
/// registration the metadata server missed, and re-registers its keys when
/// it starts, with [`RegisterIf::AbsentOrHeld`]: neither may undo what
/// happened to the key meanwhile (a `locale=local` put, a delete).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegisterIf {
    /// The key has no record and was not deleted recently (the metadata
    /// server remembers deletions for an hour, in memory: a restart forgets
    /// them), or its record is held by the same holder as the
    /// registration's.
    AbsentOrHeld,
}

/// One name directly below a listed prefix (also what `kt ls -o json`
/// prints, one per name).
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

/// The answer to `GET /api/v1/keys?prefix=P`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListResponse {
    /// The prefix listed, normalised (`""` for the whole namespace).
    pub prefix: String,
    /// One entry per name directly below the prefix, sorted by name; when
    /// the prefix is itself a key with nothing below it, that key alone.
    pub entries: Vec<ListEntry>,
}

/// The answer to a delete: `DELETE /api/v1/keys/{key}` at the metadata
/// server, `DELETE /api/v1/trees/{key}` at the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteResponse {
    /// The keys deleted (at the store: the one key).
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
    /// The key to publish under.
    pub key: Key,
    /// blake3 of the encoded manifest (see `kt_sync::manifest_digest`).
    pub digest: Hash,
    /// The key's lifecycle; the defaults of [`PutOptions`] when absent.
    #[serde(default)]
    pub options: PutOptions,
    /// Manifest indices of files whose hash the client has not computed
    /// yet (it hashes them while it sends them: one read of each; or they
    /// are still arriving from elsewhere, their hashes known by commit).
    /// Each carries [`DEFERRED_HASH`] in the manifest, so `digest` is the
    /// *provisional* digest of the manifest as sent. The store needs them
    /// whole (no reuse, no dedup), and the client sends their
    /// roots at commit ([`CommitRequest::roots`]); the version published
    /// has the real hashes, and its digest is that of the manifest with
    /// them (what a put that hashed first would have sent). Each must be a
    /// regular file, named once: one larger than the store's chunk size
    /// moves in chunks, a smaller one in a batch (the store hashes it as it
    /// writes it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deferred: Vec<u32>,
    /// The chunk values of large files the client hashed because the
    /// store asked ([`PutPlan::hash_first`]): for one the store needs
    /// after all (its content differs from the current version's file of
    /// that path and size), the store copies from that file the chunks
    /// whose values match and answers them in [`PutPlan::have`], so only
    /// changed chunks move. Not part of the digest; a store that predates
    /// them ignores them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<ChunkValues>,
}

/// The blake3 chaining values of one large file's chunks as the client
/// read them ([`PutRequest::chunks`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkValues {
    /// The file's manifest index.
    pub index: u32,
    /// The chunk size they were computed for (the store's, from its plan).
    pub chunk_size: u64,
    /// One per chunk, in order: chunk `n`'s chaining value (a subtree
    /// value at offset `n * chunk_size`, not a root hash).
    pub values: Vec<Hash>,
}

/// The hash a put's manifest carries for an entry whose hash is deferred
/// ([`PutRequest::deferred`]): all zero, a value blake3 gives no content.
pub const DEFERRED_HASH: Hash = Hash([0; 32]);

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
    /// Chunks of needed large files the store already holds, verified, from
    /// an upload of the same tree that a store restart interrupted: not to
    /// be sent again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub have: Vec<HaveChunks>,
    /// The store took the request's [`PutRequest::deferred`] entries as
    /// deferred: it expects their roots at commit. False from a store that
    /// predates deferred hashes (it would check the placeholders): the
    /// client then aborts the session, hashes them and plans again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deferred: bool,
    /// Deferred entries the current version has a file like (same path
    /// and size, whatever its mtime: a `touch` or a checkout that rewrote
    /// the same bytes changes only that): probably unchanged, so the
    /// client hashes them (a large one chunk by chunk, its values sent in
    /// [`PutRequest::chunks`]) and plans again rather than send them
    /// whole. No session is opened.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hash_first: Vec<u32>,
}

/// The body of `POST /api/v1/puts/{session}/commit`; empty (or absent) for
/// a put without deferred entries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRequest {
    /// The root hash of every deferred entry ([`PutRequest::deferred`]),
    /// as the client computed it from the chunks it read. The store
    /// compares each with the root of the chunks it received: any
    /// difference fails the commit (`hash_mismatch`) and publishes nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roots: Vec<DeferredRoot>,
}

/// The root hash of one deferred entry ([`CommitRequest::roots`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeferredRoot {
    /// The entry's manifest index.
    pub index: u32,
    /// blake3 of the file's content.
    pub hash: Hash,
}

/// Chunks of one large file the store holds already ([`PutPlan::have`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaveChunks {
    /// The file's manifest index (one of [`PutPlan::needed`]).
    pub index: u32,
    /// Chunk numbers, ascending.
    pub chunks: Vec<u64>,
}

/// What the store took from one upload request: a batch stream
/// (`PUT .../batch`) or one chunk (`PUT .../chunks/{n}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchAck {
    /// Files of the batch written; always 0 for a chunk.
    pub files: u64,
    /// Bytes of content written (0 for a chunk of a file already complete).
    pub bytes: u64,
}

/// What a transfer moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    /// Files whose content moved.
    pub files_sent: u64,
    /// Bytes of the files whose content moved.
    pub bytes_sent: u64,
    /// Bytes of the files that did not have to move: the other side already
    /// had their content (for a local put, every byte: nothing is copied).
    pub bytes_skipped: u64,
}

/// The machine-readable summary `kt put|get -o json` prints on stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferSummary {
    /// `put` or `get`.
    pub op: String,
    /// The key, normalised.
    pub key: String,
    /// Files in the key.
    pub files: u64,
    /// What moved, flattened: `files_sent`, `bytes_sent` and
    /// `bytes_skipped` sit at the top level of the object.
    #[serde(flatten)]
    pub stats: TransferStats,
    /// True when a put found the store already holding exactly this content.
    #[serde(default)]
    pub unchanged: bool,
    /// Wall-clock duration of the transfer, in seconds.
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
    /// The group joined: the one named, or the id the metadata server gave
    /// an unnamed one.
    pub group: String,
    /// The getter's rank (1 or more; rank 0 is the origin).
    pub rank: u32,
    /// Ranks fetched from, in order (more than one when a parent was replaced).
    pub parents: Vec<u32>,
    /// Bytes its relay served to its children.
    pub relayed: u64,
    /// Where its time went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<MemberTimings>,
}

/// Where a broadcast getter's time went, in milliseconds. The phases come
/// one after the other: `join_ms`, `first_byte_ms`, `receive_ms`,
/// `finish_ms` and `serve_ms` add up to the get's whole time. Within
/// receiving: the pauses with no byte from any parent (`waited_ms`), and
/// the time the pieces took to hash (verify) and to write, summed over the
/// parallel streams (so more than `receive_ms` at times).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberTimings {
    /// Joining the group, until a parent was assigned.
    pub join_ms: u64,
    /// From then to the first content byte from a parent: the parent had
    /// nothing yet, or was slow to answer.
    pub first_byte_ms: u64,
    /// From the first content byte to the last.
    pub receive_ms: u64,
    /// Within `receive_ms`: pauses of 50 ms or more with no byte from any
    /// parent (a parent stalled, or replaced).
    pub waited_ms: u64,
    /// Hashing the pieces received (their check), summed over streams.
    pub hash_ms: u64,
    /// Writing them, summed over streams.
    pub write_ms: u64,
    /// From the last byte to the copy in place (each file's check, rename,
    /// metadata).
    pub finish_ms: u64,
    /// From the copy in place to leaving the group: serving children on.
    pub serve_ms: u64,
    /// CPU time (user and system) of the getter's process during the get,
    /// where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<u64>,
}

/// The answer to `POST /api/v1/puts/{session}/commit`: the version is
/// published. (`unavailable` means published but not yet recorded at the
/// metadata server, which the store retries in the background; `conflict`
/// means files are missing, and the session stays open to send them.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitResponse {
    /// The key's record, as the metadata server made it for the new version.
    pub record: KeyRecord,
}

/// The answer to `GET /api/v1/trees/{key}`: a [`crate::codec`] document whose
/// header is [`ReadHeader`] and whose body is the version's manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadManifest {
    /// The version the read lease pins: every batch and range of the lease
    /// reads it.
    pub version: String,
    /// Read lease id, for `/api/v1/reads/{lease}/...`. Release it with
    /// `DELETE /api/v1/reads/{lease}`; a server releases a lease left idle
    /// for its lease TTL.
    pub lease: String,
    /// Files larger than this are fetched in ranges of this size
    /// (`GET .../files/{index}?offset=O&len=L`), the others in batches.
    pub chunk_size: u64,
    /// The pinned version's manifest.
    pub manifest: Manifest,
}

/// The JSON header of a [`ReadManifest`] document: its fields but the
/// manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadHeader {
    /// See [`ReadManifest::version`].
    pub version: String,
    /// See [`ReadManifest::lease`].
    pub lease: String,
    /// See [`ReadManifest::chunk_size`].
    pub chunk_size: u64,
}

impl ReadManifest {
    /// Encodes this as the document `GET /api/v1/trees/{key}` answers.
    pub fn to_document(&self) -> Vec<u8> {
        let header = ReadHeader {
            version: self.version.clone(),
            lease: self.lease.clone(),
            chunk_size: self.chunk_size,
        };
        crate::codec::encode_document(&header, &self.manifest)
    }

    /// Decodes the answer to `GET /api/v1/trees/{key}`. The manifest is
    /// decoded, not validated: callers still [`Manifest::validate`] it.
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

/// The body of `POST /api/v1/reads/{lease}/batch`: which files to send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRequest {
    /// Indices of file entries of the pinned manifest (any other index is
    /// `invalid_request`); the answer is a [`crate::frame`] stream of their
    /// contents.
    pub indices: Vec<u32>,
}

/// The query of `GET /api/v1/reads/{lease}/files/{index}`: one byte range
/// of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeQuery {
    /// Offset in bytes of the range's first byte in the file.
    pub offset: u64,
    /// Bytes in the range. `offset + len` must not pass the file's size,
    /// and the servers answer at most 64 MiB per request.
    pub len: u64,
}

/// The answer to `GET /api/v1/trees`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeList {
    /// Every key the store holds a published version of, sorted.
    pub keys: Vec<Key>,
}

/// The query of `DELETE /api/v1/keys/{key}` at the metadata server.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteQuery {
    /// Delete every key equal to or below `key` (each at its current
    /// version); `false` when absent. Without it, a name that only has keys
    /// below it is a `conflict`.
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
    /// The version to delete; absent: whatever version is current.
    #[serde(default)]
    pub version: Option<String>,
    /// Only if the metadata server no longer names the store's copy (the
    /// key was taken over by a `locale=local` put, or deleted): the store
    /// asks it under the key's lock, so a put that registered the copy
    /// again meanwhile keeps it (`conflict`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub orphaned: bool,
}

/// The query of `GET /api/v1/keys`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListQuery {
    /// The prefix to list (key grammar); empty or absent: the whole
    /// namespace.
    #[serde(default)]
    pub prefix: String,
    /// `true`: every key strictly below the prefix, at any depth, named by
    /// its path below it, instead of the names directly below it.
    #[serde(default)]
    pub recursive: bool,
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
    /// The lease id: renew it with `PUT /api/v1/leases/{id}`, release it
    /// with `DELETE`, report a failing source with `POST .../failed`.
    pub lease: String,
    /// The source to fetch from: its id, read-protocol URL and version.
    pub source: Source,
    /// Renew (`PUT /api/v1/leases/{id}`) well within this.
    pub ttl_ms: u64,
    /// The key's current record.
    pub record: KeyRecord,
    /// What to present to a peer source (an agent) instead of a bearer
    /// token: a capability to read this key's version there and nothing
    /// else, short-lived ([`crate::auth::Capability`]). Absent when the
    /// source is the store, which is shown the getter's own token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
}

/// The body of `POST /api/v1/leases/{id}/failed`: the leased source failed
/// this getter. The lease ends; after a permanent failure a peer is no
/// longer offered for the key (until a heartbeat of its agent lists the
/// version again), an origin is only released (the getter excludes it from
/// its next request). A transient failure (refused, reset, stalled, 5xx)
/// only releases: the source may serve the next getter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFailure {
    /// What went wrong, for the metadata server's log.
    pub reason: String,
    /// The source may answer again soon: keep offering it.
    #[serde(default)]
    pub transient: bool,
    /// The key and source of the lease, so that a metadata server that no
    /// longer knows the lease (it restarted) still acts on the report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<Key>,
    /// The failed source's id (an agent id or `store`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// One source lease: an item of [`LeaseList`], and the answer to a renewal
/// (`PUT /api/v1/leases/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    /// The lease id.
    pub lease: String,
    /// The key it was granted for.
    pub key: Key,
    /// Id of the leased source: `store` or an agent id.
    pub source: String,
    /// Milliseconds until it expires unless renewed.
    pub expires_in_ms: u64,
}

/// The answer to `GET /api/v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseList {
    /// Every unexpired lease, by id.
    pub leases: Vec<LeaseInfo>,
}

/// What an agent serves: one key's version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    /// The key served.
    pub key: Key,
    /// The version served. One that is not the key's current version (or a
    /// key that is gone) comes back in [`HeartbeatReply::drop`].
    pub version: String,
}

/// An agent's periodic announcement: who it is and everything it serves.
/// The metadata server reconciles its peers with it on every beat, so an
/// agent or metadata restart heals by itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentHeartbeat {
    /// Unique per pod (the pod's name).
    pub id: String,
    /// Base URL of the agent's read protocol, where getters fetch what it
    /// serves; http(s), at most 2048 bytes.
    pub url: String,
    /// The service the agent's pod belongs to: tearing that service down
    /// evicts the agent. Absent: the service known from earlier beats stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Everything the agent serves now (exported trees and copies,
    /// published tensor registrations); empty when absent.
    #[serde(default)]
    pub serves: Vec<Served>,
}

/// The metadata server's answer to a heartbeat (`POST /api/v1/agents`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// Beat at least this often; an agent silent for `ttl_ms` is evicted.
    pub interval_ms: u64,
    /// Milliseconds of silence after which the agent stops being a source
    /// and is evicted.
    pub ttl_ms: u64,
    /// Served keys the agent should drop: deleted, superseded by a newer
    /// version, or not the agent's to serve (its token may not read them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<Key>,
    /// The public keys capabilities are signed with
    /// ([`crate::auth::Capability`]; Ed25519, base64url without padding),
    /// newest first: the agent accepts a capability signed by any of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capability_keys: Vec<String>,
}

/// A node agent as the metadata server knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The agent's id (its pod's name).
    pub id: String,
    /// Base URL of its read protocol.
    pub url: String,
    /// The service its pod belongs to, when it announced one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Unix milliseconds of its last heartbeat (or key registration); a
    /// restarted metadata server counts every agent as seen at its start.
    pub last_seen_ms: u64,
}

/// The answer to `GET /api/v1/agents`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentList {
    /// The live agents (heard from within the agent TTL), by id.
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
