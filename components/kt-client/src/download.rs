//! One version of a key downloaded into a destination, resumable across
//! sources: a file or chunk once written stays written, so a getter that
//! moves to another source (failover, a broadcast parent replaced) fetches
//! only what it is still missing.
//!
//! A [`Download`] is planned once from the first source's manifest
//! ([`Download::plan`]: what is already at the destination is kept), then
//! [`Download::run`] against one source after another until one succeeds,
//! then [`Download::finish`]ed. Everything it places is told to its
//! [`Board`] (a broadcast relay serves it on at once).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use kt_api::Api;
use kt_sync::SyncError;
use kt_sync::apply::{self, ChunkedFile, WriteMode};
use kt_sync::batch::{Expected, Written, receive_stream_notify};
use kt_sync::chunk::{ChunkAssembly, ChunkHasher, Piece, chunk_count, chunk_range};
use kt_sync::diff;
use kt_types::api::{BatchRequest, ReadManifest, TransferStats};
use kt_types::manifest::ManifestLimits;
use kt_types::{Entry, EntryKind, Manifest, RootKind, paths};

use crate::api::Client;
use crate::error::ClientError;
use crate::local::{balance, blocking, scan_cached};
use crate::progress::Progress;
use crate::relay::{Board, PIECE};

/// The files a restricted get fetches: entry paths of the manifest (`""`
/// names a single-file key's file), each with its size as the caller listed
/// it. A file whose version holds another size is refused before any byte
/// moves (the caller reserved room for the listed size).
pub type Only = BTreeMap<String, u64>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A large file being assembled chunk by chunk.
#[derive(Debug)]
struct Large {
    entry: Entry,
    dest: PathBuf,
    /// Created on first use; taken when the file is placed.
    file: Mutex<Option<Arc<ChunkedFile>>>,
    asm: Mutex<ChunkAssembly>,
    have: Mutex<Vec<bool>>,
    /// Set once the file is verified and in place.
    done: std::sync::atomic::AtomicBool,
}

impl Large {
    fn missing(&self) -> Vec<u64> {
        lock(&self.have)
            .iter()
            .enumerate()
            .filter(|(_, h)| !**h)
            .map(|(n, _)| n as u64)
            .collect()
    }

    fn placed(&self) -> bool {
        self.done.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The part of a download a chunk's pieces land in, in order.
struct ChunkLanding {
    /// Taken by the last piece. Every piece lets go of the file after it
    /// recorded itself; placing the file waits for that.
    file: Option<Arc<ChunkedFile>>,
    hasher: Option<ChunkHasher>,
    large: Arc<Large>,
    board: Option<Arc<Board>>,
    index: u32,
    n: u64,
    offset: u64,
    len: u64,
    written: u64,
    /// Pieces landed so far (each one write and one hash call).
    landings: u64,
}

impl ChunkLanding {
    /// Writes and hashes `data`, the chunk's next piece as it came off
    /// the wire (one buffer after the other, never copied into one), and
    /// tells the relay, handing it the buffers to serve from memory. The
    /// last one also tells the download: the two learn of the chunk
    /// together, even when the fetch is cancelled while it is written.
    async fn land(mut self, data: Vec<Bytes>) -> Result<Self, ClientError> {
        let at = self.written + data.iter().map(|d| d.len() as u64).sum::<u64>();
        if at > self.len {
            return Err(ClientError::Sync(SyncError::Stream(format!(
                "chunk {} of entry #{} came longer than its {} bytes",
                self.n, self.index, self.len
            ))));
        }
        let last = at == self.len;
        let file = if last {
            self.file.take()
        } else {
            self.file.clone()
        };
        let mut hasher = self.hasher.take();
        let (large, board, index, n) = (self.large.clone(), self.board.clone(), self.index, self.n);
        let offset = self.offset + self.written;
        let hasher = blocking(move || {
            let (Some(file), Some(h)) = (file, hasher.as_mut()) else {
                return Err(SyncError::Stream("a chunk landed after its end".into()));
            };
            let t = std::time::Instant::now();
            file.write_all_vectored_at(offset, &data)?;
            let writing = t.elapsed();
            for d in &data {
                h.update(d);
            }
            let hashing = t.elapsed() - writing;
            if last {
                lock(&large.asm).add_cv(n, h.finish());
                lock(&large.have)[n as usize] = true;
            }
            if let Some(b) = &board {
                b.timings.piece(hashing, writing);
                let written = if last { u64::MAX } else { at };
                b.landed(index, n, written, (offset, data));
            }
            // Let go of the file only now: placing it waits until no piece
            // holds it, so a piece of a cancelled run can never record
            // itself into a file started over after a failed check.
            drop(file);
            Ok(hasher)
        })
        .await?;
        self.hasher = hasher;
        self.written = at;
        self.landings += 1;
        Ok(self)
    }
}

/// Receives a chunk's body into `landing`: what comes is gathered into
/// pieces ([`kt_sync::chunk::Piece`]) of [`PIECE`] bytes, each landed (written, hashed,
/// told to the relay) in one go, so however small the frames a source
/// sends (a byte each), a chunk costs one write and one hash call per
/// piece.
async fn receive_chunk<S>(
    mut body: S,
    mut landing: ChunkLanding,
) -> Result<ChunkLanding, ClientError>
where
    S: futures::Stream<Item = Result<Bytes, String>> + Unpin,
{
    let mut piece = Piece::new(PIECE);
    let board = landing.board.clone();
    loop {
        let Some(b) = body.next().await else {
            if !piece.is_empty() {
                landing = landing.land(piece.take()).await?;
            }
            return Ok(landing);
        };
        let b = b.map_err(|e| ClientError::Sync(SyncError::Stream(e)))?;
        piece.add(b);
        if let Some(t) = &board {
            t.timings.frame();
        }
        if piece.is_full() {
            landing = landing.land(piece.take()).await?;
        }
    }
}

/// A source a download run fetches from: the server, the read lease it
/// granted, and how long a request to it may receive nothing (longer for a
/// broadcast relay, which may wait on its own parent).
pub(crate) struct Serving<'a> {
    pub api: &'a Api,
    pub lease: &'a str,
    pub stall: Duration,
}

/// A download in progress (see the module documentation).
#[derive(Debug)]
pub(crate) struct Download {
    pub read: ReadManifest,
    root: PathBuf,
    pub final_dest: PathBuf,
    /// Files fetched by this download (not already at the destination).
    needed: BTreeSet<u32>,
    /// Small files still to fetch.
    pending: Arc<Mutex<BTreeSet<u32>>>,
    large: BTreeMap<u32, Arc<Large>>,
    pub stats: TransferStats,
    board: Option<Arc<Board>>,
    /// Set when only some files of the key are fetched (a shard of a
    /// dataset): the rest of the tree is neither written nor finished.
    restricted: bool,
}

impl Download {
    /// Validates `read`, looks at what `dest` already holds, creates the
    /// directories, and tells `board` what is already in place.
    ///
    /// With `only` (see [`Only`]), just those files are fetched and only
    /// their directories made: a selected file already at its place with the
    /// same content is kept; a name that is not a file of this version, or
    /// is one of another size than listed, is an error.
    pub async fn plan(
        client: &Client,
        read: ReadManifest,
        dest: &Path,
        board: Option<Arc<Board>>,
        only: Option<&Only>,
    ) -> Result<Self, ClientError> {
        let m = &read.manifest;
        m.validate(&ManifestLimits::default())?;
        kt_sync::chunk::check_chunk_size(read.chunk_size)?;
        if let Some(only) = only {
            return Self::plan_only(client, read, dest, board, only).await;
        }
        let (root, final_dest) = places(m, dest);
        // What is already there.
        // Trouble with the destination is ours, never the source's.
        let here = |e: ClientError| ClientError::Local(format!("{}: {e}", dest.display()));
        let local = match m.root {
            RootKind::Dir if dest.is_dir() => {
                Some(scan_cached(client, dest, 0).await.map_err(here)?.0)
            }
            RootKind::File if final_dest.is_file() => {
                Some(scan_cached(client, &final_dest, 0).await.map_err(here)?.0)
            }
            _ => None,
        };
        let needed: BTreeSet<u32> = match &local {
            Some(l) => {
                let mut have = l.clone();
                if m.root == RootKind::File {
                    // Compare by content under the key's file name.
                    for e in &mut have.entries {
                        e.path = m.entries[0].path.clone();
                    }
                }
                diff::changed_files(m, &have).into_iter().collect()
            }
            None => m
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.kind == EntryKind::File)
                .map(|(i, _)| i as u32)
                .collect(),
        };
        {
            let (root, m2) = (root.clone(), m.clone());
            blocking(move || match m2.root {
                RootKind::Dir => apply::ensure_dirs(&root, &m2),
                RootKind::File => {
                    std::fs::create_dir_all(&root).map_err(|e| SyncError::io(&root, e))
                }
            })
            .await
            .map_err(here)?;
        }
        let mut this = Download::empty(root, final_dest, board, read, false);
        this.register(&needed);
        Ok(this)
    }

    /// A download of nothing yet into `root` (`final_dest` once done).
    fn empty(
        root: PathBuf,
        final_dest: PathBuf,
        board: Option<Arc<Board>>,
        read: ReadManifest,
        restricted: bool,
    ) -> Self {
        Download {
            root,
            final_dest,
            needed: BTreeSet::new(),
            pending: Arc::default(),
            large: BTreeMap::new(),
            stats: TransferStats::default(),
            board,
            read,
            restricted,
        }
    }

    /// [`Download::plan`] of the files `only` names.
    async fn plan_only(
        client: &Client,
        read: ReadManifest,
        dest: &Path,
        board: Option<Arc<Board>>,
        only: &Only,
    ) -> Result<Self, ClientError> {
        let (root, final_dest) = places(&read.manifest, dest);
        let mut this = Download::empty(root, final_dest, board, read, true);
        let m = &this.read.manifest;
        let mut chosen = Vec::new();
        for (name, &listed) in only {
            // A single-file key's one file is also named by "".
            let found = m.entries.iter().position(|e| {
                e.kind == EntryKind::File
                    && (&e.path == name || (name.is_empty() && m.root == RootKind::File))
            });
            let Some(i) = found else {
                return Err(not_in_version(&this.read.version, name));
            };
            let e = &m.entries[i];
            if e.size != listed {
                return Err(size_changed(&this.read.version, &e.path, e.size, listed));
            }
            chosen.push((i as u32, this.target_of(&m.entries[i])));
        }
        let here = |p: &Path, e: ClientError| ClientError::Local(format!("{}: {e}", p.display()));
        let mut needed = BTreeSet::new();
        for (i, target) in &chosen {
            let e = &m.entries[*i as usize];
            // Directories first, each checked to be a real one: a symlink on
            // the way must never lead the file out of the destination.
            let (root, entry, kind) = (this.root.clone(), e.path.clone(), m.root);
            blocking(move || match kind {
                RootKind::Dir => ensure_parents(&root, &entry),
                RootKind::File => {
                    std::fs::create_dir_all(&root).map_err(|e| SyncError::io(&root, e))
                }
            })
            .await
            .map_err(|err| here(target, err))?;
            let same = match std::fs::symlink_metadata(target) {
                Ok(md) if md.is_file() && md.len() == e.size => {
                    let (scanned, _) = scan_cached(client, target, 0)
                        .await
                        .map_err(|err| here(target, err))?;
                    scanned.entries.first().is_some_and(|s| s.hash == e.hash)
                }
                _ => false,
            };
            if !same {
                needed.insert(*i);
            }
        }
        let selected: u64 = chosen
            .iter()
            .map(|(i, _)| m.entries[*i as usize].size)
            .sum();
        // Only the selection counts: the rest of the tree is not ours.
        this.register(&needed);
        this.stats.bytes_skipped = selected - this.stats.bytes_sent;
        Ok(this)
    }

    /// Sorts the `needed` files into small (batched) and large (chunked)
    /// ones and counts them; tells the board what is already in place.
    fn register(&mut self, needed: &BTreeSet<u32>) {
        let this = self;
        let mut pending = BTreeSet::new();
        for (i, e) in this.read.manifest.entries.iter().enumerate() {
            let i = i as u32;
            if e.kind != EntryKind::File {
                continue;
            }
            let target = this.target_of(e);
            if !needed.contains(&i) {
                if let Some(b) = this.board.as_ref().filter(|_| !this.restricted) {
                    b.file_at(i, target);
                }
                continue;
            }
            this.stats.files_sent += 1;
            this.stats.bytes_sent += e.size;
            if e.size > this.read.chunk_size {
                let chunks = chunk_count(e.size, this.read.chunk_size) as usize;
                this.large.insert(
                    i,
                    Arc::new(Large {
                        entry: e.clone(),
                        dest: target,
                        file: Mutex::new(None),
                        asm: Mutex::new(ChunkAssembly::new(e.size, this.read.chunk_size)),
                        have: Mutex::new(vec![false; chunks]),
                        done: Default::default(),
                    }),
                );
            } else {
                pending.insert(i);
            }
        }
        if !this.restricted {
            this.stats.bytes_skipped = this.read.manifest.total_bytes() - this.stats.bytes_sent;
        }
        this.needed = needed.clone();
        *lock(&this.pending) = pending;
    }

    /// Where the file `name` of the manifest lies (`""` names a
    /// single-file key's file), as [`Download::plan`] with `only` names it.
    pub fn path_of(&self, name: &str) -> Option<PathBuf> {
        let m = &self.read.manifest;
        m.entries
            .iter()
            .find(|e| {
                e.kind == EntryKind::File
                    && (e.path == name || (name.is_empty() && m.root == RootKind::File))
            })
            .map(|e| self.target_of(e))
    }

    fn target_of(&self, e: &Entry) -> PathBuf {
        match self.read.manifest.root {
            RootKind::Dir => self.root.join(&e.path),
            RootKind::File => self.final_dest.clone(),
        }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.read.manifest
    }

    /// The files this download placed so far (not those that were already
    /// at the destination).
    pub fn placed_files(&self) -> Vec<PathBuf> {
        let m = &self.read.manifest;
        let pending = lock(&self.pending);
        self.needed
            .iter()
            .filter(|i| !pending.contains(i) && self.large.get(i).is_none_or(|l| l.placed()))
            .map(|&i| self.target_of(&m.entries[i as usize]))
            .collect()
    }

    /// Removes the files in `stale` (placed by a download of another version
    /// this get abandoned) that this version does not name, so the get ends
    /// with one version, not a mix. Best effort: a file that cannot be
    /// removed is logged.
    pub async fn remove_stale(&self, stale: Vec<PathBuf>) {
        let mine: std::collections::HashSet<PathBuf> = self
            .read
            .manifest
            .entries
            .iter()
            .map(|e| self.target_of(e))
            .collect();
        let gone: Vec<PathBuf> = stale.into_iter().filter(|p| !mine.contains(p)).collect();
        if gone.is_empty() {
            return;
        }
        let _ = blocking(move || {
            for p in gone {
                if let Err(e) = std::fs::remove_file(&p)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(path = %p.display(), error = %e, "removing a file of an abandoned version");
                }
            }
            Ok::<(), SyncError>(())
        })
        .await;
    }

    /// Fetches what is still missing from `from`. On error, what was
    /// written stays: the next run starts from there.
    pub async fn run(
        &self,
        client: &Client,
        from: &Serving<'_>,
        progress: &Progress,
    ) -> Result<(), ClientError> {
        let (src, lease, stall) = (from.api, from.lease, from.stall);
        let m = &self.read.manifest;
        let small: Vec<(u64, u32)> = lock(&self.pending)
            .iter()
            .map(|&i| (m.entries[i as usize].size, i))
            .collect();
        let expected: Arc<HashMap<u32, Expected>> = Arc::new(
            small
                .iter()
                .map(|&(_, i)| {
                    let e = &m.entries[i as usize];
                    let x = Expected {
                        dest: self.target_of(e),
                        entry: e.clone(),
                    };
                    (i, x)
                })
                .collect(),
        );
        let board = self.board.clone();
        let written: Written = {
            let (pending, board, expected) =
                (self.pending.clone(), self.board.clone(), expected.clone());
            let progress = progress.clone();
            Arc::new(move |i, n| {
                lock(&pending).remove(&i);
                if let (Some(b), Some(x)) = (&board, expected.get(&i)) {
                    b.file_at(i, x.dest.clone());
                }
                progress.advance(n);
            })
        };
        let mut futs: Vec<futures::future::BoxFuture<'_, Result<(), ClientError>>> = Vec::new();
        for group in balance(small, client.cfg.streams) {
            let (expected, written) = (expected.clone(), written.clone());
            let board = board.clone();
            futs.push(Box::pin(async move {
                let call = src
                    .post(&paths::read_batch(lease))
                    .json(&BatchRequest { indices: group });
                let body = crate::stall::body(crate::stall::send(call, stall).await?, stall)
                    .inspect(move |frame| {
                        if let (Some(b), Ok(_)) = (&board, frame) {
                            b.timings.frame();
                        }
                    });
                receive_stream_notify(body, expected, WriteMode::TempRename, Some(written)).await?;
                Ok(())
            }));
        }
        for (&i, large) in &self.large {
            if large.placed() {
                continue;
            }
            futs.push(Box::pin(self.fetch_chunked(
                client,
                from,
                i,
                large.clone(),
                progress.clone(),
            )));
        }
        futures::stream::iter(futs)
            .buffer_unordered(client.cfg.streams.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Fetches the missing chunks of one large file over parallel range
    /// requests, and places it once all are there and its hash checks out.
    async fn fetch_chunked(
        &self,
        client: &Client,
        from: &Serving<'_>,
        index: u32,
        large: Arc<Large>,
        progress: Progress,
    ) -> Result<(), ClientError> {
        let (src, lease, stall) = (from.api, from.lease, from.stall);
        let chunk_size = self.read.chunk_size;
        let file = {
            let existing = lock(&large.file).clone();
            match existing {
                Some(f) => f,
                None => {
                    let (dest, size) = (large.dest.clone(), large.entry.size);
                    let created = Arc::new(
                        blocking(move || ChunkedFile::create(&dest, size, WriteMode::TempRename))
                            .await?,
                    );
                    if let Some(b) = &self.board {
                        b.partial(index, created.reader()?, chunk_size, &lock(&large.have));
                    }
                    lock(&large.file).get_or_insert(created).clone()
                }
            }
        };
        let fetches = large.missing().into_iter().map(|n| {
            let (file, large, progress) = (file.clone(), large.clone(), progress.clone());
            let board = self.board.clone();
            async move {
                let (offset, len) =
                    chunk_range(large.entry.size, chunk_size, n).unwrap_or_default();
                let call = src
                    .get(&paths::read_range(lease, index as usize))
                    .query(&[("offset", offset), ("len", len)]);
                let body = crate::stall::body(crate::stall::send(call, stall).await?, stall);
                let landing = ChunkLanding {
                    file: Some(file),
                    hasher: Some(ChunkHasher::new(n, chunk_size)),
                    large,
                    board,
                    index,
                    n,
                    offset,
                    len,
                    written: 0,
                    landings: 0,
                };
                // Pieces are written (and told to the relay) as they come,
                // so a child relaying from us lags by a piece, not a chunk.
                let landed = receive_chunk(body, landing).await?;
                tracing::trace!(index, chunk = n, pieces = landed.landings, "chunk received");
                if landed.written != len {
                    return Err(ClientError::Sync(SyncError::Truncated));
                }
                progress.advance(len);
                Ok::<(), ClientError>(())
            }
        });
        futures::stream::iter(fetches)
            .buffer_unordered(client.cfg.streams.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        drop(file);
        self.place(index, &large).await
    }

    /// Verifies an assembled large file and renames it into place.
    async fn place(&self, index: u32, large: &Large) -> Result<(), ClientError> {
        let Some(mut file) = lock(&large.file).take() else {
            return Ok(());
        };
        // A write of a cancelled run may still hold the file: it lets go
        // as soon as its write is done.
        let waited = std::time::Instant::now();
        let file = loop {
            match Arc::try_unwrap(file) {
                Ok(f) => break f,
                Err(shared) if waited.elapsed() < Duration::from_secs(30) => {
                    file = shared;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(shared) => {
                    *lock(&large.file) = Some(shared);
                    return Err(ClientError::Local(format!(
                        "{}: a chunk write never finished",
                        large.entry.path
                    )));
                }
            }
        };
        let root = lock(&large.asm).root();
        if root != large.entry.hash {
            // Start this file over: the chunks we have do not add up.
            file.discard();
            if let Some(b) = &self.board {
                b.forget(index);
            }
            let chunks = lock(&large.have).len();
            *lock(&large.have) = vec![false; chunks];
            *lock(&large.asm) = ChunkAssembly::new(large.entry.size, self.read.chunk_size);
            return Err(SyncError::HashMismatch {
                path: large.entry.path.clone(),
            }
            .into());
        }
        let e = large.entry.clone();
        blocking(move || file.finish(&e)).await?;
        large.done.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// How much is still to fetch (small files, chunks, large files to
    /// place): a run that lowered it made progress.
    pub fn outstanding(&self) -> usize {
        let large: usize = self
            .large
            .values()
            .filter(|l| !l.placed())
            .map(|l| l.missing().len() + 1)
            .sum();
        lock(&self.pending).len() + large
    }

    /// What is outstanding before a fetch attempt, to tell afterwards
    /// whether it made progress (see [`Outstanding::advanced`]).
    pub fn mark(dl: &Option<Download>) -> Outstanding {
        Outstanding(dl.as_ref().map(Download::outstanding))
    }

    /// True once every needed file is in place.
    pub fn complete(&self) -> bool {
        lock(&self.pending).is_empty() && self.large.values().all(|l| l.placed())
    }

    /// Brings unchanged files' metadata in line, then links and directories.
    /// Sets the tree's metadata once every file is in place; with `prune`
    /// (a mirror get) also removes what the key does not name under the
    /// destination directory. Temporary files of killed gets in the
    /// directories it placed files in go too: unlocked and idle for
    /// `abandoned_after` (ten minutes at least).
    pub async fn finish(&self, prune: bool, abandoned_after: Duration) -> Result<(), ClientError> {
        if !self.complete() {
            return Err(ClientError::Local(
                "download finished with files still missing".into(),
            ));
        }
        if self.restricted {
            // Each selected file was placed with its metadata; the tree's
            // other files, links and directories are not this get's.
            return Ok(());
        }
        let (root, m, fin) = (
            self.root.clone(),
            self.read.manifest.clone(),
            self.final_dest.clone(),
        );
        let needed = self.needed.clone();
        blocking(move || {
            for (i, e) in m.entries.iter().enumerate() {
                if e.kind == EntryKind::File && !needed.contains(&(i as u32)) {
                    let p = match m.root {
                        RootKind::Dir => root.join(&e.path),
                        RootKind::File => fin.clone(),
                    };
                    apply::fix_metadata(&p, e)?;
                }
            }
            let placed_at = match m.root {
                RootKind::Dir => {
                    apply::finish_tree(&root, &m)?;
                    if prune {
                        let removed = apply::prune(&root, &m)?;
                        tracing::debug!(removed, dest = %root.display(), "mirror get: pruned");
                    }
                    root
                }
                RootKind::File => fin,
            };
            // Never younger than ten minutes: another get's small file may
            // wait on a stalled source for a while (large ones are locked).
            let idle = abandoned_after.max(Duration::from_secs(600));
            let removed = apply::remove_abandoned_temps(&placed_at, &m, idle);
            if removed > 0 {
                tracing::info!(removed, dest = %placed_at.display(), "removed temporary files of an earlier get that was killed");
            }
            Ok(())
        })
        .await
    }
}

/// A file a restricted get names that its version lacks: the caller's
/// listing is out of date, not the source (never a source failure, so no
/// healthy peer is reported for it).
fn not_in_version(version: &str, name: &str) -> ClientError {
    ClientError::Local(format!(
        "version {version} has no file {name:?} (the key changed since it was listed?)"
    ))
}

/// A file a restricted get names whose size in its version differs from the
/// caller's listing: refused before any byte moves (the caller reserved
/// room for the listed size), and not the source's fault either.
fn size_changed(version: &str, name: &str, size: u64, listed: u64) -> ClientError {
    ClientError::Local(format!(
        "{name:?} is {size} bytes in version {version} but was {listed} bytes when listed: \
         the key changed since it was listed (list it again)"
    ))
}

/// Creates `root` and the directories on the way to the entry `path` below
/// it one component at a time, as [`apply::ensure_dirs`] does: whatever is
/// there and is not a real directory (a symlink above all) is replaced, so
/// the entry is placed inside `root`, never through a link out of it.
fn ensure_parents(root: &Path, path: &str) -> Result<(), SyncError> {
    std::fs::create_dir_all(root).map_err(|e| SyncError::io(root, e))?;
    let Some(parent) = Path::new(path).parent() else {
        return Ok(());
    };
    let mut p = root.to_owned();
    for c in parent.components() {
        match c {
            std::path::Component::Normal(name) => p.push(name),
            // Manifests are validated: entry paths are plain and relative.
            _ => {
                return Err(SyncError::io(
                    &p,
                    std::io::Error::other(format!("entry path {path:?} is not plain")),
                ));
            }
        }
        match std::fs::symlink_metadata(&p) {
            Ok(md) if md.is_dir() => continue,
            Ok(_) => std::fs::remove_file(&p).map_err(|e| SyncError::io(&p, e))?,
            Err(_) => {}
        }
        match std::fs::create_dir(&p) {
            Ok(()) => {}
            // Another get of the same tree (a stream fetches several files
            // of a key at once) made it just now.
            Err(e)
                if e.kind() == std::io::ErrorKind::AlreadyExists
                    && std::fs::symlink_metadata(&p).is_ok_and(|md| md.is_dir()) => {}
            Err(e) => return Err(SyncError::io(&p, e)),
        }
    }
    Ok(())
}

/// Where a manifest's entry paths are rooted under `dest`, and where the
/// get ends up (the tree's root, or the single file).
fn places(m: &Manifest, dest: &Path) -> (PathBuf, PathBuf) {
    match m.root {
        RootKind::Dir => (dest.to_owned(), dest.to_owned()),
        RootKind::File => {
            let name = &m.entries[0].path;
            if dest.is_dir() {
                (dest.to_owned(), dest.join(name))
            } else {
                let parent = dest
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                (parent.to_owned(), dest.to_owned())
            }
        }
    }
}

/// How much a download had outstanding at a mark: an attempt made
/// progress if it lowered that, or created the download (its manifest
/// arrived) where there was none.
#[derive(Debug, Clone, Copy)]
pub struct Outstanding(Option<usize>);

impl Outstanding {
    pub fn advanced(self, dl: &Option<Download>) -> bool {
        match (self.0, dl.as_ref()) {
            (None, Some(_)) => true,
            (Some(before), Some(d)) => d.outstanding() < before,
            (_, None) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn directories_on_the_way_replace_a_symlink_out_of_the_destination() {
        let t = tempfile::tempdir().unwrap();
        let (root, outside) = (t.path().join("d"), t.path().join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a")).unwrap();
        std::fs::write(root.join("f"), b"x").unwrap();
        ensure_parents(&root, "a/b/authorized_keys").unwrap();
        let md = std::fs::symlink_metadata(root.join("a")).unwrap();
        assert!(md.is_dir(), "the link was kept");
        assert!(root.join("a/b").is_dir());
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        // A file in the way goes too; a real directory stays as it is.
        ensure_parents(&root, "f/g").unwrap();
        assert!(root.join("f").is_dir());
        ensure_parents(&root, "a/b/c").unwrap();
        ensure_parents(&root, "top").unwrap();
        assert!(root.join("a/b").is_dir());
    }

    /// A chunk landed as the buffers came (pieces of several buffers of odd
    /// sizes, not on any boundary) is written and hashed as if it had come
    /// whole; the relay learns of each piece and has the last ones in
    /// memory; a buffer past the chunk's end is refused.
    #[tokio::test]
    async fn a_chunk_lands_buffer_by_buffer() {
        const CHUNK: u64 = 64 << 10;
        let t = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2 * CHUNK).map(|i| (i * 7 % 251) as u8).collect();
        let entry = Entry {
            path: "f".into(),
            kind: EntryKind::File,
            size: 2 * CHUNK,
            mode: 0o644,
            mtime: 0,
            mtime_nsec: 0,
            hash: None,
            target: None,
        };
        let dest = t.path().join("f");
        let file = Arc::new(ChunkedFile::create(&dest, entry.size, WriteMode::TempRename).unwrap());
        let large = Arc::new(Large {
            entry,
            dest,
            file: Mutex::new(Some(file.clone())),
            asm: Mutex::new(ChunkAssembly::new(2 * CHUNK, CHUNK)),
            have: Mutex::new(vec![false; 2]),
            done: Default::default(),
        });
        let board = Arc::new(Board::default());
        board.partial(0, file.reader().unwrap(), CHUNK, &[false, false]);
        let landing = |n: u64| ChunkLanding {
            file: Some(file.clone()),
            hasher: Some(ChunkHasher::new(n, CHUNK)),
            large: large.clone(),
            board: Some(board.clone()),
            index: 0,
            n,
            offset: n * CHUNK,
            len: CHUNK,
            written: 0,
            landings: 0,
        };
        let all = Bytes::from(data.clone());
        let first = all.slice(..CHUNK as usize);
        let second = all.slice(CHUNK as usize..);
        landing(0).land(vec![first]).await.unwrap();
        let mut l = landing(1);
        l = l
            .land(vec![second.slice(0..1), second.slice(1..1000)])
            .await
            .unwrap();
        assert_eq!(l.written, 1000);
        assert!(!lock(&large.have)[1]);
        l = l.land(vec![second.slice(1000..40_000)]).await.unwrap();
        let over = landing(1)
            .land(vec![second.clone(), Bytes::from_static(b"x")])
            .await;
        assert!(over.is_err(), "a chunk longer than its length was taken");
        let l = l
            .land(vec![second.slice(40_000..50_000), second.slice(50_000..)])
            .await
            .unwrap();
        assert_eq!(l.written, CHUNK);
        assert!(lock(&large.have)[1]);
        let mut want = ChunkAssembly::new(2 * CHUNK, CHUNK);
        want.add(0, &data[..CHUNK as usize]);
        want.add(1, &data[CHUNK as usize..]);
        assert_eq!(lock(&large.asm).root(), want.root());
        assert!(want.root().is_some());
        drop(l);
        let reader = file.reader().unwrap();
        let mut back = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(&reader, &mut back, 0).unwrap();
        assert_eq!(back, data);
    }

    /// Review F7: a source that sends a chunk a byte per frame (here the
    /// frames are all there at once, the worst case) is received whole
    /// and right, written and hashed a piece at a time (four landings for
    /// four pieces, not one per byte); a chunk that comes whole lands at
    /// once.
    #[tokio::test]
    async fn a_chunk_sent_a_byte_per_frame_lands_a_piece_at_a_time() {
        const CHUNK: u64 = 4 * PIECE;
        let t = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2 * CHUNK).map(|i| (i * 13 % 251) as u8).collect();
        let entry = Entry {
            path: "f".into(),
            kind: EntryKind::File,
            size: 2 * CHUNK,
            mode: 0o644,
            mtime: 0,
            mtime_nsec: 0,
            hash: None,
            target: None,
        };
        let dest = t.path().join("f");
        let file = Arc::new(ChunkedFile::create(&dest, entry.size, WriteMode::TempRename).unwrap());
        let large = Arc::new(Large {
            entry,
            dest,
            file: Mutex::new(Some(file.clone())),
            asm: Mutex::new(ChunkAssembly::new(2 * CHUNK, CHUNK)),
            have: Mutex::new(vec![false; 2]),
            done: Default::default(),
        });
        let landing = |n: u64| ChunkLanding {
            file: Some(file.clone()),
            hasher: Some(ChunkHasher::new(n, CHUNK)),
            large: large.clone(),
            board: Some(Arc::new(Board::default())),
            index: 0,
            n,
            offset: n * CHUNK,
            len: CHUNK,
            written: 0,
            landings: 0,
        };
        let all = Bytes::from(data.clone());
        let bytes = (0..CHUNK as usize).map(|i| Ok::<_, String>(all.slice(i..i + 1)));
        let first = receive_chunk(futures::stream::iter(bytes), landing(0))
            .await
            .unwrap();
        assert_eq!(first.written, CHUNK);
        assert_eq!(first.landings, CHUNK.div_ceil(PIECE));
        let whole = futures::stream::iter([Ok(all.slice(CHUNK as usize..))]);
        let second = receive_chunk(whole, landing(1)).await.unwrap();
        assert_eq!((second.written, second.landings), (CHUNK, 1));
        assert_eq!(*lock(&large.have), vec![true, true]);
        let mut want = ChunkAssembly::new(2 * CHUNK, CHUNK);
        want.add(0, &data[..CHUNK as usize]);
        want.add(1, &data[CHUNK as usize..]);
        assert!(want.root().is_some());
        assert_eq!(lock(&large.asm).root(), want.root());
        drop((first, second));
        let mut back = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(&file.reader().unwrap(), &mut back, 0).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn a_file_missing_from_the_listing_is_not_the_sources_fault() {
        let e = not_in_version("v1", "x");
        assert!(!e.is_source_failure(), "{e:?}");
        assert!(e.to_string().contains("has no file \"x\""), "{e}");
    }

    #[test]
    fn a_file_of_another_size_than_listed_is_not_the_sources_fault() {
        let e = size_changed("v1", "x", 4096, 1);
        assert!(!e.is_source_failure(), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("4096 bytes in version v1"), "{text}");
        assert!(text.contains("1 bytes when listed"), "{text}");
        assert!(text.contains("changed since it was listed"), "{text}");
    }
}
