//! Rank-aware reads of a dataset below a prefix: which files this rank reads
//! ([`Client::dataset_files`], [`Client::share_of`]), a one-shot get of that
//! share ([`Client::get_share`], `kt get PREFIX/ --shard R/W`), and a
//! streaming reader ([`Client::stream_share`]) that yields each file as soon
//! as it is complete and verified while it prefetches the next ones.
//!
//! The unit of a share is a file: the files of every key below the prefix
//! (a key may be one file or a directory tree), named by their path below
//! the prefix. The split is [`kt_types::shard`]'s pure function, so ranks
//! that list the same dataset agree without talking to each other.
//!
//! Every file is fetched by an ordinary get restricted to that file: sources
//! as for any get (peers first, then the store), failover, deadlines and the
//! blake3 verification are the same. Such a partial copy is never offered to
//! this node's agent (it is not the whole key, and a streamed file is
//! deleted once it is consumed).
//!
//! Budget invariant of a [`ShareStream`]: a file's size is reserved before
//! its fetch starts (the listed size, which the get checks against the
//! verified manifest before any byte moves: a file of another size, say a
//! key put again or registered with a false size, is refused by name) (temporary files included) and given back when the
//! [`StreamedFile`] the consumer got for it is dropped, which deletes it. A
//! fetch starts only while the reserved bytes plus its size fit the budget,
//! so the bytes held locally never exceed it — except for a file larger than
//! the whole budget, which is fetched alone (nothing else held) and so holds
//! its own size.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::stream::FuturesOrdered;
use futures::{Stream, StreamExt};
use kt_types::shard::{ShareSpec, share};
use kt_types::{EntryKind, Key, KeyPrefix};
use tokio::sync::{Notify, mpsc};

use crate::api::Client;
use crate::download::Only;
use crate::error::ClientError;
use crate::progress::Progress;
use crate::transfer::{GetOptions, GetSummary};

/// Keys whose manifests are fetched at once while listing a dataset, and
/// keys a share get fetches at once.
const KEYS_AT_ONCE: usize = 4;

/// Default number of files a [`ShareStream`] fetches at once (within its
/// budget).
pub const DEFAULT_AHEAD: usize = 4;

/// One file of a dataset below a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetFile {
    /// Its path below the prefix: the key's name below it, then (for a
    /// directory key) the file's path in the key's tree.
    pub path: String,
    /// The key that holds it.
    pub key: Key,
    /// Its path in the key's tree; `""` when the key is this one file.
    pub entry: String,
    /// Its size in bytes.
    pub size: u64,
}

/// What [`Client::get_share`] did.
#[derive(Debug, Default)]
pub struct ShareSummary {
    /// This rank's files, in reading order.
    pub files: Vec<DatasetFile>,
    /// One get per key that holds files of the share, with where it went.
    pub gets: Vec<(Key, GetSummary)>,
    /// Keys below the prefix a file read does not cover (GPU data), with why.
    pub skipped: Vec<(Key, String)>,
}

impl ShareSummary {
    /// Bytes of the share.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// What a [`ShareStream`] reads and how.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// This rank, the world, and the epoch's order.
    pub spec: ShareSpec,
    /// Local bytes the stream may hold: files fetched ahead plus the ones
    /// the consumer still holds (see the module documentation).
    pub budget: u64,
    /// Position to start from: an index into the ordered share, as
    /// [`ShareStream::position`] gave it (a checkpoint).
    pub start: usize,
    /// Files fetched at once, at most (at least 1).
    pub ahead: usize,
    /// Where the stream's fresh temporary directory is made (files go under
    /// their path below the prefix in it, but one whose place another file
    /// of the share would take, as with keys `a` and `a/b`, goes under
    /// `<its position>/<its path>`; it is removed with the stream, and
    /// nothing already in `dir` is touched); `None`: the system's.
    pub dir: Option<PathBuf>,
    /// Files passed over without a byte fetched (markers such as
    /// `_SUCCESS`): they keep their place in the share, so every rank's
    /// split is the same, but the stream never yields them.
    pub skip: Option<fn(&str) -> bool>,
    /// The most files the listing below the prefix may hold: more ends
    /// the listing with an error naming the limit ([`TOO_MANY_FILES`]).
    pub max_files: usize,
}

/// Begins the error of a listing over [`StreamOptions::max_files`].
pub const TOO_MANY_FILES: &str = "too many files to stream";

impl StreamOptions {
    /// Rank `spec`'s share from its start, `budget` bytes, defaults else.
    pub fn new(spec: ShareSpec, budget: u64) -> Self {
        Self {
            spec,
            budget,
            start: 0,
            ahead: DEFAULT_AHEAD,
            dir: None,
            skip: None,
            max_files: usize::MAX,
        }
    }
}

/// The bytes a stream holds locally, against its budget.
#[derive(Debug)]
struct Budget {
    limit: u64,
    held: Mutex<u64>,
    peak: AtomicU64,
    freed: Notify,
}

impl Budget {
    /// Reserves `size` if it fits, or if nothing is held (a file larger
    /// than the budget is fetched alone).
    fn try_reserve(&self, size: u64) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if *held != 0 && held.saturating_add(size) > self.limit {
            return false;
        }
        *held = held.saturating_add(size);
        self.peak.fetch_max(*held, Ordering::SeqCst);
        true
    }

    fn release(&self, size: u64) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(size);
        drop(held);
        self.freed.notify_one();
    }

    fn held(&self) -> u64 {
        *self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The bytes a [`ShareStream`] holds, read from anywhere (another thread
/// while the stream waits).
#[derive(Debug, Clone)]
pub struct Gauge(Arc<Budget>);

impl Gauge {
    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.0.held()
    }

    /// The most bytes held at any moment so far.
    pub fn peak(&self) -> u64 {
        self.0.peak.load(Ordering::SeqCst)
    }

    /// The budget.
    pub fn budget(&self) -> u64 {
        self.0.limit
    }
}

/// A file of the share, complete and verified on local disk. Dropping it
/// deletes the file and gives its bytes back to the stream's budget.
#[derive(Debug)]
pub struct StreamedFile {
    /// Its index in the ordered share (the stream's position before it).
    pub position: usize,
    /// Which file it is.
    pub file: DatasetFile,
    /// Where it lies.
    pub path: PathBuf,
    /// The directory of its position in the stream's directory, for a file
    /// placed apart: it holds this file only, and goes with it.
    place: Option<PathBuf>,
    budget: Arc<Budget>,
}

impl StreamedFile {
    /// Its local path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its bytes, read from disk (on a blocking thread).
    pub async fn bytes(&self) -> Result<Vec<u8>, ClientError> {
        let path = self.path.clone();
        crate::local::blocking(move || {
            std::fs::read(&path).map_err(|e| kt_sync::SyncError::io(&path, e))
        })
        .await
    }
}

impl Drop for StreamedFile {
    fn drop(&mut self) {
        // A file placed apart goes with the directories its get made (no
        // other fetch places into them). Else its directories stay:
        // another file's fetch may be placing into them right now (they
        // hold no bytes).
        let gone = match &self.place {
            Some(place) => std::fs::remove_dir_all(place),
            None => std::fs::remove_file(&self.path),
        };
        if let Err(e) = gone
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "evicting a consumed file");
        }
        self.budget.release(self.file.size);
    }
}

/// This rank's share streamed file by file (see the module documentation).
/// Dropping it stops the fetches; a temporary directory it made is removed
/// once they have stopped (on the runtime it was made on, just after).
#[derive(Debug)]
pub struct ShareStream {
    share: Arc<Vec<DatasetFile>>,
    position: usize,
    skip: Option<fn(&str) -> bool>,
    rx: mpsc::UnboundedReceiver<Result<StreamedFile, ClientError>>,
    budget: Arc<Budget>,
    dir: PathBuf,
    /// Set when the stream made `dir` (removed on drop).
    owned: Option<tempfile::TempDir>,
    task: Option<tokio::task::JoinHandle<()>>,
    rt: tokio::runtime::Handle,
}

impl Drop for ShareStream {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else { return };
        task.abort();
        // Files fetched but not handed on are deleted now, before the
        // directory's removal below runs: never two removals of one tree
        // at once (one would find gone what it listed, and give up).
        self.rx.close();
        while let Ok(f) = self.rx.try_recv() {
            drop(f);
        }
        if let Some(owned) = self.owned.take() {
            // Removed only once the fetches stopped: a write they had under
            // way would otherwise make the directory again.
            self.rt.spawn(async move {
                let _ = task.await;
                let _ = kt_sync::task::spawn(move || drop(owned)).await;
            });
        }
    }
}

impl ShareStream {
    /// The next file, once complete and verified; `None` at the end of the
    /// share. After an error the stream ends (resume from
    /// [`ShareStream::position`] with a new one).
    pub async fn next(&mut self) -> Option<Result<StreamedFile, ClientError>> {
        while self.position < self.share.len() && skips(self.skip, &self.share[self.position]) {
            self.position += 1;
        }
        if self.position >= self.share.len() {
            return None;
        }
        let Some(got) = self.rx.recv().await else {
            // The fetcher is gone (it panicked, or stopped after an error
            // already handed on) before the share's end: never mistaken for
            // the end, so a checkpoint never counts the rest as read.
            return Some(Err(ClientError::Local(format!(
                "the stream ended early: at file {} of {}, its fetcher stopped",
                self.position,
                self.share.len()
            ))));
        };
        // After an error the position stays at the file that failed (every
        // one before it was handed on): resume from there.
        if let Ok(f) = &got {
            self.position = f.position + 1;
        }
        Some(got)
    }

    /// The stream as a [`Stream`] (for a server that relays it on).
    pub fn into_stream(self) -> impl Stream<Item = Result<StreamedFile, ClientError>> + Send {
        futures::stream::unfold(self, |mut s| async move {
            let item = s.next().await?;
            Some((item, s))
        })
    }

    /// The index in the ordered share of the next file to yield: store it
    /// in a checkpoint and pass it as [`StreamOptions::start`] to resume
    /// after the last file consumed.
    pub fn position(&self) -> usize {
        self.position
    }

    /// This rank's files, in reading order (all of them, also those before
    /// the start).
    pub fn share(&self) -> &[DatasetFile] {
        &self.share
    }

    /// Where files are placed (see [`StreamOptions::dir`]).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes held locally now (fetched ahead, being fetched, or held by the
    /// consumer).
    pub fn held(&self) -> u64 {
        self.budget.held()
    }

    /// The most bytes held at any moment so far.
    pub fn peak_held(&self) -> u64 {
        self.budget.peak.load(Ordering::SeqCst)
    }

    /// The budget it was given.
    pub fn budget(&self) -> u64 {
        self.budget.limit
    }

    /// A handle on the stream's budget, readable while the stream waits.
    pub fn gauge(&self) -> Gauge {
        Gauge(self.budget.clone())
    }

    /// Whether the stream made its directory itself (it goes with it).
    pub fn owns_dir(&self) -> bool {
        self.owned.is_some()
    }
}

impl Client {
    /// Every file below `prefix`: the files of each key below it (a
    /// directory key's manifest is fetched from one of its sources to list
    /// them), named by their path below the prefix and sorted by it. GPU
    /// data keys are left out and returned apart, with why.
    pub async fn dataset_files(
        &self,
        prefix: &KeyPrefix,
    ) -> Result<(Vec<DatasetFile>, Vec<(Key, String)>), ClientError> {
        self.dataset_files_within(prefix, usize::MAX).await
    }

    /// [`Client::dataset_files`], ended (before the next manifest is
    /// fetched) once more than `max_files` are listed.
    async fn dataset_files_within(
        &self,
        prefix: &KeyPrefix,
        max_files: usize,
    ) -> Result<(Vec<DatasetFile>, Vec<(Key, String)>), ClientError> {
        let too_many = |n: usize| {
            ClientError::Local(format!(
                "{TOO_MANY_FILES}: below {prefix}/ are more than {max_files} files ({n} listed so far)"
            ))
        };
        let listed = self.ls_below(prefix).await?;
        if listed.entries.len() > max_files {
            return Err(too_many(listed.entries.len()));
        }
        let mut files = Vec::new();
        let mut skipped = Vec::new();
        let mut trees = Vec::new();
        for e in listed.entries {
            let Some(record) = e.record else { continue };
            if record.tensors.is_some() {
                skipped.push((record.key, "GPU data: get it with kt tensor get".into()));
            } else if record.is_dir {
                trees.push((record.key, e.name));
            } else {
                files.push(DatasetFile {
                    path: e.name,
                    key: record.key,
                    entry: String::new(),
                    size: record.size,
                });
            }
        }
        if files.is_empty() && trees.is_empty() && skipped.is_empty() {
            return Err(ClientError::Api {
                status: 404,
                code: kt_types::ErrorCode::NotFound,
                message: format!("no keys below {prefix}/"),
            });
        }
        let scratch = tempfile::tempdir()
            .map_err(|e| ClientError::Local(format!("a temporary directory: {e}")))?;
        let scratch = scratch.path();
        let mut manifests =
            futures::stream::iter(trees.into_iter().map(|(key, name)| async move {
                // A get of no file at all: the key's manifest, from a
                // source, verified against the published digest.
                let none = Only::new();
                let (_, dl) = self
                    .call(
                        || format!("listing the files of {key}"),
                        self.get_core(
                            &key,
                            &scratch.join("none"),
                            &GetOptions::default(),
                            Progress::none(),
                            Some(&none),
                        ),
                    )
                    .await?;
                Ok::<Vec<DatasetFile>, ClientError>(
                    dl.manifest()
                        .entries
                        .iter()
                        .filter(|e| e.kind == EntryKind::File)
                        .map(|e| DatasetFile {
                            path: format!("{name}/{}", e.path),
                            key: key.clone(),
                            entry: e.path.clone(),
                            size: e.size,
                        })
                        .collect(),
                )
            }))
            .buffer_unordered(KEYS_AT_ONCE);
        while let Some(m) = manifests.next().await {
            files.extend(m?);
            if files.len() > max_files {
                return Err(too_many(files.len()));
            }
        }
        drop(manifests);
        files.sort_by(|a, b| a.path.cmp(&b.path));
        skipped.sort();
        Ok((files, skipped))
    }

    /// Rank `spec`'s files below `prefix`, in its reading order, and the
    /// keys left out (GPU data).
    pub async fn share_of(
        &self,
        prefix: &KeyPrefix,
        spec: &ShareSpec,
    ) -> Result<(Vec<DatasetFile>, Vec<(Key, String)>), ClientError> {
        self.share_within(prefix, spec, usize::MAX).await
    }

    /// [`Client::share_of`] of a listing of at most `max_files` files.
    async fn share_within(
        &self,
        prefix: &KeyPrefix,
        spec: &ShareSpec,
        max_files: usize,
    ) -> Result<(Vec<DatasetFile>, Vec<(Key, String)>), ClientError> {
        spec.shard
            .validate()
            .map_err(|e| ClientError::Local(e.to_string()))?;
        let (files, skipped) = self.dataset_files_within(prefix, max_files).await?;
        let sized: Vec<(&str, u64)> = files.iter().map(|f| (f.path.as_str(), f.size)).collect();
        let mine = share(&sized, spec)
            .into_iter()
            .map(|i| files[i].clone())
            .collect();
        Ok((mine, skipped))
    }

    /// `kt get PREFIX/ --shard R/W`: fetches rank `spec`'s share of the
    /// files below `prefix` into `dest/<path below the prefix>` (one get per
    /// key, restricted to the share's files of it; a few keys at once).
    /// What was fetched stays when another key fails; the error then names
    /// every key that failed.
    pub async fn get_share(
        &self,
        prefix: &KeyPrefix,
        spec: &ShareSpec,
        dest: &Path,
    ) -> Result<ShareSummary, ClientError> {
        let (files, skipped) = self.share_of(prefix, spec).await?;
        refuse_clashes(prefix, &files)?;
        let mut by_key: BTreeMap<Key, (PathBuf, Only)> = BTreeMap::new();
        for f in &files {
            let place = key_dest(dest, f);
            by_key
                .entry(f.key.clone())
                .or_insert_with(|| (place, Only::new()))
                .1
                .insert(f.entry.clone(), f.size);
        }
        let results: Vec<(Key, Result<GetSummary, ClientError>)> =
            futures::stream::iter(by_key.into_iter().map(|(key, (to, only))| async move {
                let r = self
                    .call(
                        || format!("get of {key} (shard {})", spec.shard),
                        self.get_core(
                            &key,
                            &to,
                            &GetOptions::default(),
                            Progress::none(),
                            Some(&only),
                        ),
                    )
                    .await
                    .map(|(s, _)| s);
                (key, r)
            }))
            .buffer_unordered(KEYS_AT_ONCE)
            .collect()
            .await;
        let gets = crate::transfer::fold_key_gets(results, |failed, total| {
            format!(
                "{failed} of {total} keys of shard {} below {prefix}/ failed",
                spec.shard
            )
        })?;
        Ok(ShareSummary {
            files,
            gets,
            skipped,
        })
    }

    /// Streams rank `opts.spec`'s share of the files below `prefix` (see
    /// the module documentation): lists the dataset, then fetches ahead in
    /// reading order within `opts.budget` while the caller consumes.
    pub async fn stream_share(
        &self,
        prefix: &KeyPrefix,
        opts: StreamOptions,
    ) -> Result<ShareStream, ClientError> {
        let (files, _) = self
            .share_within(prefix, &opts.spec, opts.max_files)
            .await?;
        if opts.start > files.len() {
            return Err(ClientError::Local(format!(
                "start position {} is past the end of shard {}'s {} files",
                opts.start,
                opts.spec.shard,
                files.len()
            )));
        }
        // Always a directory of the stream's own, inside the caller's `dir`
        // when given: a consumed file is deleted, so the stream must never
        // hand out (and then delete) a file that was there before it.
        let made = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .map_err(|e| ClientError::Local(format!("{}: {e}", d.display())))?;
                tempfile::Builder::new()
                    .prefix("kt-stream-")
                    .tempdir_in(d)
                    .map_err(|e| {
                        ClientError::Local(format!("a temporary directory in {}: {e}", d.display()))
                    })?
            }
            None => tempfile::Builder::new()
                .prefix("kt-stream-")
                .tempdir()
                .map_err(|e| ClientError::Local(format!("a temporary directory: {e}")))?,
        };
        let (dir, owned) = (made.path().to_owned(), Some(made));
        // Files another file of the share would take the place of go
        // under a directory of their own (their position's).
        let apart: BTreeSet<usize> = clashes(&files)
            .into_iter()
            .flat_map(|(a, b, _)| [a, b])
            .collect();
        let share = Arc::new(files);
        let budget = Arc::new(Budget {
            limit: opts.budget,
            held: Mutex::new(0),
            peak: AtomicU64::new(0),
            freed: Notify::new(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(prefetch(
            self.clone(),
            share.clone(),
            opts.start,
            opts.ahead.max(1),
            opts.skip,
            (dir.clone(), apart),
            budget.clone(),
            tx,
        ));
        Ok(ShareStream {
            share,
            position: opts.start,
            skip: opts.skip,
            rx,
            budget,
            dir,
            owned,
            task: Some(task),
            rt: tokio::runtime::Handle::current(),
        })
    }
}

/// Pairs of files of `files` (indices) that would take one local place,
/// with how: the same path (a single-file key `p/a/b` and the file `b` of a
/// directory key `p/a`), or a file's path a directory of another's (`p/a`
/// and `p/a/b`). One tree cannot hold both: one would replace or hold the
/// other.
fn clashes(files: &[DatasetFile]) -> Vec<(usize, usize, &'static str)> {
    let mut found = Vec::new();
    let mut by_path: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        if let Some(other) = by_path.insert(f.path.as_str(), i) {
            found.push((other, i, "have the same path"));
        }
    }
    for (i, f) in files.iter().enumerate() {
        let mut at = f.path.as_str();
        while let Some(cut) = at.rfind('/') {
            at = &at[..cut];
            if let Some(&above) = by_path.get(at) {
                found.push((above, i, "would be a file and a directory at once"));
            }
        }
    }
    found
}

/// Refuses a share with [`clashes`], naming the first.
fn refuse_clashes(prefix: &KeyPrefix, files: &[DatasetFile]) -> Result<(), ClientError> {
    let Some(&(a, b, how)) = clashes(files).first() else {
        return Ok(());
    };
    let (a, b) = (&files[a], &files[b]);
    Err(ClientError::Local(format!(
        "two files below {prefix}/ clash: {} (key {}) and {} (key {}) {how}; \
         one directory cannot hold both: move or delete one of the keys, or \
         stream the share instead (a stream places such files apart)",
        a.path, a.key, b.path, b.key
    )))
}

/// Where the get of `f`'s key is placed under `dest`: a single-file key at
/// its path, a directory key at its name (its files below).
fn key_dest(dest: &Path, f: &DatasetFile) -> PathBuf {
    let name = if f.entry.is_empty() {
        f.path.as_str()
    } else {
        f.path
            .strip_suffix(&f.entry)
            .map_or(f.path.as_str(), |s| s.trim_end_matches('/'))
    };
    dest.join(name)
}

/// Whether `skip` passes `f` over.
fn skips(skip: Option<fn(&str) -> bool>, f: &DatasetFile) -> bool {
    skip.is_some_and(|skip| skip(&f.path))
}

/// The stream's fetcher: starts fetches in reading order while the budget
/// and `ahead` allow, and hands each file on, in order, once it is placed;
/// files `skip` passes over are never fetched.
#[allow(clippy::too_many_arguments)]
async fn prefetch(
    client: Client,
    share: Arc<Vec<DatasetFile>>,
    start: usize,
    ahead: usize,
    skip: Option<fn(&str) -> bool>,
    (dir, apart): (PathBuf, BTreeSet<usize>),
    budget: Arc<Budget>,
    tx: mpsc::UnboundedSender<Result<StreamedFile, ClientError>>,
) {
    let mut next = start;
    let mut inflight = FuturesOrdered::new();
    loop {
        loop {
            while next < share.len() && skips(skip, &share[next]) {
                next += 1;
            }
            if next >= share.len()
                || inflight.len() >= ahead
                || !budget.try_reserve(share[next].size)
            {
                break;
            }
            let (client, f, dir, budget) = (
                client.clone(),
                share[next].clone(),
                dir.clone(),
                budget.clone(),
            );
            let position = next;
            // A file another would take the place of goes under a
            // directory of its own (see `clashes`).
            let place = apart
                .contains(&position)
                .then(|| dir.join(position.to_string()));
            inflight.push_back(async move {
                let only = Only::from([(f.entry.clone(), f.size)]);
                let to = key_dest(place.as_ref().unwrap_or(&dir), &f);
                let got = client
                    .call(
                        || format!("get of {} ({})", f.key, f.path),
                        client.get_core(
                            &f.key,
                            &to,
                            &GetOptions::default(),
                            Progress::none(),
                            Some(&only),
                        ),
                    )
                    .await;
                // Where the get placed it (a single-file key whose place is
                // a directory puts it inside), not a path rebuilt here.
                let path = match got {
                    Ok((_, dl)) => dl.path_of(&f.entry).ok_or_else(|| {
                        ClientError::Local(format!(
                            "{}: the get of {} placed no file {:?}",
                            f.path, f.key, f.entry
                        ))
                    }),
                    Err(e) => Err(e),
                };
                let path = match path {
                    Ok(p) => p,
                    Err(e) => {
                        budget.release(f.size);
                        return Err(e);
                    }
                };
                // From here on the file's bytes go back to the budget when
                // this is dropped (consumed, or never handed on).
                Ok(StreamedFile {
                    position,
                    file: f,
                    path,
                    place,
                    budget,
                })
            });
            next += 1;
        }
        if inflight.is_empty() {
            if next >= share.len() {
                return;
            }
            // Everything fetched is held by the consumer: wait for a drop.
            budget.freed.notified().await;
            continue;
        }
        tokio::select! {
            done = inflight.next() => {
                let Some(done) = done else { continue };
                let failed = done.is_err();
                if tx.send(done).is_err() || failed {
                    return;
                }
            }
            _ = budget.freed.notified() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_admits_what_fits_and_one_oversized_file_alone() {
        let b = Budget {
            limit: 100,
            held: Mutex::new(0),
            peak: AtomicU64::new(0),
            freed: Notify::new(),
        };
        assert!(b.try_reserve(60));
        assert!(b.try_reserve(40));
        assert!(!b.try_reserve(1));
        b.release(60);
        assert!(!b.try_reserve(61));
        assert!(b.try_reserve(60));
        b.release(100);
        assert_eq!(b.held(), 0);
        // Larger than the whole budget: only when nothing is held.
        assert!(b.try_reserve(500));
        assert!(!b.try_reserve(1));
        b.release(500);
        assert!(b.try_reserve(10));
        assert!(!b.try_reserve(500));
        assert_eq!(b.peak.load(Ordering::SeqCst), 500);
    }

    #[tokio::test]
    async fn a_fetcher_gone_before_the_end_is_an_error_not_the_end() {
        let key = Key::parse("svc/data/a").unwrap();
        let file = |p: &str| DatasetFile {
            path: p.into(),
            key: key.clone(),
            entry: String::new(),
            size: 1,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let budget = Arc::new(Budget {
            limit: 10,
            held: Mutex::new(0),
            peak: AtomicU64::new(0),
            freed: Notify::new(),
        });
        // A fetcher that ends (as on a panic) without sending anything.
        let task = tokio::spawn(async move { drop(tx) });
        let mut s = ShareStream {
            share: Arc::new(vec![file("a"), file("b")]),
            position: 0,
            skip: None,
            rx,
            budget,
            dir: PathBuf::from("/nonexistent"),
            owned: None,
            task: Some(task),
            rt: tokio::runtime::Handle::current(),
        };
        let e = s.next().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("ended early"), "{e}");
        assert_eq!(s.position(), 0);
    }

    #[test]
    fn keys_are_placed_at_their_name_below_the_destination() {
        let key = Key::parse("svc/data/a").unwrap();
        let single = DatasetFile {
            path: "a".into(),
            key: key.clone(),
            entry: String::new(),
            size: 1,
        };
        let tree = DatasetFile {
            path: "sub/tree/x/y.bin".into(),
            key,
            entry: "x/y.bin".into(),
            size: 1,
        };
        let dest = Path::new("/d");
        assert_eq!(key_dest(dest, &single), Path::new("/d/a"));
        assert_eq!(key_dest(dest, &tree), Path::new("/d/sub/tree"));
    }

    #[test]
    fn a_share_whose_files_take_one_place_is_refused_by_name() {
        let prefix = KeyPrefix::parse("svc/p").unwrap();
        let f = |path: &str, key: &str, entry: &str| DatasetFile {
            path: path.into(),
            key: Key::parse(key).unwrap(),
            entry: entry.into(),
            size: 1,
        };
        // A file `a` and a file `a/b`: `a` would be a directory too.
        let nested = [f("a/b", "svc/p/a/b", ""), f("a", "svc/p/a", "")];
        let e = refuse_clashes(&prefix, &nested).unwrap_err().to_string();
        assert!(e.contains("a (key svc/p/a) and a/b (key svc/p/a/b)"), "{e}");
        assert!(e.contains("a file and a directory"), "{e}");
        // The same path from a single-file key and a directory key.
        let same = [f("a/b", "svc/p/a/b", ""), f("a/b", "svc/p/a", "b")];
        let e = refuse_clashes(&prefix, &same).unwrap_err().to_string();
        assert!(e.contains("have the same path"), "{e}");
        assert!(e.contains("below svc/p/"), "{e}");
        // Siblings and look-alike names are no clash.
        let fine = [
            f("a-x", "svc/p/a-x", ""),
            f("ab/c", "svc/p/ab/c", ""),
            f("a", "svc/p/a", ""),
        ];
        refuse_clashes(&prefix, &fine).unwrap();
    }
}
