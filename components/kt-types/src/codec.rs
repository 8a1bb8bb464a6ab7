//! A compact binary encoding of manifests, and of "a JSON header plus a
//! manifest" documents (put requests, version files).
//!
//! Manifests of large trees are megabytes of JSON; this encoding is a third of
//! the size and an order of magnitude cheaper to write and read, and it is what
//! manifest digests are computed over. All integers are little-endian.
//!
//! ```text
//! manifest := "KTM1" root:u8 count:u32 entry*
//! entry    := path:str kind:u8 size:u64 mode:u32 mtime:i64 nsec:u32
//!             has_hash:u8 [hash:32] has_target:u8 [target:str]
//! str      := len:u32 utf8-bytes
//! document := header_len:u32 header:JSON manifest
//! ```

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::manifest::{Entry, EntryKind, Hash, Manifest, RootKind};

const MAGIC: &[u8; 4] = b"KTM1";

/// Why bytes are not an encoded manifest or document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The bytes do not start with `KTM1`.
    #[error("not a kt manifest (bad magic)")]
    Magic,
    /// The input ends inside a field, or announces more entries (or a longer
    /// header) than it can hold.
    #[error("manifest ends early (truncated)")]
    Truncated,
    /// Bytes follow the last entry; the count is how many.
    #[error("manifest has {0} bytes after its last entry")]
    Trailing(usize),
    /// An entry (or the root kind, reported as entry #0) holds a value the
    /// format does not have.
    #[error("manifest entry #{index}: {what}")]
    Bad {
        /// Zero-based index of the entry.
        index: usize,
        /// What is wrong: an unknown root or entry kind, a name that is not
        /// UTF-8.
        what: &'static str,
    },
    /// A document's JSON header does not parse as the expected type; holds
    /// the parser's message.
    #[error("document header: {0}")]
    Header(String),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Encodes a manifest.
pub fn encode(m: &Manifest, out: &mut Vec<u8>) {
    out.reserve(16 + m.entries.len() * 80);
    out.extend_from_slice(MAGIC);
    out.push(match m.root {
        RootKind::Dir => 0,
        RootKind::File => 1,
    });
    out.extend_from_slice(&(m.entries.len() as u32).to_le_bytes());
    for e in &m.entries {
        put_str(out, &e.path);
        out.push(match e.kind {
            EntryKind::File => 0,
            EntryKind::Dir => 1,
            EntryKind::Symlink => 2,
        });
        out.extend_from_slice(&e.size.to_le_bytes());
        out.extend_from_slice(&e.mode.to_le_bytes());
        out.extend_from_slice(&e.mtime.to_le_bytes());
        out.extend_from_slice(&e.mtime_nsec.to_le_bytes());
        match &e.hash {
            Some(h) => {
                out.push(1);
                out.extend_from_slice(&h.0);
            }
            None => out.push(0),
        }
        match &e.target {
            Some(t) => {
                out.push(1);
                put_str(out, t);
            }
            None => out.push(0),
        }
    }
}

/// Encodes a manifest into a new buffer: the bytes a manifest's digest is
/// the blake3 hash of.
pub fn to_bytes(m: &Manifest) -> Vec<u8> {
    let mut out = Vec::new();
    encode(m, &mut out);
    out
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.pos.checked_add(n).ok_or(CodecError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(CodecError::Truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        self.array().map(u32::from_le_bytes)
    }
    fn string(&mut self, index: usize) -> Result<String, CodecError> {
        let len = self.u32()? as usize;
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| CodecError::Bad {
                index,
                what: "a name is not UTF-8",
            })
    }
}

/// Decodes a manifest that fills `buf` exactly. (Structure only: callers still
/// [`Manifest::validate`] it.)
pub fn decode(buf: &[u8]) -> Result<Manifest, CodecError> {
    let mut r = Reader { buf, pos: 0 };
    if r.take(4).map_err(|_| CodecError::Magic)? != MAGIC {
        return Err(CodecError::Magic);
    }
    let root = match r.u8()? {
        0 => RootKind::Dir,
        1 => RootKind::File,
        _ => {
            return Err(CodecError::Bad {
                index: 0,
                what: "unknown root kind",
            });
        }
    };
    let count = r.u32()? as usize;
    // Every entry takes at least 31 bytes: a lying count cannot make us allocate.
    if count > buf.len() / 31 + 1 {
        return Err(CodecError::Truncated);
    }
    let mut entries = Vec::with_capacity(count);
    for index in 0..count {
        let path = r.string(index)?;
        let kind = match r.u8()? {
            0 => EntryKind::File,
            1 => EntryKind::Dir,
            2 => EntryKind::Symlink,
            _ => {
                return Err(CodecError::Bad {
                    index,
                    what: "unknown entry kind",
                });
            }
        };
        let size = u64::from_le_bytes(r.array()?);
        let mode = r.u32()?;
        let mtime = i64::from_le_bytes(r.array()?);
        let mtime_nsec = r.u32()?;
        let hash = match r.u8()? {
            0 => None,
            _ => Some(Hash(r.array()?)),
        };
        let target = match r.u8()? {
            0 => None,
            _ => Some(r.string(index)?),
        };
        entries.push(Entry {
            path,
            kind,
            size,
            mode,
            mtime,
            mtime_nsec,
            hash,
            target,
        });
    }
    if r.pos != buf.len() {
        return Err(CodecError::Trailing(buf.len() - r.pos));
    }
    Ok(Manifest { root, entries })
}

/// Media type of documents on the wire.
pub const DOCUMENT_CONTENT_TYPE: &str = "application/vnd.kt.document";

/// Encodes a JSON header followed by a manifest.
pub fn encode_document<H: Serialize>(header: &H, m: &Manifest) -> Vec<u8> {
    document_with(header, &to_bytes(m))
}

/// A document from a header and an already encoded manifest (empty: none).
pub fn document_with<H: Serialize>(header: &H, encoded_manifest: &[u8]) -> Vec<u8> {
    // Serialising plain data structs into memory cannot fail.
    let json = serde_json::to_vec(header).unwrap_or_default();
    let mut out = Vec::with_capacity(4 + json.len() + encoded_manifest.len());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(encoded_manifest);
    out
}

/// Splits a document into its header and the encoded manifest bytes.
pub fn split_document<H: DeserializeOwned>(buf: &[u8]) -> Result<(H, &[u8]), CodecError> {
    let mut r = Reader { buf, pos: 0 };
    let len = r.u32()? as usize;
    let json = r.take(len)?;
    let header = serde_json::from_slice(json).map_err(|e| CodecError::Header(e.to_string()))?;
    Ok((header, &buf[r.pos..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            root: RootKind::Dir,
            entries: vec![
                Entry {
                    path: "d".into(),
                    kind: EntryKind::Dir,
                    size: 0,
                    mode: 0o755,
                    mtime: -5,
                    mtime_nsec: 7,
                    hash: None,
                    target: None,
                },
                Entry {
                    path: "d/ünï".into(),
                    kind: EntryKind::File,
                    size: 1 << 40,
                    mode: 0o4755,
                    mtime: 1_700_000_000,
                    mtime_nsec: 999_999_999,
                    hash: Some(Hash([3; 32])),
                    target: None,
                },
                Entry {
                    path: "l".into(),
                    kind: EntryKind::Symlink,
                    size: 0,
                    mode: 0o777,
                    mtime: 0,
                    mtime_nsec: 0,
                    hash: None,
                    target: Some("d/ünï".into()),
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(decode(&to_bytes(&m)).unwrap(), m);
        let empty = Manifest::default();
        assert_eq!(decode(&to_bytes(&empty)).unwrap(), empty);
        let doc = encode_document(&serde_json::json!({"k": 1}), &m);
        let (h, rest): (serde_json::Value, _) = split_document(&doc).unwrap();
        assert_eq!(h["k"], 1);
        assert_eq!(decode(rest).unwrap(), m);
    }

    #[test]
    fn rejects_damage() {
        let bytes = to_bytes(&sample());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "a cut at {cut} decoded");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(decode(&extra), Err(CodecError::Trailing(1)));
        assert_eq!(decode(b"JSON{}"), Err(CodecError::Magic));
        // A count far beyond the input is refused before any allocation.
        let mut lie = b"KTM1\0".to_vec();
        lie.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&lie), Err(CodecError::Truncated));
        let mut bad_kind = bytes.clone();
        bad_kind[4] = 9;
        assert!(matches!(decode(&bad_kind), Err(CodecError::Bad { .. })));
    }
}
