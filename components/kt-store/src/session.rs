//! Upload sessions in progress: what a put still expects, kept in the
//! store's shared state between the requests of one upload.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use kt_sync::apply::ChunkedFile;
use kt_sync::batch::Expected;
use kt_sync::chunk::ChunkAssembly;
use kt_sync::publish::VersionedDir;
use kt_types::{Hash, Key};

use crate::keys::{Claim, VersionMeta};

/// Every open session by id.
pub type Sessions = Mutex<HashMap<String, Arc<PutSession>>>;

/// One large file arriving in chunks.
#[derive(Debug)]
pub(crate) struct ChunkSlot {
    pub(crate) file: RwLock<Option<ChunkedFile>>,
    pub(crate) asm: Mutex<ChunkAssembly>,
    /// Set by the request that completes the file (no other request writes after it).
    pub(crate) done: AtomicBool,
    /// Set once the file is verified and finished (mode, mtime): commit waits for this.
    pub(crate) finished: AtomicBool,
    /// A deferred entry ([`kt_types::api::PutRequest::deferred`]): its
    /// root is not checked on arrival but kept in `root`, for the commit
    /// to compare with the one the client sends.
    pub(crate) deferred: bool,
    /// A deferred entry's root, merged from the chunks received, once all are in.
    pub(crate) root: Mutex<Option<Hash>>,
}

/// An upload in progress: a staging version plus what is still to arrive.
#[derive(Debug)]
pub struct PutSession {
    pub id: String,
    pub key: Key,
    pub(crate) dir: VersionedDir,
    pub(crate) version: String,
    /// Its hold on `version`: no other plan adopts it while this session
    /// (or its commit) lives.
    pub(crate) _claim: Claim,
    pub(crate) meta: Arc<VersionMeta>,
    pub(crate) batch: Arc<HashMap<u32, Expected>>,
    pub(crate) chunked: HashMap<u32, Arc<ChunkSlot>>,
    /// The digest the put was planned with: provisional while `deferred`
    /// entries carry [`kt_types::api::DEFERRED_HASH`].
    pub(crate) digest: Hash,
    /// Entries whose roots the commit brings, ascending.
    pub(crate) deferred: Vec<u32>,
    /// Batch entries written and verified so far.
    pub(crate) received: Mutex<HashSet<u32>>,
    /// Deferred batch entries written so far, with the hash of what was
    /// written (the commit compares it with the client's root).
    pub(crate) hashed: Mutex<HashMap<u32, Hash>>,
    pub(crate) started: Instant,
    pub(crate) touched: Mutex<Instant>,
    pub(crate) bytes_needed: u64,
    /// The staging version's chunk log ([`crate::resume`]); None once closed.
    pub(crate) chunk_log: Mutex<Option<std::fs::File>>,
}

impl PutSession {
    pub(crate) fn touch(&self) {
        *self.touched.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
    pub(crate) fn idle_since(&self) -> Instant {
        *self.touched.lock().unwrap_or_else(|p| p.into_inner())
    }
}
