//! put and get: the client side of the sync protocol.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blake3::hazmat::ChainingValue;
use futures::StreamExt;
use kt_api::Api;
use kt_sync::SyncError;
use kt_sync::batch::{SendItem, send_stream};
use kt_sync::chunk::{ChunkAssembly, chunk_count, chunk_cv, chunk_range};
use kt_sync::scan::Kept;
use kt_sync::scan::source_path;
use kt_types::agent::{ControlReply, ControlRequest};
use kt_types::api::{
    BatchAck, ChunkValues, CommitRequest, CommitResponse, DEFERRED_HASH, DeferredRoot,
    LeaseRequest, PutOptions, PutPlan, PutRequest, ReadManifest, SourceLease, TransferStats,
};
use kt_types::codec;
use kt_types::{Entry, Hash, Key, KeyPrefix, KeyRecord, Manifest, paths};

use crate::agent::AgentConn;
use crate::api::Client;
use crate::arriving::{Arrivals, Arriving};
use crate::deadline::{FirstContact, Phase};
use crate::download::{Download, Serving};
use crate::error::ClientError;
use crate::local::{KEEP_BUDGET, balance, blocking, cache_file, scan_cached_deferring};
use crate::progress::Progress;
use crate::relay::Board;
use crate::retry::{Failures, Next, pause};
use kt_types::STORE_HOLDER;

/// Aborts a background task when dropped (also when a get is cancelled).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How far one try at a put got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PutStage {
    Started,
    /// Every needed file reached the store.
    Uploaded,
    /// The commit was sent (it may have gone through).
    Committing,
}

/// What a put did.
#[derive(Debug, Clone)]
pub struct PutSummary {
    pub record: Option<KeyRecord>,
    pub stats: TransferStats,
    pub files: u64,
    pub unchanged: bool,
    pub duration: Duration,
}

/// What a get did.
#[derive(Debug, Clone)]
pub struct GetSummary {
    pub stats: TransferStats,
    pub files: u64,
    pub dest: PathBuf,
    pub duration: Duration,
}

/// How a get places what it fetches.
#[derive(Debug, Clone, Default)]
pub struct GetOptions {
    /// A mirror get: afterwards a directory destination holds exactly the
    /// key's tree; files and directories the key does not name are removed
    /// (never through a symlink: a link is removed as a link). The default
    /// is additive: what the key does not name is left alone. A single-file
    /// key writes one file either way.
    pub delete: bool,
}

/// What a prefix get (`kt get team/run/`) did.
#[derive(Debug, Default)]
pub struct PrefixSummary {
    /// Every key fetched, with where it went.
    pub gets: Vec<(Key, GetSummary)>,
    /// Keys below the prefix that a file get does not fetch (GPU data),
    /// with why.
    pub skipped: Vec<(Key, String)>,
}

/// The gets of several keys as one result: every summary, sorted by key,
/// or, when any failed, one error with the first failed key's code that
/// names every failed key after `head(failed, total)`.
pub(crate) fn fold_key_gets(
    results: Vec<(Key, Result<GetSummary, ClientError>)>,
    head: impl FnOnce(usize, usize) -> String,
) -> Result<Vec<(Key, GetSummary)>, ClientError> {
    let total = results.len();
    let (mut gets, mut failed) = (Vec::new(), Vec::new());
    for (key, r) in results {
        match r {
            Ok(s) => gets.push((key, s)),
            Err(e) => failed.push((key, e)),
        }
    }
    gets.sort_by(|a, b| a.0.cmp(&b.0));
    if failed.is_empty() {
        return Ok(gets);
    }
    failed.sort_by(|a, b| a.0.cmp(&b.0));
    let code = failed[0].1.code().unwrap_or(kt_types::ErrorCode::Internal);
    let listed: Vec<String> = failed.iter().map(|(k, e)| format!("{k}: {e}")).collect();
    Err(ClientError::Api {
        status: code.http_status(),
        code,
        message: format!("{}: {}", head(failed.len(), total), listed.join("; ")),
    })
}

/// Keys a prefix get fetches at once.
const PREFIX_CONCURRENCY: usize = 4;

/// Files larger than this whose hash the scan cache lacks are not hashed by
/// a put's scan but while they are sent (read once), if the store takes them
/// in chunks; those it does not (no larger than its chunk size, which its
/// first answer tells) are hashed then.
const DEFER_ABOVE: u64 = 4 << 20;

/// Chunk numbers by file index (chunks the store kept, chunks hashed).
type ChunkSets = HashMap<u32, HashSet<u64>>;

/// Chaining values of deferred files' chunks as read, by file index and
/// chunk number.
type Cvs = Arc<std::sync::Mutex<HashMap<u32, BTreeMap<u64, ChainingValue>>>>;

/// The file a deferred entry's first chunk read found (device, inode,
/// ctime), by file index, across a put's attempts.
type Seen = Arc<std::sync::Mutex<HashMap<u32, FileId>>>;
type FileId = (u64, u64, i64, i64);

/// What every read of a deferred file's chunk must find it to be: the size
/// and mtime the scan saw, and the same file (inode, ctime) as its first
/// read by this put. Its hash is the root of what was read, so a file
/// written while it is sent, or between attempts (chunks the store kept
/// are not read again), would publish content that never existed.
#[derive(Clone)]
struct Unchanged {
    index: u32,
    path: String,
    size: u64,
    mtime: (i64, i64),
    seen: Seen,
}

impl Unchanged {
    /// Checks the open file `f` after a chunk of it was read: a message
    /// naming the file when it is not the one scanned.
    fn check(&self, f: &std::fs::File) -> Result<(), String> {
        use std::os::unix::fs::MetadataExt;
        let md = f
            .metadata()
            .map_err(|e| format!("{:?}: {e} (while checking it was not changed)", self.path))?;
        let id = (md.dev(), md.ino(), md.ctime(), md.ctime_nsec());
        let first = *self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(self.index)
            .or_insert(id);
        let what = if md.size() != self.size {
            format!(
                "its size is {} bytes, not the {} scanned",
                md.size(),
                self.size
            )
        } else if (md.mtime(), md.mtime_nsec()) != self.mtime {
            "its mtime is not the one scanned".to_owned()
        } else if first != id {
            "it was written, replaced or had its metadata changed since this put first read it"
                .to_owned()
        } else {
            return Ok(());
        };
        Err(format!(
            "{:?} changed while it was sent ({what}); nothing was published: put it again once it is written",
            self.path
        ))
    }
}

/// A put's tree across its attempts: the scan, the large files whose
/// hashes it defers ([`PutRequest::deferred`]) and the chaining values of
/// their chunks read so far.
struct PutTree {
    /// As scanned; a deferred entry's hash is `None` until this put knows it.
    manifest: Manifest,
    /// Contents of small files the scan read.
    kept: Kept,
    /// Entries whose hashes are deferred, ascending. Only files the store
    /// would not chunk leave it: after a store restart the same request
    /// (the same provisional digest) resumes the interrupted upload.
    deferred: Vec<u32>,
    /// Entries the scan left unhashed and this put hashed whole.
    hashed: Vec<u32>,
    /// The chunk values of the large ones among them, for the store to
    /// copy from its current version the chunks it has
    /// ([`PutRequest::chunks`]).
    chunk_values: Vec<ChunkValues>,
    /// What was read of the deferred files, for `cv_chunk`-byte chunks.
    cvs: Cvs,
    cv_chunk: u64,
    /// The deferred files as first read ([`Unchanged`]).
    seen: Seen,
    /// The request as sent now (its digest provisional while entries are
    /// deferred) and the manifest it carries, encoded.
    req: PutRequest,
    encoded: Vec<u8>,
    /// Files still being written, announced as they are done, with their
    /// hashes ([`Client::put_arriving`]); `None` for a put of a tree as it is.
    arrivals: Option<Arrivals>,
}

impl PutTree {
    fn new(
        key: &Key,
        options: PutOptions,
        manifest: Manifest,
        kept: Kept,
        deferred: Vec<u32>,
    ) -> Self {
        let mut tree = PutTree {
            manifest,
            kept,
            deferred,
            hashed: Vec::new(),
            chunk_values: Vec::new(),
            cvs: Cvs::default(),
            cv_chunk: 0,
            seen: Seen::default(),
            req: PutRequest {
                key: key.clone(),
                digest: Hash([0; 32]),
                options,
                deferred: Vec::new(),
                chunks: Vec::new(),
            },
            encoded: Vec::new(),
            arrivals: None,
        };
        tree.settle();
        tree
    }

    /// Whether entry `i` is a file still arriving or arrived since the put
    /// began (its hash comes with it, not from reading it).
    fn announced(&self, i: u32) -> bool {
        self.arrivals.as_ref().is_some_and(|a| a.announced(i))
    }

    /// Rebuilds the request from the manifest and what is deferred.
    fn settle(&mut self) {
        self.encoded = if self.deferred.is_empty() {
            codec::to_bytes(&self.manifest)
        } else {
            codec::to_bytes(&self.with_hashes(self.deferred.iter().map(|&i| (i, DEFERRED_HASH))))
        };
        self.req.digest = kt_sync::digest_of_encoded(&self.encoded);
        self.req.deferred.clone_from(&self.deferred);
    }

    /// The manifest with `hashes` filled in.
    fn with_hashes(&self, hashes: impl IntoIterator<Item = (u32, Hash)>) -> Manifest {
        let mut m = self.manifest.clone();
        for (i, h) in hashes {
            m.entries[i as usize].hash = Some(h);
        }
        m
    }

    /// Deferred entries of at most `chunk_size` bytes (not sent in chunks)
    /// that this put reads (arriving ones come with their hashes).
    fn deferred_up_to(&self, chunk_size: u64) -> Vec<u32> {
        let m = &self.manifest;
        let small = |i: &&u32| m.entries[**i as usize].size <= chunk_size && !self.announced(**i);
        self.deferred.iter().filter(small).copied().collect()
    }

    /// The request that carries the manifest: with the chunk values of
    /// the files hashed whole (not in the digest-only one: only a store
    /// that stages the tree uses them).
    fn manifest_request(&self) -> PutRequest {
        PutRequest {
            chunks: self.chunk_values.clone(),
            ..self.req.clone()
        }
    }

    /// The store's chunk size: values read for another are of no use.
    fn chunk_size(&mut self, chunk_size: u64) {
        if self.cv_chunk != chunk_size {
            self.cvs.lock().unwrap_or_else(|p| p.into_inner()).clear();
            self.cv_chunk = chunk_size;
        }
    }

    /// Hashes the deferred entries among `which` whole, now (they are no
    /// longer deferred); false when none was. One larger than the store's
    /// `chunk_size` is hashed chunk by chunk (as fast: one read, all
    /// cores), its chunks' values kept for the store (`chunk_values`).
    /// An arriving entry is waited for, its hash the one it arrives with.
    async fn hash_now(
        &mut self,
        src: &Path,
        which: &[u32],
        chunk_size: u64,
    ) -> Result<bool, ClientError> {
        let (arriving, which): (Vec<u32>, Vec<u32>) = which
            .iter()
            .filter(|i| self.deferred.binary_search(i).is_ok())
            .partition(|&&i| self.announced(i));
        let mut hashes = Vec::new();
        if let Some(a) = self.arrivals.as_mut() {
            a.wait_for(&self.manifest, &arriving).await?;
            hashes.extend(arriving.iter().filter_map(|&i| Some((i, a.hash(i)?))));
        }
        let files: Vec<(u32, PathBuf, u64)> = which
            .iter()
            .map(|&i| {
                let e = &self.manifest.entries[i as usize];
                (i, source_path(src, &self.manifest, &e.path), e.size)
            })
            .collect();
        if files.is_empty() && hashes.is_empty() {
            return Ok(false);
        }
        let by_chunks = kt_sync::chunk::check_chunk_size(chunk_size).is_ok();
        let hashed = blocking(move || {
            files
                .into_iter()
                .map(|(i, path, size)| {
                    hash_for_put(i, &path, size, by_chunks.then_some(chunk_size))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
        for (i, h, values) in hashed {
            hashes.push((i, h));
            self.chunk_values.retain(|v| v.index != i);
            self.chunk_values.extend(values);
        }
        for (i, h) in hashes {
            self.manifest.entries[i as usize].hash = Some(h);
            self.deferred.retain(|&d| d != i);
            self.hashed.push(i);
        }
        self.settle();
        Ok(true)
    }

    /// What sends needed entry `i`: its chunks (less those the store kept,
    /// `have`, unless a deferred file's value is still to be read from
    /// them: not in `hashed`) or, not larger than `chunk_size`, one item
    /// of a batch.
    fn file_jobs(
        &mut self,
        src: &Path,
        i: u32,
        chunk_size: u64,
        have: &ChunkSets,
        hashed: &ChunkSets,
    ) -> (Vec<Job>, Option<SendItem>) {
        let e = &self.manifest.entries[i as usize];
        let path = source_path(src, &self.manifest, &e.path);
        if e.size <= chunk_size {
            let item = SendItem {
                index: i,
                path,
                size: e.size,
                entry_path: e.path.clone(),
                data: self.kept.remove(&e.path),
                beneath: None,
            };
            return (Vec::new(), Some(item));
        }
        // A deferred file is hashed as it is read to be sent (an arriving
        // one comes with its hash).
        let cvs = (self.deferred.binary_search(&i).is_ok() && !self.announced(i))
            .then(|| (self.cvs.clone(), chunk_size));
        let unchanged = cvs.as_ref().map(|_| Unchanged {
            index: i,
            path: e.path.clone(),
            size: e.size,
            mtime: (e.mtime, i64::from(e.mtime_nsec)),
            seen: self.seen.clone(),
        });
        let mut jobs = Vec::new();
        for n in 0..chunk_count(e.size, chunk_size) {
            let (offset, len) = chunk_range(e.size, chunk_size, n).unwrap_or_default();
            let kept = have.get(&i).is_some_and(|h| h.contains(&n));
            let known = hashed.get(&i).is_some_and(|h| h.contains(&n));
            if kept && (cvs.is_none() || known) {
                continue;
            }
            // A kept chunk of a deferred file whose value this put
            // lacks is read to be hashed, not sent.
            jobs.push(Job::Chunk {
                index: i,
                n,
                path: path.clone(),
                offset,
                len,
                send: !kept,
                cvs: cvs.clone(),
                unchanged: unchanged.clone(),
            });
        }
        (jobs, None)
    }

    /// The root of deferred entry `i`, once every chunk of it was read
    /// (or it arrived).
    fn root(&self, i: u32) -> Option<Hash> {
        if let Some(h) = self.arrivals.as_ref().and_then(|a| a.hash(i)) {
            return Some(h);
        }
        let size = self.manifest.entries[i as usize].size;
        let cvs = self.cvs.lock().unwrap_or_else(|p| p.into_inner());
        let read = cvs.get(&i).filter(|_| self.cv_chunk > 0)?;
        let mut asm = ChunkAssembly::new(size, self.cv_chunk);
        for (n, cv) in read {
            asm.add_cv(*n, *cv);
        }
        asm.root()
    }

    /// Every deferred entry's root, once all are known (none deferred: empty).
    fn roots(&self) -> Option<Vec<DeferredRoot>> {
        self.deferred
            .iter()
            .map(|&index| self.root(index).map(|hash| DeferredRoot { index, hash }))
            .collect()
    }

    /// With entries deferred whose roots are all known: the request of
    /// the tree with its real hashes (what the store publishes).
    fn resolved_request(&self) -> Option<PutRequest> {
        if self.deferred.is_empty() {
            return None;
        }
        let roots = self.roots()?;
        let m = self.with_hashes(roots.into_iter().map(|r| (r.index, r.hash)));
        Some(PutRequest {
            digest: kt_sync::manifest_digest(&m),
            deferred: Vec::new(),
            ..self.req.clone()
        })
    }

    /// The hashes this put computed that its scan did not.
    fn learned(&self) -> Vec<(u32, Hash)> {
        let hashed = self.hashed.iter().filter_map(|&i| {
            let h = self.manifest.entries[i as usize].hash?;
            Some((i, h))
        });
        let roots = self.roots().unwrap_or_default();
        hashed
            .chain(roots.into_iter().map(|r| (r.index, r.hash)))
            .collect()
    }
}

/// Files that arrived are sent in batches of about this many bytes, or
/// what arrived within [`GATHER`] of the first of them: a request per file
/// would cost more than the file (the store writes a batch's files in one
/// stream).
const ARRIVED_BATCH: u64 = 16 << 20;
const GATHER: Duration = Duration::from_millis(100);

/// Arrived files not sent yet: a batch being gathered, chunks to send.
/// Kept by the upload across calls of [`arrived_jobs`], so that one cut
/// short (it waits in a `select!`) loses nothing.
#[derive(Default)]
struct Gathered {
    batch: Vec<SendItem>,
    bytes: u64,
    chunks: Vec<Job>,
    /// When the first file of `batch` arrived.
    since: Option<Instant>,
}

impl Gathered {
    fn is_empty(&self) -> bool {
        self.batch.is_empty() && self.chunks.is_empty()
    }

    /// The batch (first) and the chunks, taken.
    fn take(&mut self) -> Vec<Job> {
        let mut jobs = Vec::new();
        if !self.batch.is_empty() {
            jobs.push(Job::Batch(std::mem::take(&mut self.batch)));
        }
        jobs.append(&mut self.chunks);
        (self.bytes, self.since) = (0, None);
        jobs
    }
}

/// The uploads of files of an arriving tree ([`Client::put_arriving`]):
/// gathers what arrives, needed files (`later`) into a batch of about
/// [`ARRIVED_BATCH`] bytes or [`GATHER`]'s worth, a large one into chunks
/// (sent at once). An empty batch when nothing arrives for
/// [`crate::arriving::KEEPALIVE`] (it keeps the store's session alive);
/// nothing once every file has arrived and all is taken. Cancel-safe: it
/// waits only for the next arrival, and what arrived is in `gathered`.
async fn arrived_jobs(
    tree: &mut PutTree,
    src: &Path,
    chunk_size: u64,
    (have, hashed): (&ChunkSets, &ChunkSets),
    later: &mut HashSet<u32>,
    gathered: &mut Gathered,
) -> Result<Vec<Job>, ClientError> {
    loop {
        let Some(arrivals) = tree.arrivals.as_mut() else {
            return Ok(gathered.take());
        };
        let first = match arrivals.try_next(&tree.manifest)? {
            Some(i) => Some(i),
            None if arrivals.done() => return Ok(gathered.take()),
            None => {
                let full = gathered.bytes >= ARRIVED_BATCH || !gathered.chunks.is_empty();
                let waited = gathered.since.map(|t| t.elapsed());
                if full || waited.is_some_and(|w| w >= GATHER) {
                    return Ok(gathered.take());
                }
                let wait = match waited {
                    Some(w) => GATHER - w,
                    None => crate::arriving::KEEPALIVE,
                };
                let got = arrivals.next(&tree.manifest, Some(wait)).await?;
                if got.is_none() && gathered.is_empty() && !arrivals.done() {
                    return Ok(vec![Job::Batch(Vec::new())]);
                }
                got
            }
        };
        let Some(i) = first else { continue };
        if later.remove(&i) {
            let (chunks, item) = tree.file_jobs(src, i, chunk_size, have, hashed);
            gathered.chunks.extend(chunks);
            if let Some(item) = item {
                gathered.bytes += item.size;
                gathered.batch.push(item);
                gathered.since.get_or_insert_with(Instant::now);
            }
        }
    }
}

/// The hash of the file at `path` (`size` bytes) that a put hashes
/// whole, and, when it is larger than `chunk_size` (the store's, usable
/// for chunk values), the values of its chunks (the hash is their root).
fn hash_for_put(
    index: u32,
    path: &Path,
    size: u64,
    chunk_size: Option<u64>,
) -> Result<(u32, Hash, Option<ChunkValues>), SyncError> {
    if let Some(chunk_size) = chunk_size.filter(|&c| size > c) {
        let cvs = kt_sync::chunk::file_cvs(path, size, chunk_size)?;
        if let Some(root) = kt_sync::chunk::root_from_cvs(&cvs) {
            let values = cvs.into_iter().map(Hash).collect();
            return Ok((
                index,
                root,
                Some(ChunkValues {
                    index,
                    chunk_size,
                    values,
                }),
            ));
        }
    }
    Ok((index, kt_sync::scan::hash_file(path, size)?, None))
}

enum Job {
    Batch(Vec<SendItem>),
    Chunk {
        index: u32,
        n: u64,
        path: PathBuf,
        offset: u64,
        len: u64,
        /// False: only hashed (the store kept it from an upload a restart
        /// interrupted, and this put lacks its chaining value).
        send: bool,
        /// A deferred file's chunk: its chaining value goes there (chunks
        /// of this size).
        cvs: Option<(Cvs, u64)>,
        /// A deferred file's chunk: the file must be the one scanned.
        unchanged: Option<Unchanged>,
    },
}

/// What a getter shows the source `id` instead of its token: `key` (a
/// capability, a relay's key). Only the store (`None` then) is shown the
/// token; a peer offered without a key gets nothing and is not contacted.
pub(crate) fn shown_to<'k>(id: &str, key: Option<&'k str>) -> Result<Option<&'k str>, ClientError> {
    if key.is_none() && id != STORE_HOLDER {
        let code = kt_types::ErrorCode::Forbidden;
        return Err(ClientError::Api {
            status: code.http_status(),
            code,
            message: format!(
                "source {id} was offered without a capability: a peer is never shown this client's token"
            ),
        });
    }
    Ok(key)
}

impl Client {
    /// Puts a file or directory tree under `key` in the store.
    pub async fn put(
        &self,
        key: &Key,
        src: &Path,
        options: PutOptions,
        progress: Progress,
    ) -> Result<PutSummary, ClientError> {
        self.call(
            || format!("put of {key}"),
            self.put_inner(key, src, options, progress),
        )
        .await
    }

    async fn put_inner(
        &self,
        key: &Key,
        src: &Path,
        options: PutOptions,
        progress: Progress,
    ) -> Result<PutSummary, ClientError> {
        let started = Instant::now();
        // The metadata server first, before a scan that may take long: a
        // stopped one fails the put in seconds.
        let store_url = match self.first_contact(|| self.store_url()).await {
            Ok(url) => Some(url),
            // Reached, and it answered (no store yet, say): the put's own
            // retries below deal with the answer.
            Err(e) if crate::deadline::answered(&e) => None,
            Err(e) => return Err(e),
        };
        crate::deadline::enter(Phase::Transferring);
        let (manifest, kept, deferred) =
            scan_cached_deferring(self, src, KEEP_BUDGET, Some(DEFER_ABOVE)).await?;
        tracing::debug!(
            ms = started.elapsed().as_millis() as u64,
            entries = manifest.entries.len(),
            deferred = deferred.len(),
            "put: scanned"
        );
        let tree = PutTree::new(key, options, manifest, kept, deferred);
        self.put_tree(key, src, tree, store_url, progress, started)
            .await
    }

    /// Puts the tree at `src` under `key` while its files are still being
    /// written ([`crate::arriving`]): the manifest goes to the store first,
    /// each pending file as soon as it arrives; the commit waits for the
    /// last. What is published is what [`Client::put`] of the finished
    /// tree publishes (same manifest, same digest). Arrivals that stop
    /// early, or a file that arrives with another hash than announced,
    /// fail the put with nothing published.
    pub async fn put_arriving(
        &self,
        key: &Key,
        src: &Path,
        tree: Arriving,
        options: PutOptions,
        progress: Progress,
    ) -> Result<PutSummary, ClientError> {
        self.call(
            || format!("put of {key}"),
            self.put_arriving_inner(key, src, tree, options, progress),
        )
        .await
    }

    async fn put_arriving_inner(
        &self,
        key: &Key,
        src: &Path,
        tree: Arriving,
        options: PutOptions,
        progress: Progress,
    ) -> Result<PutSummary, ClientError> {
        let started = Instant::now();
        let Arriving {
            manifest,
            pending,
            arrivals,
        } = tree;
        let arrivals = Arrivals::new(&manifest, pending, arrivals)?;
        let deferred: Vec<u32> = (0..manifest.entries.len() as u32)
            .filter(|&i| {
                let e = &manifest.entries[i as usize];
                e.kind == kt_types::EntryKind::File && e.hash.is_none()
            })
            .collect();
        let store_url = match self.first_contact(|| self.store_url()).await {
            Ok(url) => Some(url),
            Err(e) if crate::deadline::answered(&e) => None,
            Err(e) => return Err(e),
        };
        crate::deadline::enter(Phase::Transferring);
        let mut tree = PutTree::new(key, options, manifest, Kept::default(), deferred);
        tree.arrivals = Some(arrivals);
        self.put_tree(key, src, tree, store_url, progress, started)
            .await
    }

    /// Puts `tree` (read from `src`), trying again while the store fails
    /// it transiently, within the deadline.
    async fn put_tree(
        &self,
        key: &Key,
        src: &Path,
        mut tree: PutTree,
        mut store_url: Option<String>,
        progress: Progress,
        started: Instant,
    ) -> Result<PutSummary, ClientError> {
        // A store that restarts or stalls mid-put is waited for and the put
        // starts over in a new session; the old version stays readable
        // throughout (nothing is published until a commit succeeds).
        let mut failures = Failures::new(self.cfg.deadline);
        let mut committed_before = false;
        loop {
            let mut stage = PutStage::Started;
            let attempt = self
                .put_attempt(
                    store_url.take(),
                    &mut tree,
                    src,
                    &progress,
                    started,
                    &mut stage,
                )
                .await;
            committed_before |= stage == PutStage::Committing;
            match attempt {
                Ok(mut s) => {
                    if s.unchanged && committed_before {
                        // An earlier attempt's commit went through and only
                        // its answer was lost: this put did publish.
                        s.unchanged = false;
                        s.record = self.stat(key).await.ok();
                    }
                    self.remember_hashes(src, &tree).await;
                    return Ok(s);
                }
                Err(e) if e.is_transient() || e.code() == Some(kt_types::ErrorCode::NotFound) => {
                    // The deadline counts from the first failure in a row;
                    // an attempt that got all its data across ends the row.
                    if !failures.any() || stage >= PutStage::Uploaded {
                        failures = Failures::new(self.cfg.deadline);
                    }
                    failures.record(STORE_HOLDER, &e);
                    match failures.when_none_left(&[STORE_HOLDER.to_owned()]) {
                        Next::Now => {}
                        Next::Wait(d) => {
                            tracing::warn!(%key, error = %e, wait_ms = d.as_millis() as u64, "the store failed the put; starting over once it answers");
                            pause(d).await;
                        }
                        Next::GiveUp => {
                            return Err(failures.give_up(&format!("put of {key}"), ""));
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Records in the scan cache the hashes this put computed that its scan
    /// did not (deferred files), so that the next put of them unchanged is
    /// a cache hit. Only files whose size and mtime are still those scanned;
    /// best effort.
    async fn remember_hashes(&self, src: &Path, tree: &PutTree) {
        let learned = tree.learned();
        let Some(cache_path) = cache_file(self, src).filter(|_| !learned.is_empty()) else {
            return;
        };
        let files: Vec<(String, PathBuf, Entry, Hash)> = learned
            .into_iter()
            .map(|(i, hash)| {
                let e = tree.manifest.entries[i as usize].clone();
                let abs = source_path(src, &tree.manifest, &e.path);
                (e.path.clone(), abs, e, hash)
            })
            .collect();
        let saved = blocking(move || {
            let mut cache = kt_sync::ScanCache::load(&cache_path);
            for (rel, abs, e, hash) in files {
                use std::os::unix::fs::MetadataExt;
                let Ok(md) = std::fs::symlink_metadata(&abs) else {
                    continue;
                };
                let same = md.is_file()
                    && (md.size(), md.mtime(), md.mtime_nsec())
                        == (e.size, e.mtime, i64::from(e.mtime_nsec));
                if same {
                    cache.insert(&rel, &md, hash);
                }
            }
            cache.save(&cache_path)
        })
        .await;
        if let Err(e) = saved {
            tracing::debug!(error = %e, "scan cache not updated with the put's hashes");
        }
    }

    /// One try at a put: plan a session with the store (at `store_url`,
    /// else where the metadata server says), upload what it needs, commit;
    /// `stage` tells how far it got.
    async fn put_attempt(
        &self,
        store_url: Option<String>,
        tree: &mut PutTree,
        src: &Path,
        progress: &Progress,
        started: Instant,
        stage: &mut PutStage,
    ) -> Result<PutSummary, ClientError> {
        let total = tree.manifest.total_bytes();
        let files = tree.manifest.file_count();
        let store_url = match store_url {
            Some(u) => u,
            None => self.store_url().await?,
        };
        crate::deadline::enter(Phase::Transferring);
        let store = self.meta.at(&store_url);
        let plan_put = |doc: Vec<u8>| {
            let call = store.post(&paths::puts()).header(
                reqwest::header::CONTENT_TYPE,
                kt_types::codec::DOCUMENT_CONTENT_TYPE,
            );
            crate::stall::answer::<PutPlan>(call.body(doc), self.cfg.deadline)
        };
        let unchanged = || PutSummary {
            record: None,
            stats: TransferStats {
                files_sent: 0,
                bytes_sent: 0,
                bytes_skipped: total,
            },
            files,
            unchanged: true,
            duration: started.elapsed(),
        };
        // Every deferred root known (an earlier attempt read them all): its
        // commit may have gone through, which the real digest tells.
        if let Some(req) = tree.resolved_request() {
            let plan = plan_put(codec::document_with(&req, &[])).await?;
            if plan.session.is_none() && !plan.need_manifest {
                return Ok(unchanged());
            }
        }
        // First the digest alone: an unchanged tree costs one small request.
        let mut plan = plan_put(codec::document_with(&tree.req, &[])).await?;
        while plan.need_manifest || !plan.hash_first.is_empty() {
            // Deferred files the store does not take in chunks are hashed now.
            let small = tree.deferred_up_to(plan.chunk_size);
            tree.hash_now(src, &small, plan.chunk_size).await?;
            // Files the store probably has already: hashed, not sent (a
            // large one by chunks: if it changed after all, the store
            // copies from its own file the chunks that did not).
            let ask = std::mem::take(&mut plan.hash_first);
            if !ask.is_empty() && !tree.hash_now(src, &ask, plan.chunk_size).await? {
                return Err(ClientError::Local(format!(
                    "the store asked to hash entries {ask:?}, whose hashes are not deferred"
                )));
            }
            tree.chunk_size(plan.chunk_size);
            plan = plan_put(codec::document_with(
                &tree.manifest_request(),
                &tree.encoded,
            ))
            .await?;
            if let Some(session) = plan
                .session
                .as_deref()
                .filter(|_| !tree.deferred.is_empty() && !plan.deferred)
            {
                // A store that predates deferred hashes would check the
                // placeholders: hash every file and plan again.
                let _ = store
                    .delete(&paths::put_session(session))
                    .timeout(self.cfg.stall)
                    .ok()
                    .await;
                let all = tree.deferred.clone();
                tree.hash_now(src, &all, plan.chunk_size).await?;
                plan.need_manifest = true;
            }
        }
        let Some(session) = plan.session.clone() else {
            return Ok(unchanged());
        };
        tracing::debug!(
            ms = started.elapsed().as_millis() as u64,
            needed = plan.needed.len(),
            deferred = tree.deferred.len(),
            "put: planned"
        );
        let result = self
            .upload(&store, &session, src, tree, &plan, progress.clone())
            .await;
        progress.finish();
        let stats = match result {
            Ok(stats) => {
                *stage = PutStage::Uploaded;
                stats
            }
            Err(e) => {
                // Best effort, and bounded: the store may be the one that stalled.
                let _ = store
                    .delete(&paths::put_session(&session))
                    .timeout(self.cfg.stall)
                    .ok()
                    .await;
                return Err(e);
            }
        };
        tracing::debug!(ms = started.elapsed().as_millis() as u64, "put: uploaded");
        let roots = tree.roots().ok_or_else(|| {
            ClientError::Local("a deferred file was not read whole: its hash is unknown".into())
        })?;
        *stage = PutStage::Committing;
        crate::deadline::enter(Phase::Committing);
        // Staging a plan and finishing a commit take the store time in
        // proportion to the tree (links, modes, a registration): their
        // answers are waited for up to the deadline, not the stall timeout.
        let mut call = store.post(&paths::put_commit(&session));
        if !roots.is_empty() {
            call = call.json(&CommitRequest { roots });
        }
        let commit: CommitResponse = crate::stall::answer(call, self.cfg.deadline).await?;
        Ok(PutSummary {
            record: Some(commit.record),
            stats: TransferStats {
                bytes_skipped: total - stats.bytes_sent,
                ..stats
            },
            files,
            unchanged: false,
            duration: started.elapsed(),
        })
    }

    async fn upload(
        &self,
        store: &Api,
        session: &str,
        src: &Path,
        tree: &mut PutTree,
        plan: &PutPlan,
        progress: Progress,
    ) -> Result<TransferStats, ClientError> {
        let mut small = Vec::new();
        let mut jobs = Vec::new();
        let mut stats = TransferStats::default();
        // Chunks the store kept from an upload a restart interrupted.
        let have: ChunkSets = plan
            .have
            .iter()
            .map(|h| (h.index, h.chunks.iter().copied().collect()))
            .collect();
        // Chunks of deferred files already hashed (by an earlier attempt).
        let hashed: ChunkSets = tree
            .cvs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(i, cvs)| (*i, cvs.keys().copied().collect()))
            .collect();
        let chunk_size = plan.chunk_size;
        let kept = |i: u32, size: u64| -> u64 {
            let Some(h) = have.get(&i).filter(|_| size > chunk_size) else {
                return 0;
            };
            h.iter()
                .filter_map(|&n| chunk_range(size, chunk_size, n).map(|(_, len)| len))
                .sum()
        };
        // Needed files still arriving: sent as they arrive.
        let mut later = HashSet::new();
        for &i in &plan.needed {
            let e = tree.manifest.entries.get(i as usize).ok_or_else(|| {
                ClientError::Local(format!("store asked for entry #{i}, which does not exist"))
            })?;
            stats.files_sent += 1;
            stats.bytes_sent += e.size - kept(i, e.size);
            if tree.arrivals.as_ref().is_some_and(|a| a.is_pending(i)) {
                later.insert(i);
                continue;
            }
            let (chunks, item) = tree.file_jobs(src, i, chunk_size, &have, &hashed);
            jobs.extend(chunks);
            small.extend(item.map(|item| (item.size, item)));
        }
        progress.start(stats.bytes_sent, stats.files_sent);
        for group in balance(small, self.cfg.streams) {
            jobs.push(Job::Batch(group));
        }
        // Batches first: they are latency-bound, chunks bandwidth-bound.
        jobs.reverse();
        let mut queue: std::collections::VecDeque<Job> = jobs.into();
        let streams = self.cfg.streams.max(1);
        let mut running = futures::stream::FuturesUnordered::new();
        let mut gathered = Gathered::default();
        loop {
            while running.len() < streams {
                let Some(job) = queue.pop_front() else { break };
                running.push(Self::run_upload_job(
                    store,
                    session,
                    job,
                    progress.clone(),
                    self.cfg.stall,
                ));
            }
            // Files still arriving are taken when a stream is free (all
            // that arrived meanwhile go in one batch).
            let waiting = tree.arrivals.as_ref().is_some_and(|a| !a.done()) || !gathered.is_empty();
            if running.is_empty() && !waiting {
                break;
            }
            let take = waiting && running.len() < streams;
            tokio::select! {
                done = running.next(), if !running.is_empty() => {
                    if let Some(r) = done {
                        r?;
                    }
                }
                arrived = arrived_jobs(tree, src, chunk_size, (&have, &hashed), &mut later, &mut gathered), if take => {
                    queue.extend(arrived?);
                }
            }
        }
        Ok(stats)
    }

    async fn run_upload_job(
        store: &Api,
        session: &str,
        job: Job,
        progress: Progress,
        stall: Duration,
    ) -> Result<(), ClientError> {
        match job {
            Job::Batch(items) => {
                let body = Box::pin(send_stream(items, progress.callback()));
                let _: BatchAck =
                    crate::stall::upload(store.put(&paths::put_batch(session)), body, stall)
                        .await?;
            }
            Job::Chunk {
                index,
                n,
                path,
                offset,
                len,
                send,
                cvs,
                unchanged,
            } => {
                let data = blocking(move || {
                    use std::io::{Read, Seek, SeekFrom};
                    let mut f = std::fs::File::open(&path).map_err(|e| SyncError::io(&path, e))?;
                    f.seek(SeekFrom::Start(offset))
                        .map_err(|e| SyncError::io(&path, e))?;
                    // Read into spare capacity: no zeroing pass over the buffer.
                    let mut buf = Vec::with_capacity(len as usize);
                    (&f).take(len)
                        .read_to_end(&mut buf)
                        .map_err(|e| SyncError::io(&path, e))?;
                    if buf.len() as u64 != len {
                        return Err(SyncError::SizeMismatch {
                            path: path.display().to_string(),
                            expected: len,
                            actual: buf.len() as u64,
                        });
                    }
                    // Checked after the read: what was read is the file scanned.
                    Ok(match unchanged.map(|u| u.check(&f)) {
                        Some(Err(changed)) => Err(changed),
                        _ => Ok(bytes::Bytes::from(buf)),
                    })
                })
                .await?
                .map_err(ClientError::Local)?;
                // A deferred file's chunk is hashed beside its upload.
                let hashing = cvs.as_ref().map(|(_, chunk_size)| {
                    let (data, chunk_size) = (data.clone(), *chunk_size);
                    kt_sync::task::spawn(move || chunk_cv(&data, n, chunk_size))
                });
                if send {
                    let body = futures::stream::iter([Ok::<_, std::io::Error>(data)]);
                    let _: BatchAck = crate::stall::upload(
                        store.put(&paths::put_chunk(session, index as usize, n)),
                        body,
                        stall,
                    )
                    .await?;
                    progress.advance(len);
                }
                if let (Some(hashing), Some((cvs, _))) = (hashing, cvs) {
                    let cv = hashing.await?;
                    cvs.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(index)
                        .or_default()
                        .insert(n, cv);
                }
            }
        }
        Ok(())
    }

    /// Gets `key` into `dest`.
    ///
    /// A directory key makes `dest` a directory holding the tree (files already
    /// there with the same content are kept, others are replaced one by one,
    /// atomically; files not in the tree are left alone). A single-file key is
    /// written to `dest`, or into it under the file's name when `dest` is an
    /// existing directory.
    pub async fn get(
        &self,
        key: &Key,
        dest: &Path,
        progress: Progress,
    ) -> Result<GetSummary, ClientError> {
        self.get_with(key, dest, &GetOptions::default(), progress)
            .await
    }

    /// [`Client::get`] with options (a mirror get).
    pub async fn get_with(
        &self,
        key: &Key,
        dest: &Path,
        opts: &GetOptions,
        progress: Progress,
    ) -> Result<GetSummary, ClientError> {
        let got = self
            .call(
                || format!("get of {key}"),
                self.get_inner(key, dest, opts, progress),
            )
            .await;
        match got {
            Err(e) if e.code() == Some(kt_types::ErrorCode::NotFound) => {
                Err(self.hint_prefix(key, e).await)
            }
            r => r,
        }
    }

    /// A get of a missing `key` that has keys below it: the error `e`
    /// says to ask for `key/` (one small listing, bounded like any call).
    async fn hint_prefix(&self, key: &Key, e: ClientError) -> ClientError {
        let ClientError::Api {
            status, message, ..
        } = &e
        else {
            return e;
        };
        let Ok(prefix) = KeyPrefix::parse(key.as_str()) else {
            return e;
        };
        let below = tokio::time::timeout(self.cfg.stall, self.ls(&prefix)).await;
        match below {
            Ok(Ok(l)) if l.entries.iter().any(|e| e.key != key.as_str()) => ClientError::Api {
                status: *status,
                code: kt_types::ErrorCode::NotFound,
                message: format!("{message}; keys lie below it: did you mean `{key}/`?"),
            },
            _ => e,
        }
    }

    async fn get_inner(
        &self,
        key: &Key,
        dest: &Path,
        opts: &GetOptions,
        progress: Progress,
    ) -> Result<GetSummary, ClientError> {
        Ok(self.get_core(key, dest, opts, progress, None).await?.0)
    }

    /// A get of `key` into `dest` (sources, failover, deadlines: every get
    /// goes through here). With `only`, just those files of the key's tree
    /// are fetched (see [`Download::plan`]) and the copy is not offered to
    /// this node's agent: it is not the whole key. Returns the download too
    /// (its manifest: what the key holds).
    pub(crate) async fn get_core(
        &self,
        key: &Key,
        dest: &Path,
        opts: &GetOptions,
        progress: Progress,
        only: Option<&crate::download::Only>,
    ) -> Result<(GetSummary, Download), ClientError> {
        let started = Instant::now();
        // Counted from the call's start: a frozen agent does not add to it.
        let mut contact = Some(FirstContact::new(
            &self.cfg.metadata_url,
            self.cfg.connect_timeout,
        ));
        let mut agent = match only {
            None => self.agent_if_serving().await,
            Some(_) => None,
        };
        let getter = agent.as_ref().map(|a| a.id.clone());
        let mut failures = Failures::new(self.cfg.deadline);
        let mut meta_backoff =
            kt_api::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        // Kept across sources: a failover fetches only what is missing.
        let mut dl: Option<Download> = None;
        // Files placed for a version the key moved past mid-get.
        let mut stale: Vec<PathBuf> = Vec::new();
        loop {
            if contact.is_none() {
                crate::deadline::enter(Phase::WaitingForSource);
            }
            let exclude = failures.exclude();
            let lease = self.lease(key, &exclude, getter.clone()).await;
            if lease.as_ref().is_err_and(crate::deadline::answered) {
                // It answered: the metadata server is reached.
                contact = None;
            }
            let lease = match lease {
                Ok(l) => {
                    meta_backoff.reset();
                    contact = None;
                    l
                }
                // The metadata server never answered yet in this call: tried
                // again within the connect timeout only.
                Err(e) if e.is_transient() && contact.is_some() => {
                    if let Some(c) = contact.as_mut()
                        && let Err(e) = c.failed(e).await
                    {
                        progress.finish();
                        return Err(e);
                    }
                    continue;
                }
                // Every source failed us for now: wait for a transient one.
                Err(e) if e.code() == Some(kt_types::ErrorCode::NoSource) && failures.any() => {
                    match failures.when_none_left(&exclude) {
                        Next::Now => continue,
                        Next::Wait(d) => {
                            pause(d).await;
                            continue;
                        }
                        Next::GiveUp => {
                            progress.finish();
                            let what = format!("get of {key}");
                            return Err(failures.give_up(&what, &e.to_string()));
                        }
                    }
                }
                // The metadata server is restarting or unreachable.
                Err(e) if e.is_transient() => {
                    match failures.when_metadata_failed(&mut meta_backoff) {
                        Next::GiveUp => {
                            progress.finish();
                            let what = format!("get of {key}");
                            return Err(
                                failures.give_up(&what, &format!("the metadata server: {e}"))
                            );
                        }
                        Next::Wait(d) => {
                            tracing::warn!(%key, error = %e, "the metadata server failed; trying again");
                            pause(d).await;
                            continue;
                        }
                        Next::Now => continue,
                    }
                }
                Err(e) => {
                    progress.finish();
                    return Err(e);
                }
            };
            // The key moved on to another version: start over for it.
            if dl
                .as_ref()
                .is_some_and(|d| d.read.version != lease.source.version)
                && let Some(old) = dl.take()
            {
                stale.extend(old.placed_files());
            }
            crate::deadline::enter(Phase::Transferring);
            let before = Download::mark(&dl);
            let renewal = AbortOnDrop(self.keep_lease(&lease));
            let result = match shown_to(&lease.source.id, lease.capability.as_deref()) {
                Ok(credential) => {
                    self.fetch_from_selected(
                        (&lease.source.url, credential),
                        (&lease.source.version, lease.record.digest.as_ref()),
                        key,
                        dest,
                        &mut dl,
                        None,
                        &progress,
                        self.cfg.stall,
                        only,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            drop(renewal);
            if before.advanced(&dl) {
                failures.progressed();
                failures.recovered(&lease.source.id);
            }
            let release = || {
                self.meta
                    .delete(&paths::lease(&lease.lease))
                    .timeout(self.cfg.stall)
                    .ok()
            };
            match result {
                Ok(()) => {
                    let _ = release().await;
                    progress.finish();
                    let Some(d) = dl else {
                        return Err(ClientError::Local("no download was planned".into()));
                    };
                    d.remove_stale(std::mem::take(&mut stale)).await;
                    d.finish(opts.delete, self.cfg.deadline).await?;
                    if let Some(a) = agent.as_mut() {
                        self.serve_copy(a, key, &d.read, &d.final_dest).await;
                    }
                    let files = match only {
                        Some(only) => only.len() as u64,
                        None => d.read.manifest.file_count(),
                    };
                    let summary = GetSummary {
                        stats: d.stats,
                        files,
                        dest: d.final_dest.clone(),
                        duration: started.elapsed(),
                    };
                    return Ok((summary, d));
                }
                Err(e) if e.is_source_failure() => {
                    let id = &lease.source.id;
                    tracing::warn!(%key, source = %id, error = %e, transient = e.retryable_at(id), "source failed; trying another");
                    self.report_failure(&lease, key, &e).await;
                    failures.record(id, &e);
                    // Sources that keep failing one after another never
                    // leave the lease loop: the deadline is checked here too.
                    if failures.expired() {
                        progress.finish();
                        return Err(failures.give_up(&format!("get of {key}"), ""));
                    }
                }
                Err(e) => {
                    let _ = release().await;
                    progress.finish();
                    return Err(e);
                }
            }
        }
    }

    /// Tells the metadata server that `lease`'s source failed us (which
    /// ends the lease). A permanent failure of a peer stops it being
    /// offered; a transient one does not. The key and source ride along,
    /// so a metadata server that forgot the lease (restarted) still learns.
    pub(crate) async fn report_failure(&self, lease: &SourceLease, key: &Key, e: &ClientError) {
        let body = kt_types::api::SourceFailure {
            reason: e.to_string(),
            transient: e.retryable_at(&lease.source.id),
            key: Some(key.clone()),
            source: Some(lease.source.id.clone()),
        };
        let _ = self
            .meta
            .post(&paths::lease_failed(&lease.lease))
            .json(&body)
            .timeout(self.cfg.stall)
            .ok()
            .await;
    }

    /// Gets every key below `prefix` (a prefix get, `kt get team/run/`):
    /// each into `dest/<its path below the prefix>`, a few at once, shards
    /// of many producers in one call. GPU data keys are skipped (they go
    /// into memory, not files). What was fetched stays when another key
    /// fails; the error then names every key that failed.
    pub async fn get_prefix(
        &self,
        prefix: &KeyPrefix,
        dest: &Path,
        opts: &GetOptions,
    ) -> Result<PrefixSummary, ClientError> {
        self.call(
            || format!("get of {prefix}/"),
            self.get_prefix_inner(prefix, dest, opts),
        )
        .await
    }

    async fn get_prefix_inner(
        &self,
        prefix: &KeyPrefix,
        dest: &Path,
        opts: &GetOptions,
    ) -> Result<PrefixSummary, ClientError> {
        let listed = self.ls_below(prefix).await?;
        let mut summary = PrefixSummary::default();
        let mut todo = Vec::new();
        for e in listed.entries {
            let Some(record) = e.record else { continue };
            if record.tensors.is_some() {
                summary
                    .skipped
                    .push((record.key, "GPU data: get it with kt tensor get".into()));
                continue;
            }
            todo.push((record.key, dest.join(&e.name)));
        }
        if todo.is_empty() && summary.skipped.is_empty() {
            return Err(ClientError::Api {
                status: 404,
                code: kt_types::ErrorCode::NotFound,
                message: format!("no keys below {prefix}/"),
            });
        }
        let results: Vec<(Key, Result<GetSummary, ClientError>)> =
            futures::stream::iter(todo.into_iter().map(|(key, to)| async move {
                let r = self.get_with(&key, &to, opts, Progress::none()).await;
                (key, r)
            }))
            .buffer_unordered(PREFIX_CONCURRENCY)
            .collect()
            .await;
        let fetched = results.iter().filter(|(_, r)| r.is_ok()).count();
        summary.gets = fold_key_gets(results, |failed, total| {
            format!("{failed} of {total} keys below {prefix}/ failed ({fetched} fetched)")
        })?;
        Ok(summary)
    }

    /// A lease on the least-loaded live source of `key`.
    async fn lease(
        &self,
        key: &Key,
        exclude: &[String],
        getter: Option<String>,
    ) -> Result<SourceLease, ClientError> {
        let req = LeaseRequest {
            exclude: exclude.to_vec(),
            getter,
        };
        // A metadata server that does not answer within the stall timeout
        // counts as away for now (transient), like one that refuses.
        Ok(self
            .meta
            .post(&paths::key_lease(key))
            .json(&req)
            .timeout(self.cfg.stall)
            .fetch()
            .await?)
    }

    /// Renews `lease` in the background until aborted.
    fn keep_lease(&self, lease: &SourceLease) -> tokio::task::JoinHandle<()> {
        let meta = self.meta.clone();
        let path = paths::lease(&lease.lease);
        let every = Duration::from_millis((lease.ttl_ms / 3).max(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match meta.put(&path).timeout(every).ok().await {
                    Ok(_) => {}
                    // Released, expired, or forgotten by a restart: the get
                    // goes on without it.
                    Err(e) if e.code() == kt_types::ErrorCode::NotFound => return,
                    Err(e) => tracing::warn!(error = %e, "renewing a source lease"),
                }
            }
        })
    }

    /// This pod's agent, when copies are served (to learn our own id, and
    /// to serve the copy). An agent that cannot be reached or started never
    /// fails a get: the copy is just not shared.
    pub(crate) async fn agent_if_serving(&self) -> Option<AgentConn> {
        if !self.cfg.serve_copies {
            return None;
        }
        self.agent_for_copies().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no node agent: this copy will not be shared");
            None
        })
    }

    /// This pod's agent for serving copies: the running one, or (inside a
    /// pod) one started on demand. Outside pods without an agent: none.
    async fn agent_for_copies(&self) -> Result<Option<AgentConn>, ClientError> {
        if let Some(a) = AgentConn::connect(&self.cfg.agent_socket).await? {
            return Ok(Some(a));
        }
        if self.cfg.agent_autostart && std::env::var_os(kt_types::env::POD_IP).is_some() {
            return AgentConn::connect_or_start_as(
                &self.cfg.agent_socket,
                &self.cfg.metadata_url,
                &self.cfg.token,
                true,
            )
            .await
            .map(Some);
        }
        Ok(None)
    }

    /// Tells the agent to serve what a get wrote. A failure here never fails
    /// the get: the copy is there, it just is not shared.
    /// Returns whether the agent took it.
    pub(crate) async fn serve_copy(
        &self,
        agent: &mut AgentConn,
        key: &Key,
        read: &ReadManifest,
        dest: &Path,
    ) -> bool {
        let path = std::path::absolute(dest).unwrap_or_else(|_| dest.to_owned());
        let req = ControlRequest::ExportCopy {
            key: key.clone(),
            version: read.version.clone(),
            path: path.display().to_string(),
            manifest: read.manifest.clone(),
        };
        // Bounded: a frozen agent must not hold a finished get.
        match tokio::time::timeout(self.cfg.stall, agent.request(&req)).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                tracing::warn!(%key, error = %e, "the node agent did not take the copy; it is not shared");
                false
            }
            Err(_) => {
                tracing::warn!(%key, stall = ?self.cfg.stall, "the node agent did not answer; the copy is not shared");
                false
            }
        }
    }

    /// `kt put --locale local`: the node agent serves `src` where it is and
    /// registers this pod as the key's origin. Nothing is copied.
    pub async fn put_local(
        &self,
        key: &Key,
        src: &Path,
        options: PutOptions,
    ) -> Result<PutSummary, ClientError> {
        self.call(
            || format!("put of {key}"),
            self.put_local_inner(key, src, options),
        )
        .await
    }

    async fn put_local_inner(
        &self,
        key: &Key,
        src: &Path,
        options: PutOptions,
    ) -> Result<PutSummary, ClientError> {
        let started = Instant::now();
        let path = std::path::absolute(src)
            .map_err(|e| ClientError::Local(format!("{}: {e}", src.display())))?;
        if !path.exists() {
            return Err(ClientError::Sync(SyncError::NotFound { path }));
        }
        // The agent registers the key there: a stopped metadata server
        // fails the put in seconds, before an agent is started for it.
        self.first_contact(|| async {
            Ok(self
                .meta
                .get("/healthz")
                .timeout(self.cfg.stall)
                .ok()
                .await?)
        })
        .await?;
        crate::deadline::enter(Phase::WaitingForAgent);
        let mut agent = AgentConn::connect_or_start_as(
            &self.cfg.agent_socket,
            &self.cfg.metadata_url,
            &self.cfg.token,
            self.cfg.agent_autostart,
        )
        .await?;
        let reply = agent
            .request(&ControlRequest::ExportLocal {
                key: key.clone(),
                path: path.display().to_string(),
                options,
            })
            .await?;
        let ControlReply::Exported { export, record } = reply else {
            return Err(ClientError::Local(format!(
                "unexpected reply from the node agent: {reply:?}"
            )));
        };
        Ok(PutSummary {
            record: record.map(|r| *r),
            stats: TransferStats {
                files_sent: 0,
                bytes_sent: 0,
                bytes_skipped: export.size,
            },
            files: export.files,
            unchanged: false,
            duration: started.elapsed(),
        })
    }

    /// One attempt at one source: opens `key` there (it must serve
    /// `version`), plans `dl` from its manifest on first use, fetches what
    /// `dl` still misses, and releases the read.
    ///
    /// `source_key` is what the source is shown instead of this client's
    /// token (a relay's key, a capability); only the store, given `None`,
    /// is shown the token. Where `digest` is known (the key's record), the
    /// source's manifest is used only if it hashes to it: a source serving
    /// anything but the published version fails, permanently.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn fetch_from(
        &self,
        source: (&str, Option<&str>),
        version: (&str, Option<&Hash>),
        key: &Key,
        dest: &Path,
        dl: &mut Option<Download>,
        board: Option<&Arc<Board>>,
        progress: &Progress,
        stall: Duration,
    ) -> Result<(), ClientError> {
        self.fetch_from_selected(source, version, key, dest, dl, board, progress, stall, None)
            .await
    }

    /// [`Client::fetch_from`] of only the files `only` names, when given.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_from_selected(
        &self,
        (source, source_key): (&str, Option<&str>),
        (version, digest): (&str, Option<&Hash>),
        key: &Key,
        dest: &Path,
        dl: &mut Option<Download>,
        board: Option<&Arc<Board>>,
        progress: &Progress,
        stall: Duration,
        only: Option<&crate::download::Only>,
    ) -> Result<(), ClientError> {
        let src = self.server_keyed(source, source_key)?;
        let tree = src.get(&paths::tree(key));
        let url = tree.url().to_owned();
        let body = crate::stall::bytes(tree, stall).await?;
        let read = ReadManifest::from_document(&body).map_err(|e| ClientError::Api {
            status: 502,
            code: kt_types::ErrorCode::InvalidManifest,
            message: format!("{url}: invalid manifest document: {e}"),
        })?;
        let lease = read.lease.clone();
        // Bounded: a frozen source must not hold the transfer up.
        let release = || {
            src.delete(&paths::read(&lease))
                .timeout(self.cfg.stall)
                .ok()
        };
        let same = match dl {
            Some(d) => d.read.version == read.version && d.manifest() == &read.manifest,
            None => read.version == version,
        };
        if !same {
            let _ = release().await;
            return Err(ClientError::Api {
                status: 409,
                code: kt_types::ErrorCode::Conflict,
                message: format!(
                    "{} serves version {} of {key}, the key is at {version}",
                    src.base(),
                    read.version
                ),
            });
        }
        // The version asked for: its manifest must be the published one
        // (a source that moved on to another version answered above).
        if let Some(want) = digest {
            let got = kt_sync::manifest_digest(&read.manifest);
            if got != *want {
                let _ = release().await;
                let code = kt_types::ErrorCode::HashMismatch;
                return Err(ClientError::Api {
                    status: code.http_status(),
                    code,
                    message: format!(
                        "{} serves a manifest of {key} that is not the published one (digest {got}, published {want}): nothing of it was used",
                        src.base()
                    ),
                });
            }
        }
        if dl.is_none() {
            let planned = Download::plan(self, read, dest, board.cloned(), only).await;
            let planned = match planned {
                Ok(p) => p,
                Err(e) => {
                    let _ = release().await;
                    return Err(e);
                }
            };
            progress.start(planned.stats.bytes_sent, planned.stats.files_sent);
            if let Some(b) = board {
                b.publish(key, &planned.read);
            }
            *dl = Some(planned);
        }
        let result = match dl {
            Some(d) => {
                let from = Serving {
                    api: &src,
                    lease: &lease,
                    stall,
                };
                d.run(self, &from, progress).await
            }
            None => Ok(()),
        };
        let _ = release().await;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A put's view of a tree with a large file deferred: the request is
    /// provisional until the chunk values read give the root, and then the
    /// tree's digest is the one of a scan that hashed everything.
    #[test]
    fn a_deferred_tree_resolves_to_the_hashed_digest() {
        let d = tempfile::tempdir().unwrap();
        let chunk = 64u64 << 10;
        let big: Vec<u8> = (0..5 * chunk + 9).map(|i| (i % 251) as u8).collect();
        std::fs::write(d.path().join("big"), &big).unwrap();
        std::fs::write(d.path().join("small"), b"small").unwrap();
        let hashed = kt_sync::scan(d.path(), &mut kt_sync::ScanCache::default()).unwrap();
        let (m, kept, deferred) = kt_sync::scan::scan_deferring(
            d.path(),
            &mut kt_sync::ScanCache::default(),
            1 << 20,
            Some(chunk),
        )
        .unwrap();
        assert_eq!(deferred, [0]);
        assert_eq!(m.entries[0].hash, None);
        let key = Key::parse("t/deferred").unwrap();
        let mut tree = PutTree::new(&key, PutOptions::default(), m, kept, deferred);
        assert_eq!(tree.req.deferred, [0]);
        assert_ne!(tree.req.digest, kt_sync::manifest_digest(&hashed));
        assert!(tree.deferred_up_to(chunk).is_empty());
        tree.chunk_size(chunk);
        assert!(tree.roots().is_none() && tree.resolved_request().is_none());
        for n in 0..chunk_count(big.len() as u64, chunk) {
            let (off, len) = chunk_range(big.len() as u64, chunk, n).unwrap();
            let cv = chunk_cv(&big[off as usize..(off + len) as usize], n, chunk);
            tree.cvs.lock().unwrap().entry(0).or_default().insert(n, cv);
        }
        let real = hashed.entries[0].hash.unwrap();
        assert_eq!(
            tree.roots().unwrap(),
            [DeferredRoot {
                index: 0,
                hash: real
            }]
        );
        let resolved = tree.resolved_request().unwrap();
        assert_eq!(resolved.digest, kt_sync::manifest_digest(&hashed));
        assert!(resolved.deferred.is_empty());
        assert_eq!(tree.learned(), [(0, real)]);
        // Another chunk size: the values read are of no use.
        tree.chunk_size(chunk * 2);
        assert!(tree.roots().is_none());
    }

    /// A deferred file's chunk reads refuse a file that is not the one
    /// scanned: written in place (another mtime), or replaced by another
    /// file of the same size and mtime (another inode), naming it.
    #[test]
    fn a_deferred_file_written_or_replaced_while_it_is_sent_is_refused() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        std::fs::write(&path, vec![1u8; 4096]).unwrap();
        let md = std::fs::metadata(&path).unwrap();
        let scanned = md.modified().unwrap();
        let unchanged = || Unchanged {
            index: 0,
            path: "ckpt".into(),
            size: 4096,
            mtime: (md.mtime(), md.mtime_nsec()),
            seen: Seen::default(),
        };
        let open = || std::fs::File::open(&path).unwrap();
        let u = unchanged();
        u.check(&open()).unwrap();
        u.check(&open()).unwrap();

        // Rewritten in place while it is sent: its mtime moves.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::io::Write::write_all(&mut &f, &[2u8; 4096]).unwrap();
        f.set_modified(scanned + Duration::from_secs(1)).unwrap();
        let e = u.check(&open()).unwrap_err();
        assert!(
            e.contains("\"ckpt\" changed while it was sent") && e.contains("mtime"),
            "{e}"
        );

        // Replaced by another file of the same size, given the scanned
        // mtime: the first read's inode tells.
        f.set_modified(scanned).unwrap();
        let u = unchanged();
        u.check(&open()).unwrap();
        let other = dir.path().join("ckpt.tmp");
        std::fs::write(&other, vec![3u8; 4096]).unwrap();
        let g = std::fs::OpenOptions::new()
            .write(true)
            .open(&other)
            .unwrap();
        g.set_modified(scanned).unwrap();
        std::fs::rename(&other, &path).unwrap();
        let e = u.check(&open()).unwrap_err();
        assert!(e.contains("replaced or had its metadata changed"), "{e}");

        // Cut short or grown: its size tells.
        g.set_len(100).unwrap();
        let e = unchanged().check(&open()).unwrap_err();
        assert!(e.contains("100 bytes, not the 4096 scanned"), "{e}");
    }
}
