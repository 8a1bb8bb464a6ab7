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

#[cfg(test)]
mod tests {
    use super::*;

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
