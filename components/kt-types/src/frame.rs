//! Framing of the batch stream: many files in one HTTP body.
//!
//! The body is a sequence of records `[index: u32 LE][len: u64 LE][len bytes]`
//! where `index` refers to the manifest entry, closed by an end record
//! `[u32::MAX][0]`. A body that ends before the end record is truncated.

/// Bytes of a record header: a `u32` index and a `u64` length.
pub const HEADER_LEN: usize = 12;
/// The index of the end record; no manifest entry has it.
pub const END_INDEX: u32 = u32::MAX;

/// A decoded record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// `len` bytes of content of manifest entry `index` follow.
    File {
        /// Index of the file in the manifest's entries.
        index: u32,
        /// Bytes of content that follow the header; receivers require the
        /// entry's size.
        len: u64,
    },
    /// The end record: the stream is complete.
    End,
}

/// The header of a record carrying `len` bytes of manifest entry `index`.
pub fn encode(index: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..4].copy_from_slice(&index.to_le_bytes());
    out[4..].copy_from_slice(&len.to_le_bytes());
    out
}

/// The end record's header (`[u32::MAX][0]`).
pub fn encode_end() -> [u8; HEADER_LEN] {
    encode(END_INDEX, 0)
}

/// Reads a record header; an index of [`END_INDEX`] is the end record,
/// whatever its length field holds.
pub fn decode(buf: &[u8; HEADER_LEN]) -> Header {
    let index = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    let mut len = [0u8; 8];
    len.copy_from_slice(&buf[4..]);
    let len = u64::from_le_bytes(len);
    if index == END_INDEX {
        Header::End
    } else {
        Header::File { index, len }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        assert_eq!(
            decode(&encode(7, 1 << 40)),
            Header::File {
                index: 7,
                len: 1 << 40
            }
        );
        assert_eq!(decode(&encode_end()), Header::End);
    }
}
