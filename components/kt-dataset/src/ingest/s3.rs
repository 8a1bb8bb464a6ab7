//! Ingesting an S3-compatible bucket prefix into a kt key.
//!
//! An ingest lists the prefix, compares the listing with the record the
//! previous ingest left in the staging directory ([`super::plan`]),
//! removes staged files of objects gone, downloads only new and changed
//! objects and, at the same time, puts the staging tree into the key
//! with [`kt_client::Client::put_arriving`] (incremental: only changed
//! files move to the store; published atomically once the last object is
//! in), lifespan `cluster`. The listing gives every object's name, size
//! and time, so the put's manifest goes to the store before the first
//! byte is down: a fetched object's hash deferred, a kept one's from the
//! record. Each object is sent as soon as it is down and verified, its
//! hash the one computed while it was written.
//!
//! Staging directory layout (`staging/`):
//! - `tree/`: the dataset as files, exactly the objects listed (the put's
//!   source);
//! - `parts/`: objects being downloaded, one `.part` file each;
//! - `record.json`: object name → size, ETag, last-modified, blake3 and the
//!   staged file's stamp; written atomically (temp file + rename) at most
//!   every [`S3Config::record_every`] while downloading and once at the end.
//!
//! Invariants:
//! - memory is bounded whatever the objects' sizes: each object's body is
//!   streamed (never buffered whole) through a bounded channel to a
//!   blocking writer with a fixed buffer, at most `concurrency` at a time;
//!   and whatever the bucket's size: a listing of more objects than one key
//!   can hold ([`max_objects`]) stops there and fails;
//! - the staging volume holds at most what was listed: a GET whose object
//!   is not the listed size now is refused before its body is read, and a
//!   body that runs past the listed size is cut off as soon as it does (a
//!   hostile endpoint, or an object replaced since the listing);
//! - a file enters `tree/` only verified (its size, and its MD5 when the
//!   ETag is a plain MD5) and by a rename, so `tree/` never holds a partial
//!   object under a final name;
//! - nothing is written outside the staging directory: object names pass
//!   [`kt_types::manifest::check_rel_path`] first ([`super::plan`]);
//! - resumable: a restart re-lists and skips every object the record says
//!   is complete (and whose staged file still has the recorded stamp).
//!   Leftover `.part` files are discarded, not resumed with a ranged GET:
//!   a part's MD5 and blake3 would have to be recomputed from disk anyway,
//!   and at most `concurrency` objects are lost;
//! - the blake3 of each file, computed while it was written, is its hash
//!   in the put ([`kt_client::Arrived`]), so the put reads each file once,
//!   to send it, and never hashes it; the store hashes what it receives
//!   and publishes nothing unless every file matches;
//! - a failed download ends the put with nothing published (the key keeps
//!   its version); what completed is in the record, so a retry skips it;
//! - the staged tree is what the put published: each file's mode is
//!   [`plan::FILE_MODE`] and its mtime the object's last-modified time, each
//!   directory's mode [`plan::DIR_MODE`] and its mtime the latest of the
//!   files below it ([`plan::manifest`]); [`kt_client::Client::put`] of it
//!   publishes the same manifest.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use kt_client::{Client, Progress};
use kt_types::api::PutOptions;
use kt_types::{Hash, Key, Lifespan};
use md5::Digest;
use object_store::ObjectStore;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;

use super::plan::{self, Listed, PlanError, Record, Recorded, Staged};
use crate::crd::{IngestStatus, S3Source};

/// Objects downloaded at once by default.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default of [`S3Config::record_every`].
pub const RECORD_EVERY: Duration = Duration::from_millis(500);
/// Each writer's file buffer.
const WRITE_BUFFER: usize = 1 << 20;
/// Body chunks queued between a download and its writer.
const QUEUED_CHUNKS: usize = 16;

/// Credentials for the source (from the Dataset's `credentialsSecret`).
#[derive(Clone, PartialEq, Eq)]
pub struct S3Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// Where to read and how.
#[derive(Debug, Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Objects below this prefix (`a/b` means `a/b/...`); empty: all.
    pub prefix: String,
    /// `http(s)://host:port`; `None`: AWS's endpoint for the region.
    pub endpoint: Option<String>,
    /// `us-east-1` when `None`.
    pub region: Option<String>,
    /// `None`: anonymous (unsigned) requests.
    pub credentials: Option<S3Credentials>,
    /// Objects downloaded at once.
    pub concurrency: usize,
    /// The longest the record of completed downloads may lag behind them
    /// (what a crash makes the next ingest fetch again); zero: written
    /// after every object.
    pub record_every: Duration,
}

impl S3Config {
    /// The configuration of a Dataset's S3 source, with the credentials the
    /// caller read from its Secret.
    pub fn from_source(src: &S3Source, credentials: Option<S3Credentials>) -> Self {
        S3Config {
            bucket: src.bucket.clone(),
            prefix: src.prefix.clone(),
            endpoint: src.endpoint.clone(),
            region: src.region.clone(),
            credentials,
            concurrency: DEFAULT_CONCURRENCY,
            record_every: RECORD_EVERY,
        }
    }

    /// `s3://bucket/prefix`.
    pub fn describe(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.prefix.trim_matches('/'))
    }

    fn store(&self) -> Result<AmazonS3, IngestError> {
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&self.bucket)
            .with_region(self.region.as_deref().unwrap_or("us-east-1"));
        if let Some(ep) = &self.endpoint {
            // A custom endpoint (MinIO, moto, Ceph…) is addressed by path.
            b = b
                .with_endpoint(ep)
                .with_allow_http(ep.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        b = match &self.credentials {
            Some(c) => {
                let b = b
                    .with_access_key_id(&c.access_key_id)
                    .with_secret_access_key(&c.secret_access_key);
                match &c.session_token {
                    Some(t) => b.with_token(t),
                    None => b,
                }
            }
            None => b.with_skip_signature(true),
        };
        b.build().map_err(|e| IngestError::Config(e.to_string()))
    }

    fn prefix_path(&self) -> Result<Option<ObjectPath>, IngestError> {
        let p = self.prefix.trim_matches('/');
        if p.is_empty() {
            return Ok(None);
        }
        ObjectPath::parse(p)
            .map(Some)
            .map_err(|e| IngestError::Config(format!("prefix {:?}: {e}", self.prefix)))
    }
}

/// Why an ingest failed.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("S3 source configuration: {0}")]
    Config(String),
    /// Listing failed: `reason` is the S3 error's code and message
    /// (`NoSuchBucket: …`, `InvalidAccessKeyId: …`) when the server sent
    /// one, else the client's error.
    #[error("listing {source_url}: {reason}")]
    List {
        source_url: String,
        reason: String,
        #[source]
        error: object_store::Error,
    },
    /// An object whose name is not a safe relative path, or names that
    /// cannot coexist as files.
    #[error("{0}")]
    Plan(#[from] PlanError),
    /// An object name the S3 client itself rejects (`..`, empty segments).
    #[error("object {name:?} cannot be ingested: {reason}")]
    BadName { name: String, reason: String },
    #[error("object {key:?}: {message}")]
    Object { key: String, message: String },
    #[error("staging {}: {error}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        error: io::Error,
    },
    /// The listing has more objects than one key can hold.
    #[error("listing {source_url}: more than {limit} objects (the most one key holds)")]
    TooManyObjects { source_url: String, limit: usize },
    #[error("putting {source_url} into {key}: {error}")]
    Put {
        source_url: String,
        key: Key,
        #[source]
        error: kt_client::ClientError,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> IngestError + '_ {
    move |error| IngestError::Io {
        path: path.to_owned(),
        error,
    }
}

/// What an ingest reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestEvent {
    /// The source was listed and compared with the record.
    Planned {
        objects: u64,
        bytes: u64,
        fetch: u64,
        fetch_bytes: u64,
        remove: u64,
    },
    /// One object was downloaded and verified.
    Fetched { name: String, bytes: u64 },
    /// The put starts (beside the downloads: each object is sent as soon
    /// as it is down).
    Putting,
}

/// The progress callback.
pub type OnProgress = Arc<dyn Fn(&IngestEvent) + Send + Sync>;

/// What an ingest did.
#[derive(Debug, Clone)]
pub struct IngestReport {
    /// Objects (files) in the dataset.
    pub objects: u64,
    /// Bytes in the dataset.
    pub bytes: u64,
    /// Objects downloaded (new or changed, or not complete in staging).
    pub changed: u64,
    /// Bytes downloaded.
    pub fetched_bytes: u64,
    /// Objects gone from the source since the previous ingest.
    pub removed: u64,
    /// Empty "folder marker" objects skipped.
    pub markers: u64,
    /// The key's version after the put.
    pub version: String,
    /// What the put did (`stats.bytes_sent`: what reached the store).
    pub put: kt_client::PutSummary,
    /// For the Dataset's status.
    pub status: IngestStatus,
}

/// The staging directory's parts.
#[derive(Debug, Clone)]
struct Staging {
    tree: PathBuf,
    parts: PathBuf,
    record: PathBuf,
}

impl Staging {
    fn new(root: &Path) -> Self {
        Staging {
            tree: root.join("tree"),
            parts: root.join("parts"),
            record: root.join("record.json"),
        }
    }

    fn load_record(&self, source: &str) -> Record {
        fs::read(&self.record)
            .ok()
            .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
            .filter(|r| r.source == source)
            .unwrap_or_else(|| Record {
                source: source.to_owned(),
                ..Record::default()
            })
    }

    fn save_record(&self, record: &Record) -> Result<(), IngestError> {
        let tmp = self.record.with_extension("json.tmp");
        let body = serde_json::to_vec(record).map_err(|e| IngestError::Io {
            path: self.record.clone(),
            error: io::Error::other(e),
        })?;
        fs::write(&tmp, body).map_err(io_at(&tmp))?;
        fs::rename(&tmp, &self.record).map_err(io_at(&self.record))
    }
}

/// Ingests every object below `cfg.prefix` into `key`, staging under
/// `staging` (kept between ingests: it is what makes the next one move
/// only what changed).
pub async fn ingest(
    client: &Client,
    key: &Key,
    cfg: &S3Config,
    staging: &Path,
    progress: Option<OnProgress>,
) -> Result<IngestReport, IngestError> {
    let note = |e: IngestEvent| {
        if let Some(p) = &progress {
            p(&e);
        }
    };
    let source_url = cfg.describe();
    let store = Arc::new(cfg.store()?);
    let st = Staging::new(staging);
    for d in [&st.tree, &st.parts] {
        fs::create_dir_all(d).map_err(io_at(d))?;
    }
    // Leftover parts of an interrupted ingest are discarded.
    clear_dir(&st.parts)?;
    let listed_at = now_rfc3339();
    let listing = list(&store, cfg, max_objects()).await?;
    let mut record = st.load_record(&source_url);
    let tree = st.tree.clone();
    let plan = plan::plan(listing, &record, |name, r| {
        stamp_matches(&tree.join(name), r)
    })?;
    note(IngestEvent::Planned {
        objects: plan.objects(),
        bytes: plan.bytes(),
        fetch: plan.fetch.len() as u64,
        fetch_bytes: plan.fetch_bytes(),
        remove: plan.remove.len() as u64,
    });
    // Gone objects first, so a new object may take a removed one's place
    // as a directory.
    for name in &plan.remove {
        record.objects.remove(name);
    }
    for l in &plan.fetch {
        record.objects.remove(&l.name);
    }
    st.save_record(&record)?;
    sweep(&st.tree, &plan)?;

    // The tree as it will be: kept files as staged, fetched ones as the
    // listing says they will be (their hashes deferred).
    let staged = staged_files(&st.tree, &plan, &record).await?;
    let (manifest, index) = plan::manifest(&staged);
    let dirs: Vec<(String, i64, u32)> = manifest
        .entries
        .iter()
        .filter(|e| e.kind == kt_types::EntryKind::Dir)
        .map(|e| (e.path.clone(), e.mtime, e.mtime_nsec))
        .collect();
    let pending: Vec<u32> = index[plan.keep.len()..].to_vec();
    // Room for every arrival: a download never waits for the put.
    let (arrived, arrivals) = tokio::sync::mpsc::channel(plan.fetch.len().max(1));
    let options = PutOptions {
        lifespan: Some(Lifespan::Cluster),
        ..PutOptions::default()
    };
    let put_err = |error| IngestError::Put {
        source_url: source_url.clone(),
        key: key.clone(),
        error,
    };
    note(IngestEvent::Putting);
    let tree = kt_client::Arriving {
        manifest,
        pending: pending.clone(),
        arrivals,
    };
    let putting = client.put_arriving(key, &st.tree, tree, options, Progress::none());
    let fetching = async {
        let mut fetched_bytes = 0;
        let mut last_save = Instant::now();
        let mut downloads = futures::stream::iter(plan.fetch.iter().zip(&pending).enumerate().map(
            |(i, (l, &index))| {
                let store = store.clone();
                let part = st.parts.join(format!("{i}.part"));
                let dest = st.tree.join(&l.name);
                async move {
                    let (l, rec, hash) = fetch_object(&store, l, &part, &dest, true).await?;
                    let hash = hash.ok_or_else(|| IngestError::Object {
                        key: l.key.clone(),
                        message: "downloaded without its hash".to_owned(),
                    })?;
                    Ok::<_, IngestError>((l, rec, hash, index))
                }
            },
        ))
        .buffer_unordered(cfg.concurrency.max(1));
        let (mut failed, mut put_ended): (Option<IngestError>, bool) = (None, false);
        while let Some(done) = downloads.next().await {
            match done {
                Ok((l, rec, hash, index)) => {
                    fetched_bytes += l.size;
                    note(IngestEvent::Fetched {
                        name: l.name.clone(),
                        bytes: l.size,
                    });
                    record.objects.insert(l.name.clone(), rec);
                    if last_save.elapsed() >= cfg.record_every {
                        st.save_record(&record)?;
                        last_save = Instant::now();
                    }
                    let hash = Hash(*hash.as_bytes());
                    if arrived
                        .send(kt_client::Arrived { index, hash })
                        .await
                        .is_err()
                    {
                        // The put ended (failed): it says why.
                        put_ended = true;
                        break;
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(downloads);
        // The put fails, publishing nothing, unless every object arrived.
        drop(arrived);
        // What completed is kept, failure or not: a retry skips it.
        st.save_record(&record)?;
        if let Some(e) = failed {
            clear_dir(&st.parts)?;
            return Err(e);
        }
        if put_ended {
            clear_dir(&st.parts)?;
            return Ok(fetched_bytes);
        }
        // The directories as the manifest has them (renames into them
        // changed their times).
        let tree = st.tree.clone();
        kt_sync::task::spawn(move || set_dir_times(&tree, &dirs))
            .await
            .map_err(|e| IngestError::Io {
                path: st.tree.clone(),
                error: io::Error::other(e.0),
            })??;
        Ok::<u64, IngestError>(fetched_bytes)
    };
    let (fetched, put) = tokio::join!(fetching, putting);
    let fetched_bytes = fetched?;
    let put = put.map_err(put_err)?;
    let version = match &put.record {
        Some(r) => r.version.clone(),
        None => client.stat(key).await.map_err(put_err)?.version,
    };
    let status = IngestStatus {
        objects: plan.objects(),
        bytes: plan.bytes(),
        changed: plan.fetch.len() as u64,
        removed: plan.remove.len() as u64,
        last_listed: Some(listed_at),
    };
    Ok(IngestReport {
        objects: status.objects,
        bytes: status.bytes,
        changed: status.changed,
        fetched_bytes,
        removed: status.removed,
        markers: plan.markers,
        version,
        put,
        status,
    })
}

/// What a plain download did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DownloadReport {
    pub objects: u64,
    pub bytes: u64,
}

/// Downloads every object below the prefix into `dest` as files, with the
/// same client, concurrency and streaming writer as [`ingest`] but no
/// hashing, record or put: the baseline an ingest is measured against.
pub async fn download(cfg: &S3Config, dest: &Path) -> Result<DownloadReport, IngestError> {
    let store = Arc::new(cfg.store()?);
    let listing = list(&store, cfg, max_objects()).await?;
    let plan = plan::plan(listing, &Record::default(), |_, _| false)?;
    let parts = dest.join(".parts");
    fs::create_dir_all(&parts).map_err(io_at(&parts))?;
    futures::stream::iter(plan.fetch.iter().enumerate().map(|(i, l)| {
        let store = store.clone();
        let part = parts.join(format!("{i}.part"));
        let file = dest.join(&l.name);
        async move { fetch_object(&store, l, &part, &file, false).await }
    }))
    .buffer_unordered(cfg.concurrency.max(1))
    .try_for_each(|_| async { Ok(()) })
    .await?;
    fs::remove_dir(&parts).map_err(io_at(&parts))?;
    Ok(DownloadReport {
        objects: plan.objects(),
        bytes: plan.bytes(),
    })
}

/// The most objects an ingest lists: a key's manifest holds at most
/// [`kt_types::manifest::ManifestLimits::max_entries`] entries, so a larger
/// listing could never be put (and holding all of it would cost the
/// controller's memory for nothing).
pub fn max_objects() -> usize {
    kt_types::manifest::ManifestLimits::default().max_entries
}

/// The objects below the prefix; more than `limit` is an error
/// ([`IngestError::TooManyObjects`]), found without listing further.
async fn list(store: &AmazonS3, cfg: &S3Config, limit: usize) -> Result<Vec<Listed>, IngestError> {
    let prefix = cfg.prefix_path()?;
    let listing = store.list(prefix.as_ref());
    let metas = at_most(listing, limit)
        .await
        .map_err(|error| match error {
            object_store::Error::InvalidPath { source } => {
                let name = match &source {
                    object_store::path::Error::EmptySegment { path }
                    | object_store::path::Error::BadSegment { path, .. } => path.clone(),
                    _ => String::new(),
                };
                IngestError::BadName {
                    name,
                    reason: source.to_string(),
                }
            }
            error => IngestError::List {
                source_url: cfg.describe(),
                reason: s3_reason(&error),
                error,
            },
        })?
        .ok_or_else(|| IngestError::TooManyObjects {
            source_url: cfg.describe(),
            limit,
        })?;
    let strip = prefix.map(|p| format!("{p}/")).unwrap_or_default();
    Ok(metas
        .into_iter()
        .map(|m| {
            let key = m.location.to_string();
            Listed {
                name: key.strip_prefix(&strip).unwrap_or(&key).to_owned(),
                key,
                size: m.size,
                e_tag: m.e_tag,
                last_modified: m.last_modified.to_rfc3339(),
                mtime: (
                    m.last_modified.timestamp(),
                    m.last_modified.timestamp_subsec_nanos().min(999_999_999),
                ),
            }
        })
        .collect())
}

/// The items of `stream` if there are at most `max`; `None` once it
/// yields one more (read no further).
async fn at_most<T, E>(
    stream: impl futures::Stream<Item = Result<T, E>>,
    max: usize,
) -> Result<Option<Vec<T>>, E> {
    let mut stream = std::pin::pin!(stream);
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        if out.len() == max {
            return Ok(None);
        }
        out.push(item?);
    }
    Ok(Some(out))
}

/// How a body's streaming to its writer ended.
#[derive(Debug)]
enum Pumped<E> {
    /// The body ended (or the writer stopped: it says why).
    Done,
    /// The body ran past `limit` bytes; nothing more was read.
    TooLong,
    Failed(E),
}

/// Sends `body`'s chunks to `tx` until it ends, the writer stops, or the
/// bytes exceed `limit` (a body longer than its object was listed: its
/// excess is neither read on nor written).
async fn pump<E>(
    body: impl futures::Stream<Item = Result<Bytes, E>>,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    limit: u64,
) -> Pumped<E> {
    let mut body = std::pin::pin!(body);
    let mut n = 0u64;
    while let Some(chunk) = body.next().await {
        let c = match chunk {
            Ok(c) => c,
            Err(e) => return Pumped::Failed(e),
        };
        n += c.len() as u64;
        if n > limit {
            return Pumped::TooLong;
        }
        // A writer that stopped says why (the caller awaits it).
        if tx.send(c).await.is_err() {
            break;
        }
    }
    Pumped::Done
}

/// Downloads one object to `part`, verifies it, renames it to `dest`.
/// With `hash` (an ingest), computes its MD5 (checked against a plain-MD5
/// ETag) and blake3 while writing, gives the file mode
/// [`plan::FILE_MODE`] and the object's last-modified time as mtime, and
/// returns its record and blake3.
async fn fetch_object<'a>(
    store: &AmazonS3,
    l: &'a Listed,
    part: &Path,
    dest: &Path,
    hash: bool,
) -> Result<(&'a Listed, Recorded, Option<blake3::Hash>), IngestError> {
    let object_err = |message: String| IngestError::Object {
        key: l.key.clone(),
        message,
    };
    let location = ObjectPath::parse(&l.key).map_err(|e| object_err(e.to_string()))?;
    let got = store
        .get(&location)
        .await
        .map_err(|e| object_err(format!("GET: {}", s3_reason(&e))))?;
    if got.meta.size != l.size {
        return Err(object_err(format!(
            "the GET says {} bytes, {} listed (changed since the listing)",
            got.meta.size, l.size
        )));
    }
    let body = got.into_stream();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let part_owned = part.to_owned();
    let stamp = hash.then_some(l.mtime);
    let writer = kt_sync::task::spawn(move || write_part(&part_owned, rx, stamp));
    let pumped = pump(body, &tx, l.size).await;
    drop(tx);
    let written = writer
        .await
        .map_err(|e| object_err(format!("writer: {}", e.0)))?
        .map_err(io_at(part));
    match pumped {
        Pumped::Done => {}
        Pumped::TooLong => {
            let _ = fs::remove_file(part);
            return Err(object_err(format!(
                "the body runs past the {} bytes listed",
                l.size
            )));
        }
        Pumped::Failed(e) => {
            let _ = fs::remove_file(part);
            return Err(object_err(format!("reading the body: {e}")));
        }
    }
    let (n, md5, b3) = written?;
    let bad = |m: String| {
        let _ = fs::remove_file(part);
        Err(object_err(m))
    };
    if n != l.size {
        return bad(format!("{n} bytes received, {} listed", l.size));
    }
    if let (Some(want), Some(got)) = (l.e_tag.as_deref().and_then(plan::plain_md5), md5)
        && want != got
    {
        return bad("content does not match its ETag (MD5)".to_owned());
    }
    if let Some(dir) = dest.parent() {
        fs::create_dir_all(dir).map_err(io_at(dir))?;
    }
    fs::rename(part, dest).map_err(io_at(dest))?;
    // The stamp after the rename (it changes the file's ctime).
    let md = fs::metadata(dest).map_err(io_at(dest))?;
    Ok((
        l,
        Recorded {
            size: l.size,
            e_tag: l.e_tag.clone(),
            last_modified: l.last_modified.clone(),
            blake3: b3.map(|h| h.to_hex().to_string()).unwrap_or_default(),
            ino: md.ino(),
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec(),
            ctime: md.ctime(),
            ctime_nsec: md.ctime_nsec(),
        },
        b3,
    ))
}

type Written = (u64, Option<[u8; 16]>, Option<blake3::Hash>);

/// Writes what `rx` brings to `path` (created afresh). With `stamp` (an
/// ingest's: the object's mtime), hashes on the way and gives the file
/// mode [`plan::FILE_MODE`] and that mtime.
fn write_part(
    path: &Path,
    mut rx: tokio::sync::mpsc::Receiver<Bytes>,
    stamp: Option<(i64, u32)>,
) -> io::Result<Written> {
    let hash = stamp.is_some();
    let mut out = io::BufWriter::with_capacity(WRITE_BUFFER, fs::File::create(path)?);
    let mut md5 = hash.then(md5::Md5::new);
    let mut b3 = hash.then(blake3::Hasher::new);
    let mut n = 0u64;
    while let Some(chunk) = rx.blocking_recv() {
        if let Some(h) = md5.as_mut() {
            h.update(&chunk);
        }
        if let Some(h) = b3.as_mut() {
            h.update(&chunk);
        }
        out.write_all(&chunk)?;
        n += chunk.len() as u64;
    }
    out.flush()?;
    if let Some(mtime) = stamp {
        use std::os::unix::fs::PermissionsExt;
        let f = out.get_ref();
        f.set_permissions(fs::Permissions::from_mode(plan::FILE_MODE))?;
        f.set_times(fs::FileTimes::new().set_modified(system_time(mtime)))?;
    }
    Ok((
        n,
        md5.map(|h| h.finalize().into()),
        b3.map(|h| h.finalize()),
    ))
}

/// Whether the staged file is the one the record describes, untouched.
fn stamp_matches(path: &Path, r: &Recorded) -> bool {
    fs::symlink_metadata(path).is_ok_and(|md| {
        md.is_file()
            && md.len() == r.size
            && md.ino() == r.ino
            && md.mtime() == r.mtime
            && md.mtime_nsec() == r.mtime_nsec
            && md.ctime() == r.ctime
            && md.ctime_nsec() == r.ctime_nsec
    })
}

/// Makes `tree` hold nothing but the kept objects: removes files of
/// objects gone or to be fetched again, and anything else (a crash's
/// leftovers, directories no longer needed).
fn sweep(tree: &Path, plan: &plan::Plan) -> Result<(), IngestError> {
    let keep: std::collections::BTreeSet<&str> =
        plan.keep.iter().map(|l| l.name.as_str()).collect();
    sweep_dir(tree, "", &keep).map(|_| ())
}

/// Returns whether `dir` still holds anything.
fn sweep_dir(
    dir: &Path,
    rel: &str,
    keep: &std::collections::BTreeSet<&str>,
) -> Result<bool, IngestError> {
    let mut left = false;
    for dent in fs::read_dir(dir).map_err(io_at(dir))? {
        let dent = dent.map_err(io_at(dir))?;
        let path = dent.path();
        let name = dent.file_name();
        let Some(name) = name.to_str() else {
            fs::remove_file(&path).map_err(io_at(&path))?;
            continue;
        };
        let sub = if rel.is_empty() {
            name.to_owned()
        } else {
            format!("{rel}/{name}")
        };
        let ft = dent.file_type().map_err(io_at(&path))?;
        if ft.is_dir() {
            if sweep_dir(&path, &sub, keep)? {
                left = true;
            } else {
                fs::remove_dir(&path).map_err(io_at(&path))?;
            }
        } else if keep.contains(sub.as_str()) && ft.is_file() {
            left = true;
        } else {
            fs::remove_file(&path).map_err(io_at(&path))?;
        }
    }
    Ok(left)
}

fn clear_dir(dir: &Path) -> Result<(), IngestError> {
    for dent in fs::read_dir(dir).map_err(io_at(dir))? {
        let path = dent.map_err(io_at(dir))?.path();
        if path.is_dir() {
            fs::remove_dir_all(&path).map_err(io_at(&path))?;
        } else {
            fs::remove_file(&path).map_err(io_at(&path))?;
        }
    }
    Ok(())
}

/// The files of the staging tree once the fetched objects are in: first
/// the kept ones as staged (their hashes from the record, else read now),
/// then the fetched ones as the listing says they will be (mode
/// [`plan::FILE_MODE`], the object's time, no hash yet).
async fn staged_files(
    tree: &Path,
    plan: &plan::Plan,
    record: &Record,
) -> Result<Vec<Staged>, IngestError> {
    let tree = tree.to_owned();
    let kept: Vec<(String, u64, Option<String>)> = plan
        .keep
        .iter()
        .map(|l| {
            let recorded = record.objects.get(&l.name).map(|r| r.blake3.clone());
            (l.name.clone(), l.size, recorded)
        })
        .collect();
    let mut files = kt_sync::task::spawn(move || {
        kept.into_iter()
            .map(|(name, size, recorded)| {
                let path = tree.join(&name);
                let md = fs::symlink_metadata(&path).map_err(io_at(&path))?;
                let hash = match recorded.and_then(|h| blake3::Hash::from_hex(h).ok()) {
                    Some(h) => Hash(*h.as_bytes()),
                    None => kt_sync::scan::hash_file(&path, size).map_err(|e| IngestError::Io {
                        path: path.clone(),
                        error: io::Error::other(e),
                    })?,
                };
                Ok(Staged {
                    name,
                    size: md.len(),
                    mode: kt_types::manifest::safe_mode(md.mode()),
                    mtime: md.mtime(),
                    mtime_nsec: md.mtime_nsec().clamp(0, 999_999_999) as u32,
                    hash: Some(hash),
                })
            })
            .collect::<Result<Vec<_>, IngestError>>()
    })
    .await
    .map_err(|e| IngestError::Io {
        path: PathBuf::new(),
        error: io::Error::other(e.0),
    })??;
    files.extend(plan.fetch.iter().map(|l| Staged {
        name: l.name.clone(),
        size: l.size,
        mode: plan::FILE_MODE,
        mtime: l.mtime.0,
        mtime_nsec: l.mtime.1,
        hash: None,
    }));
    Ok(files)
}

/// Gives each directory of the staging tree (`dirs`: path, mtime) the mode
/// and time the put's manifest says.
fn set_dir_times(tree: &Path, dirs: &[(String, i64, u32)]) -> Result<(), IngestError> {
    use std::os::unix::fs::PermissionsExt;
    for (rel, secs, nsec) in dirs {
        let path = tree.join(rel);
        let dir = fs::File::open(&path).map_err(io_at(&path))?;
        dir.set_permissions(fs::Permissions::from_mode(plan::DIR_MODE))
            .map_err(io_at(&path))?;
        dir.set_times(fs::FileTimes::new().set_modified(system_time((*secs, *nsec))))
            .map_err(io_at(&path))?;
    }
    Ok(())
}

/// Seconds and nanoseconds since the epoch as a time.
fn system_time((secs, nsec): (i64, u32)) -> SystemTime {
    let base = if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    };
    base + Duration::from_nanos(u64::from(nsec))
}

/// An S3 error in one line: `Code: Message (HTTP status)` from the error
/// document the server sent, else the client's whole error.
fn s3_reason(e: &object_store::Error) -> String {
    let text = e.to_string();
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let len = text[start..].find(&format!("</{name}>"))?;
        Some(text[start..start + len].trim().to_owned())
    };
    let status = text
        .find("status code: ")
        .map(|i| &text[i + "status code: ".len()..])
        .and_then(|t| t.split(':').next())
        .map(|s| format!(" (HTTP {})", s.trim()))
        .unwrap_or_default();
    match (tag("Code"), tag("Message")) {
        (Some(code), Some(message)) => format!("{code}: {message}{status}"),
        (Some(code), None) => format!("{code}{status}"),
        _ => text,
    }
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A body of `chunks` chunks of 10 bytes, counting those read.
    fn body(
        chunks: usize,
        read: Arc<AtomicUsize>,
    ) -> impl futures::Stream<Item = Result<Bytes, io::Error>> {
        futures::stream::iter(0..chunks).map(move |_| {
            read.fetch_add(1, Ordering::SeqCst);
            Ok(Bytes::from_static(&[7; 10]))
        })
    }

    /// A body longer than listed is cut off at the chunk that runs past
    /// the listing: the rest is neither read nor handed to the writer.
    #[tokio::test]
    async fn a_body_past_its_listed_size_stops_being_read() {
        let read = Arc::new(AtomicUsize::new(0));
        let (tx, mut rx) = tokio::sync::mpsc::channel(1000);
        let pumped = pump(body(1000, read.clone()), &tx, 25).await;
        assert!(matches!(pumped, Pumped::TooLong), "{pumped:?}");
        assert_eq!(read.load(Ordering::SeqCst), 3, "read on past the limit");
        drop(tx);
        let mut written = 0;
        while let Some(c) = rx.recv().await {
            written += c.len();
        }
        assert_eq!(written, 20, "only what fits the listed size is written");

        // The listed size exactly: all of it.
        let read = Arc::new(AtomicUsize::new(0));
        let (tx, _rx) = tokio::sync::mpsc::channel(1000);
        let pumped = pump(body(3, read.clone()), &tx, 30).await;
        assert!(matches!(pumped, Pumped::Done), "{pumped:?}");
        assert_eq!(read.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_listing_stops_one_past_the_limit() {
        let read = Arc::new(AtomicUsize::new(0));
        let r = read.clone();
        let endless = futures::stream::iter(0..).map(move |i| {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(i)
        });
        assert_eq!(at_most(endless, 4).await, Ok(None));
        assert_eq!(read.load(Ordering::SeqCst), 5);
        let three = futures::stream::iter([Ok::<_, ()>(1), Ok(2), Ok(3)]);
        assert_eq!(at_most(three, 3).await, Ok(Some(vec![1, 2, 3])));
        assert_eq!(max_objects(), 5_000_000, "ManifestLimits' default");
    }

    /// Against moto (skipped when it is not installed, as in
    /// tests/ingest_s3.rs): a listing over the limit fails, naming it.
    #[tokio::test]
    async fn listing_more_objects_than_the_limit_fails() {
        use super::super::moto::Moto;
        let Some(moto) = Moto::or_skip(Moto::start().await) else {
            return;
        };
        moto.create_bucket("listing").await.expect("bucket");
        for name in ["d/a", "d/b", "d/c"] {
            moto.put_object("listing", name, b"x".to_vec())
                .await
                .expect("put");
        }
        let cfg = S3Config {
            bucket: "listing".into(),
            prefix: "d".into(),
            endpoint: Some(moto.endpoint().to_owned()),
            region: None,
            credentials: Some(S3Credentials {
                access_key_id: "test".into(),
                secret_access_key: "test".into(),
                session_token: None,
            }),
            concurrency: 1,
            record_every: Duration::ZERO,
        };
        let store = cfg.store().expect("store");
        assert_eq!(list(&store, &cfg, 3).await.expect("3 objects").len(), 3);
        let err = list(&store, &cfg, 2).await.expect_err("over the limit");
        assert!(
            matches!(err, IngestError::TooManyObjects { limit: 2, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("more than 2 objects"), "{err}");
    }
}
