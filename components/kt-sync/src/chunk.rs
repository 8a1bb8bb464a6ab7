//! Large files move as fixed-size chunks over parallel streams. Each chunk is
//! hashed on receipt into a blake3 chaining value; once every chunk is in, the
//! values are merged into the file's root hash and compared with the manifest.
//! The whole file is thus verified without reading it back.
//!
//! This relies on blake3's tree layout: with a power-of-two chunk size that is a
//! multiple of blake3's 1 KiB chunk, our chunks are complete subtrees and the
//! left subtree of any span holds the largest power of two of them that is
//! strictly fewer than the span's count.

use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, merge_subtrees_non_root, merge_subtrees_root,
};
use bytes::{Bytes, BytesMut};
use kt_types::Hash;

use crate::error::SyncError;

/// Checks that `chunk_size` is usable for subtree hashing.
pub fn check_chunk_size(chunk_size: u64) -> Result<(), SyncError> {
    if chunk_size >= blake3::CHUNK_LEN as u64 && chunk_size.is_power_of_two() {
        Ok(())
    } else {
        Err(SyncError::BadChunkSize(chunk_size))
    }
}

/// Number of chunks a file of `size` bytes is split into (at least one).
pub fn chunk_count(size: u64, chunk_size: u64) -> u64 {
    size.div_ceil(chunk_size).max(1)
}

/// The byte range `(offset, len)` of chunk `n`.
pub fn chunk_range(size: u64, chunk_size: u64, n: u64) -> Option<(u64, u64)> {
    let offset = n.checked_mul(chunk_size)?;
    if n >= chunk_count(size, chunk_size) {
        return None;
    }
    Some((offset, (size - offset).min(chunk_size)))
}

/// The chaining value of chunk `n` (its data must be the whole chunk).
pub fn chunk_cv(data: &[u8], n: u64, chunk_size: u64) -> ChainingValue {
    let mut h = ChunkHasher::new(n, chunk_size);
    h.update(data);
    h.finish()
}

/// The chaining values of every chunk of the file at `path` (`size`
/// bytes, larger than `chunk_size`), read with positioned reads and
/// hashed on all cores; [`root_from_cvs`] of them is its blake3. One
/// read of the file, as hashing it whole is.
pub fn file_cvs(
    path: &std::path::Path,
    size: u64,
    chunk_size: u64,
) -> Result<Vec<ChainingValue>, SyncError> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(|e| SyncError::io(path, e))?;
    (0..chunk_count(size, chunk_size))
        .into_par_iter()
        .map(|n| {
            let (offset, len) = chunk_range(size, chunk_size, n).unwrap_or_default();
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, offset)
                .map_err(|e| SyncError::io(path, e))?;
            Ok(chunk_cv(&buf, n, chunk_size))
        })
        .collect()
}

/// Hashes chunk `n` incrementally, as its bytes arrive in order.
#[derive(Debug)]
pub struct ChunkHasher(blake3::Hasher);

impl ChunkHasher {
    pub fn new(n: u64, chunk_size: u64) -> Self {
        let mut h = blake3::Hasher::new();
        h.set_input_offset(n * chunk_size);
        ChunkHasher(h)
    }
    /// Single-threaded: chunks are hashed concurrently already, one per stream.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }
    pub fn finish(&self) -> ChainingValue {
        self.0.finalize_non_root()
    }
}

fn left_len(n: usize) -> usize {
    // Largest power of two strictly less than n (n >= 2).
    1usize << (usize::BITS - 1 - (n - 1).leading_zeros())
}

fn merge(cvs: &[ChainingValue]) -> ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let l = left_len(cvs.len());
    merge_subtrees_non_root(&merge(&cvs[..l]), &merge(&cvs[l..]), Mode::Hash)
}

/// The root hash of a file from the chaining values of its chunks (at least two).
pub fn root_from_cvs(cvs: &[ChainingValue]) -> Option<Hash> {
    if cvs.len() < 2 {
        return None;
    }
    let l = left_len(cvs.len());
    let root = merge_subtrees_root(&merge(&cvs[..l]), &merge(&cvs[l..]), Mode::Hash);
    Some(Hash(*root.as_bytes()))
}

/// Collects chunk values of one file as they arrive, in any order.
#[derive(Debug)]
pub struct ChunkAssembly {
    size: u64,
    chunk_size: u64,
    cvs: Vec<Option<ChainingValue>>,
    whole: Option<Hash>,
}

impl ChunkAssembly {
    pub fn new(size: u64, chunk_size: u64) -> Self {
        let n = chunk_count(size, chunk_size) as usize;
        ChunkAssembly {
            size,
            chunk_size,
            cvs: vec![None; n],
            whole: None,
        }
    }

    pub fn chunk_count(&self) -> u64 {
        self.cvs.len() as u64
    }

    pub fn range(&self, n: u64) -> Option<(u64, u64)> {
        chunk_range(self.size, self.chunk_size, n)
    }

    /// Records chunk `n` from its data.
    pub fn add(&mut self, n: u64, data: &[u8]) {
        if self.cvs.len() == 1 {
            self.whole = Some(Hash(*blake3::hash(data).as_bytes()));
            self.cvs[0] = Some([0; 32]);
        } else if let Some(slot) = self.cvs.get_mut(n as usize) {
            *slot = Some(chunk_cv(data, n, self.chunk_size));
        }
    }

    /// Records chunk `n` from its precomputed chaining value (files of two or more chunks).
    pub fn add_cv(&mut self, n: u64, cv: ChainingValue) {
        if let Some(slot) = self.cvs.get_mut(n as usize) {
            *slot = Some(cv);
        }
    }

    pub fn is_complete(&self) -> bool {
        self.cvs.iter().all(Option::is_some)
    }

    pub fn missing(&self) -> usize {
        self.cvs.iter().filter(|c| c.is_none()).count()
    }

    /// The root hash once every chunk is in.
    pub fn root(&self) -> Option<Hash> {
        if !self.is_complete() {
            return None;
        }
        if let Some(h) = self.whole {
            return Some(h);
        }
        let cvs: Vec<ChainingValue> = self.cvs.iter().flatten().copied().collect();
        root_from_cvs(&cvs)
    }
}

/// Buffers smaller than this are copied together as they come into a
/// [`Piece`]: a link that hands over a few KiB at a time (a shaped or busy
/// one) would otherwise cost a write and a hash call per few KiB; larger
/// ones are kept as they came (copying them would cost more than it saves).
pub const GATHER: usize = 64 << 10;

/// The buffers of a chunk's body received since the last piece was
/// written: large ones as they came, runs of small ones ([`GATHER`])
/// copied into one. A receiver takes the piece once it holds `size` bytes
/// and writes and hashes it buffer by buffer, so a chunk costs a write and
/// a hash call per piece however small the frames, and a large frame is
/// never copied in user space.
#[derive(Debug)]
pub struct Piece {
    bufs: Vec<Bytes>,
    /// Small buffers gathered since the last large one.
    small: BytesMut,
    len: u64,
    size: u64,
}

impl Piece {
    /// A piece taken at `size` bytes.
    pub fn new(size: u64) -> Piece {
        Piece {
            bufs: Vec::new(),
            small: BytesMut::new(),
            len: 0,
            size,
        }
    }

    /// Bytes held.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Holds a piece's worth: time to take it.
    pub fn is_full(&self) -> bool {
        self.len >= self.size
    }

    pub fn add(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        self.len += b.len() as u64;
        if b.len() < GATHER {
            if self.small.capacity() - self.small.len() < b.len() {
                self.small.reserve(self.size as usize + GATHER);
            }
            self.small.extend_from_slice(&b);
        } else {
            self.gathered();
            self.bufs.push(b);
        }
    }

    /// Ends the run of small buffers gathered so far.
    fn gathered(&mut self) {
        if !self.small.is_empty() {
            self.bufs.push(self.small.split().freeze());
        }
    }

    /// The buffers held, in order; the piece starts empty again.
    pub fn take(&mut self) -> Vec<Bytes> {
        self.gathered();
        self.len = 0;
        std::mem::take(&mut self.bufs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small buffers are gathered into one (one write, one hash call for
    /// them), large ones kept as they came, in order; empty ones skipped.
    #[test]
    fn a_piece_gathers_small_buffers_and_keeps_large_ones() {
        const SIZE: u64 = 256 << 10;
        let mut p = Piece::new(SIZE);
        p.add(Bytes::from_static(b"ab"));
        p.add(Bytes::new());
        p.add(Bytes::from_static(b"cde"));
        assert_eq!(p.len(), 5);
        assert_eq!(p.take(), vec![Bytes::from_static(b"abcde")]);
        assert!(p.is_empty());
        assert!(p.take().is_empty());

        let large = Bytes::from(vec![7u8; GATHER]);
        for _ in 0..3 {
            p.add(Bytes::from(vec![1u8; 1000]));
        }
        p.add(large.clone());
        p.add(Bytes::from_static(b"xy"));
        p.add(Bytes::from_static(b"z"));
        assert_eq!(p.len(), 3000 + GATHER as u64 + 3);
        let bufs = p.take();
        assert_eq!(
            bufs.len(),
            3,
            "{:?}",
            bufs.iter().map(Bytes::len).collect::<Vec<_>>()
        );
        assert_eq!(bufs[0], Bytes::from(vec![1u8; 3000]));
        // The large one is the buffer that came, not a copy.
        assert_eq!(bufs[1].as_ptr(), large.as_ptr());
        assert_eq!(bufs[2], Bytes::from_static(b"xyz"));
        // Many small buffers: one write for all of a piece.
        for _ in 0..(SIZE as usize / 4096) {
            assert!(!p.is_full());
            p.add(Bytes::from(vec![3u8; 4096]));
        }
        assert!(p.is_full());
        let bufs = p.take();
        assert_eq!(bufs.len(), 1);
        assert_eq!(bufs[0].len() as u64, SIZE);
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn composed_root_equals_plain_blake3() {
        for chunk_size in [1024u64, 4096, 65536] {
            for len in [
                1usize,
                1024,
                1025,
                2048,
                3 * 1024 + 7,
                5 * 4096,
                7 * 65536 + 1,
                9 * 4096 - 1,
                13 * 1024,
            ] {
                let d = data(len);
                let mut asm = ChunkAssembly::new(len as u64, chunk_size);
                // Out of order on purpose.
                for n in (0..asm.chunk_count()).rev() {
                    let (off, l) = asm.range(n).unwrap();
                    asm.add(n, &d[off as usize..(off + l) as usize]);
                }
                assert_eq!(
                    asm.root().unwrap(),
                    Hash(*blake3::hash(&d).as_bytes()),
                    "len {len} chunk {chunk_size}"
                );
            }
        }
    }

    #[test]
    fn a_file_hashed_by_chunks_has_its_blake3() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let d = data(5 * 4096 + 333);
        std::fs::write(&path, &d).unwrap();
        let cvs = file_cvs(&path, d.len() as u64, 4096).unwrap();
        assert_eq!(cvs.len(), 6);
        assert_eq!(cvs[1], chunk_cv(&d[4096..8192], 1, 4096));
        assert_eq!(
            root_from_cvs(&cvs).unwrap(),
            Hash(*blake3::hash(&d).as_bytes())
        );
        // A file shorter than it was said to be is an error, not a value.
        assert!(file_cvs(&path, d.len() as u64 + 4096, 4096).is_err());
    }

    #[test]
    fn incomplete_has_no_root_and_ranges_are_bounded() {
        let mut asm = ChunkAssembly::new(3000, 1024);
        asm.add(0, &data(1024));
        assert_eq!(asm.root(), None);
        assert_eq!(asm.missing(), 2);
        assert_eq!(asm.range(2), Some((2048, 952)));
        assert_eq!(asm.range(3), None);
        assert_eq!(chunk_count(0, 1024), 1);
        assert!(check_chunk_size(1000).is_err());
        assert!(check_chunk_size(8 << 20).is_ok());
    }

    #[test]
    fn corrupt_chunk_changes_the_root() {
        let d = data(4096);
        let mut asm = ChunkAssembly::new(4096, 1024);
        for n in 0..4 {
            let mut c = d[n * 1024..(n + 1) * 1024].to_vec();
            if n == 2 {
                c[5] ^= 1;
            }
            asm.add(n as u64, &c);
        }
        assert_ne!(asm.root().unwrap(), Hash(*blake3::hash(&d).as_bytes()));
    }
}
