//! Many files in one stream (see [`kt_types::frame`] for the framing).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use kt_types::frame::{self, HEADER_LEN, Header};
use kt_types::{Entry, Hash};
use tokio::sync::mpsc;

use crate::apply::{WriteMode, write_hashing, write_verified};
use crate::error::{IoContext, SyncError};

/// Callback told the byte count of each file sent or received.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// Coalesce records into buffers of about this size before handing them to the body.
const BUFFER_TARGET: usize = 1 << 20;

/// One file to send.
#[derive(Debug, Clone)]
pub struct SendItem {
    pub index: u32,
    pub path: PathBuf,
    pub size: u64,
    pub entry_path: String,
    /// The content, when the sender already holds it (read while scanning).
    pub data: Option<Bytes>,
    /// Open `path` below this directory only: no symlink on the way or at
    /// the end, a regular file (a served tree whose owner may swap things
    /// in; see [`crate::beneath`]). `None`: the sender's own files.
    pub beneath: Option<std::path::PathBuf>,
}

/// A stream of framed file contents, read on a blocking thread.
pub fn send_stream(
    items: Vec<SendItem>,
    progress: Option<Progress>,
) -> impl Stream<Item = Result<Bytes, SyncError>> + Send + 'static {
    let (tx, rx) = mpsc::channel::<Result<Bytes, SyncError>>(4);
    crate::task::spawn(move || {
        let mut buf = BytesMut::with_capacity(BUFFER_TARGET);
        for item in &items {
            if let Err(e) = read_into(item, &mut buf) {
                let _ = tx.blocking_send(Err(e));
                return;
            }
            if let Some(p) = &progress {
                p(item.size);
            }
            if buf.len() >= BUFFER_TARGET && tx.blocking_send(Ok(buf.split().freeze())).is_err() {
                return;
            }
        }
        buf.extend_from_slice(&frame::encode_end());
        let _ = tx.blocking_send(Ok(buf.freeze()));
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

fn read_into(item: &SendItem, buf: &mut BytesMut) -> Result<(), SyncError> {
    let start = buf.len();
    buf.extend_from_slice(&frame::encode(item.index, item.size));
    if let Some(data) = item.data.as_ref().filter(|d| d.len() as u64 == item.size) {
        buf.extend_from_slice(data);
        return Ok(());
    }
    let body_start = buf.len();
    // One byte of room beyond the expected size reveals a file that grew.
    let want = item.size as usize;
    buf.resize(body_start + want + 1, 0);
    let mut f = match &item.beneath {
        Some(root) => {
            let rel = item.path.strip_prefix(root).unwrap_or(&item.path);
            crate::beneath::open_file_beneath(root, rel)
        }
        None => File::open(&item.path),
    }
    .at(&item.path)?;
    let mut filled = 0usize;
    loop {
        let room = want + 1 - filled;
        let n = f.read(&mut buf[body_start + filled..]).at(&item.path)?;
        filled += n;
        // A short read of a regular file means its end was reached.
        if n == 0 || n < room || filled > want {
            break;
        }
    }
    buf.truncate(body_start + filled.min(want));
    if filled != want {
        buf.truncate(start);
        return Err(SyncError::SizeMismatch {
            path: item.entry_path.clone(),
            expected: item.size,
            actual: filled as u64,
        });
    }
    Ok(())
}

/// Where a received entry goes.
#[derive(Debug, Clone)]
///
/// An entry without a hash (a put's deferred entry: the store builds these,
/// a manifest never has one, [`kt_types::Manifest::validate`]) is written
/// unverified and its hash as received is returned in
/// [`Received::hashed`], for the receiver to check before anything reads it.
pub struct Expected {
    pub dest: PathBuf,
    pub entry: Entry,
}

/// What one received stream wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Received {
    pub files: u64,
    pub bytes: u64,
    /// Manifest indices written (verified), in arrival order.
    pub indices: Vec<u32>,
    /// Of those, the entries expected without a hash ([`Expected`]), with
    /// the hash of what was written (not verified: the caller's to check).
    pub hashed: Vec<(u32, Hash)>,
}

/// Decodes a frame stream and writes each file, verified, to its destination.
///
/// Only indices in `expected` are accepted, each once, with exactly the size the
/// manifest gives; a stream that stops before its end record is `Truncated`.
/// Writing runs on a blocking thread, overlapped with reading the stream.
pub async fn receive_stream<S, E>(
    body: S,
    expected: Arc<HashMap<u32, Expected>>,
    mode: WriteMode,
    progress: Option<Progress>,
) -> Result<Received, SyncError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let written = progress.map(|p| {
        let f: Written = Arc::new(move |_, n| p(n));
        f
    });
    receive_stream_notify(body, expected, mode, written).await
}

/// Callback told each file written (verified and in place): its index and size.
pub type Written = Arc<dyn Fn(u32, u64) + Send + Sync>;

/// [`receive_stream`], telling `written` about each file as soon as it is in
/// place (a relay serves it on from there).
pub async fn receive_stream_notify<S, E>(
    mut body: S,
    expected: Arc<HashMap<u32, Expected>>,
    mode: WriteMode,
    written: Option<Written>,
) -> Result<Received, SyncError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let (tx, mut rx) = mpsc::channel::<(u32, Bytes)>(32);
    let table = expected.clone();
    let writer = crate::task::spawn(move || -> Result<Received, SyncError> {
        let mut total = Received::default();
        while let Some((index, data)) = rx.blocking_recv() {
            let Some(x) = table.get(&index) else {
                return Err(SyncError::UnexpectedEntry { index });
            };
            if x.entry.hash.is_some() {
                write_verified(&x.dest, &x.entry, &data, mode)?;
            } else {
                let hash = write_hashing(&x.dest, &x.entry, &data, mode)?;
                total.hashed.push((index, hash));
            }
            total.files += 1;
            total.bytes += data.len() as u64;
            total.indices.push(index);
            if let Some(w) = &written {
                w(index, data.len() as u64);
            }
        }
        Ok(total)
    });

    let decoded = decode_into(&mut body, &expected, &tx).await;
    drop(tx);
    let written = writer
        .await
        .map_err(|e| SyncError::Stream(format!("writer task failed: {}", e.0)))?;
    // A write error explains a decode failure (the channel closed), so it wins.
    let written = written?;
    decoded?;
    Ok(written)
}

async fn decode_into<S, E>(
    body: &mut S,
    expected: &HashMap<u32, Expected>,
    tx: &mpsc::Sender<(u32, Bytes)>,
) -> Result<(), SyncError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut buf = BytesMut::new();
    let mut seen: HashSet<u32> = HashSet::new();
    let mut current: Option<(u32, usize)> = None;
    let mut ended = false;
    loop {
        // Drain complete records from the buffer.
        loop {
            if ended {
                if !buf.is_empty() {
                    return Err(SyncError::TrailingData);
                }
                break;
            }
            match current {
                None if buf.len() >= HEADER_LEN => {
                    let mut h = [0u8; HEADER_LEN];
                    h.copy_from_slice(&buf[..HEADER_LEN]);
                    buf.advance(HEADER_LEN);
                    match frame::decode(&h) {
                        Header::End => ended = true,
                        Header::File { index, len } => {
                            let Some(x) = expected.get(&index) else {
                                return Err(SyncError::UnexpectedEntry { index });
                            };
                            if !seen.insert(index) {
                                return Err(SyncError::UnexpectedEntry { index });
                            }
                            if len != x.entry.size {
                                return Err(SyncError::SizeMismatch {
                                    path: x.entry.path.clone(),
                                    expected: x.entry.size,
                                    actual: len,
                                });
                            }
                            current = Some((index, len as usize));
                        }
                    }
                }
                Some((index, len)) if buf.len() >= len => {
                    let data = buf.split_to(len).freeze();
                    current = None;
                    if tx.send((index, data)).await.is_err() {
                        // The writer stopped on an error; it reports it.
                        return Ok(());
                    }
                }
                _ => break,
            }
        }
        match body.next().await {
            Some(Ok(chunk)) => {
                if ended && !chunk.is_empty() {
                    return Err(SyncError::TrailingData);
                }
                buf.extend_from_slice(&chunk);
            }
            Some(Err(e)) => return Err(SyncError::Stream(e.to_string())),
            None => break,
        }
    }
    if ended {
        Ok(())
    } else {
        Err(SyncError::Truncated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::{EntryKind, Hash};

    fn entry(path: &str, data: &[u8]) -> Entry {
        Entry {
            path: path.into(),
            kind: EntryKind::File,
            size: data.len() as u64,
            mode: 0o640,
            mtime: 1_600_000_000,
            mtime_nsec: 5,
            hash: Some(Hash(*blake3::hash(data).as_bytes())),
            target: None,
        }
    }

    fn setup(
        files: &[(&str, &[u8])],
    ) -> (tempfile::TempDir, Vec<SendItem>, HashMap<u32, Expected>) {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("src")).unwrap();
        std::fs::create_dir(d.path().join("dst")).unwrap();
        let mut items = Vec::new();
        let mut exp = HashMap::new();
        for (i, (name, data)) in files.iter().enumerate() {
            let p = d.path().join("src").join(name);
            std::fs::write(&p, data).unwrap();
            items.push(SendItem {
                index: i as u32,
                path: p,
                size: data.len() as u64,
                entry_path: name.to_string(),
                data: None,
                beneath: None,
            });
            exp.insert(
                i as u32,
                Expected {
                    dest: d.path().join("dst").join(name),
                    entry: entry(name, data),
                },
            );
        }
        (d, items, exp)
    }

    async fn collect(items: Vec<SendItem>) -> Vec<u8> {
        let mut s = Box::pin(send_stream(items, None));
        let mut out = Vec::new();
        while let Some(b) = s.next().await {
            out.extend_from_slice(&b.unwrap());
        }
        out
    }

    fn body(bytes: Vec<u8>, piece: usize) -> impl Stream<Item = Result<Bytes, String>> + Unpin {
        let parts: Vec<Result<Bytes, String>> = bytes
            .chunks(piece.max(1))
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures::stream::iter(parts)
    }

    #[tokio::test]
    async fn round_trip_in_odd_pieces() {
        let (d, items, exp) = setup(&[("a", b"alpha"), ("z", b""), ("b", &[9u8; 70_000])]);
        let wire = collect(items).await;
        let got = receive_stream(body(wire, 7), Arc::new(exp), WriteMode::Direct, None)
            .await
            .unwrap();
        assert_eq!(
            (got.files, got.bytes, got.indices),
            (3, 70_005, vec![0, 1, 2])
        );
        assert_eq!(std::fs::read(d.path().join("dst/a")).unwrap(), b"alpha");
        assert_eq!(std::fs::read(d.path().join("dst/z")).unwrap(), b"");
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(d.path().join("dst/a")).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o640);
        assert_eq!(md.mtime(), 1_600_000_000);
    }

    #[tokio::test]
    async fn an_entry_expected_without_a_hash_is_written_and_its_hash_returned() {
        let (d, items, mut exp) = setup(&[("a", b"alpha"), ("b", b"beta")]);
        // Sent content other than the sender will claim: the receiver is
        // told its hash, it is not refused here.
        std::fs::write(d.path().join("src/b"), b"BETA").unwrap();
        exp.get_mut(&1).unwrap().entry.hash = None;
        let wire = collect(items).await;
        let got = receive_stream(body(wire, 5), Arc::new(exp), WriteMode::Direct, None)
            .await
            .unwrap();
        assert_eq!(got.indices, [0, 1]);
        assert_eq!(got.hashed, [(1, Hash(*blake3::hash(b"BETA").as_bytes()))]);
        assert_eq!(std::fs::read(d.path().join("dst/b")).unwrap(), b"BETA");
        // Its size is still checked.
        let (_d, items, mut exp) = setup(&[("c", b"gamma")]);
        exp.get_mut(&0).unwrap().entry.hash = None;
        exp.get_mut(&0).unwrap().entry.size = 4;
        let e = receive_stream(
            body(collect(items).await, 64),
            Arc::new(exp),
            WriteMode::Direct,
            None,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, SyncError::SizeMismatch { .. }), "{e}");
    }

    #[tokio::test]
    async fn truncated_stream_is_an_error() {
        let (_d, items, exp) = setup(&[("a", b"alpha")]);
        let mut wire = collect(items).await;
        wire.truncate(wire.len() - HEADER_LEN - 1);
        let e = receive_stream(body(wire, 3), Arc::new(exp), WriteMode::Direct, None)
            .await
            .unwrap_err();
        assert!(matches!(e, SyncError::Truncated), "{e}");
    }

    #[tokio::test]
    async fn wrong_content_is_refused_and_not_written() {
        let (d, items, exp) = setup(&[("a", b"alpha")]);
        let mut wire = collect(items).await;
        wire[HEADER_LEN] ^= 0xff;
        let e = receive_stream(body(wire, 64), Arc::new(exp), WriteMode::TempRename, None)
            .await
            .unwrap_err();
        assert!(matches!(e, SyncError::HashMismatch { .. }), "{e}");
        assert_eq!(std::fs::read_dir(d.path().join("dst")).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn unexpected_duplicate_and_trailing_records_are_refused() {
        let (_d, items, exp) = setup(&[("a", b"alpha")]);
        let mut bad_index = frame::encode(5, 1).to_vec();
        bad_index.push(0);
        let e = receive_stream(
            body(bad_index, 64),
            Arc::new(exp.clone()),
            WriteMode::Direct,
            None,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, SyncError::UnexpectedEntry { index: 5 }), "{e}");

        let one = collect(items).await;
        let record = one[..one.len() - HEADER_LEN].to_vec();
        let mut twice = record.clone();
        twice.extend_from_slice(&one);
        let e = receive_stream(
            body(twice, 64),
            Arc::new(exp.clone()),
            WriteMode::Direct,
            None,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, SyncError::UnexpectedEntry { index: 0 }), "{e}");

        let mut trailing = one.clone();
        trailing.extend_from_slice(b"junk");
        let e = receive_stream(body(trailing, 64), Arc::new(exp), WriteMode::Direct, None)
            .await
            .unwrap_err();
        assert!(matches!(e, SyncError::TrailingData), "{e}");
    }

    #[tokio::test]
    async fn lying_size_is_refused() {
        let (_d, _items, exp) = setup(&[("a", b"alpha")]);
        let mut wire = frame::encode(0, 1 << 40).to_vec();
        wire.extend_from_slice(&frame::encode_end());
        let e = receive_stream(body(wire, 64), Arc::new(exp), WriteMode::Direct, None)
            .await
            .unwrap_err();
        assert!(matches!(e, SyncError::SizeMismatch { .. }), "{e}");
    }
}
