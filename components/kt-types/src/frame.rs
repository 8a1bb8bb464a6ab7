//! Framing of the batch stream: many files in one HTTP body.
//!
//! The body is a sequence of records `[index: u32 LE][len: u64 LE][len bytes]`
//! where `index` refers to the manifest entry, closed by an end record
//! `[u32::MAX][0]`. A body that ends before the end record is truncated.

pub const HEADER_LEN: usize = 12;
pub const END_INDEX: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    File { index: u32, len: u64 },
    End,
}

pub fn encode(index: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..4].copy_from_slice(&index.to_le_bytes());
    out[4..].copy_from_slice(&len.to_le_bytes());
    out
}

pub fn encode_end() -> [u8; HEADER_LEN] {
    encode(END_INDEX, 0)
}

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
