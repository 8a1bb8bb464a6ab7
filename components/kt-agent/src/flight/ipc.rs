//! What decoding an Arrow IPC file or stream may cost, read from its
//! message headers before any message body is read: a message states its
//! body's length, and a compressed body states, per buffer, the length it
//! decompresses to (an 8-byte prefix). arrow-ipc allocates both as stated
//! (a zstd buffer of zeros a few KiB long can claim gigabytes), so they
//! are bounded here first, as [`super::pages`] does for Parquet.
//!
//! [`check_file`] walks an IPC file's footer blocks (what its reader
//! reads: the dictionaries, then the record batches); [`check_stream`]
//! walks a stream's messages in order. A record batch may take at most
//! [`Caps::batch`] as read and as decompressed; every dictionary batch
//! together (the reader holds them for the whole file) at most
//! [`Caps::dictionaries`]; a message's metadata at most
//! [`Caps::metadata`]. What the walk cannot make sense of is
//! [`Problem::Malformed`], said before the reader allocates anything for it.

use std::fs::File;
use std::os::unix::fs::FileExt;

use arrow_ipc::{MessageHeader, RecordBatch};

/// A stream message's metadata starts with this (older writers omit it).
const CONTINUATION: [u8; 4] = [0xff; 4];
/// An IPC file's closing magic.
const MAGIC: &[u8] = b"ARROW1";
/// The prefix of a compressed buffer that was stored uncompressed.
const NOT_COMPRESSED: i64 = -1;

/// The bounds a file's messages are held to.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// A record batch's body, and what it decompresses to.
    pub batch: u64,
    /// Every dictionary batch's body and what it decompresses to, together.
    pub dictionaries: u64,
    /// A message's metadata, and an IPC file's footer.
    pub metadata: u64,
}

/// Why a file is not decoded.
#[derive(Debug)]
pub enum Problem {
    /// It would take more than a cap (`ResourceExhausted`).
    Over(String),
    /// Its headers contradict themselves or the file (`InvalidArgument`).
    Malformed(String),
    /// It could not be read.
    Io(std::io::Error),
}
use Problem::{Malformed, Over};

/// Checks an Arrow IPC file's blocks against `caps`.
pub fn check_file(file: &File, caps: Caps) -> Result<(), Problem> {
    let size = file.metadata().map_err(io)?.len();
    let tail = read(file, size.saturating_sub(10), 10)?;
    if tail.len() < 10 || &tail[4..] != MAGIC {
        return Err(Malformed("no Arrow IPC file footer at its end".into()));
    }
    let footer_len = i32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let footer_len = u64::try_from(footer_len)
        .map_err(|_| Malformed(format!("its footer claims {footer_len} bytes")))?;
    if footer_len > caps.metadata {
        return Err(Over(format!(
            "its footer claims {footer_len} bytes, over the {} bytes a Flight call decodes",
            caps.metadata
        )));
    }
    let Some(at) = size.checked_sub(10 + footer_len) else {
        return Err(Malformed(format!(
            "its footer claims {footer_len} bytes, more than the file holds"
        )));
    };
    let buf = read(file, at, footer_len)?;
    let footer =
        arrow_ipc::root_as_footer(&buf).map_err(|e| Malformed(format!("its footer: {e}")))?;
    let mut dictionaries = 0u64;
    for block in footer.dictionaries().into_iter().flatten() {
        let (meta, body) = block_lengths(block, size, caps)?;
        let at = block.offset() as u64;
        let buf = block_metadata(file, at, meta)?;
        let Some(data) = message(&buf, at)?
            .header_as_dictionary_batch()
            .and_then(|d| d.data())
        else {
            continue;
        };
        dictionaries = add_dictionary(file, data, at, at + meta, body, dictionaries, caps)?;
    }
    for block in footer.recordBatches().into_iter().flatten() {
        let (meta, body) = block_lengths(block, size, caps)?;
        let at = block.offset() as u64;
        if body > caps.batch {
            return Err(over_batch(at, body, "", caps));
        }
        let buf = block_metadata(file, at, meta)?;
        if let Some(batch) = message(&buf, at)?.header_as_record_batch() {
            check_batch(file, batch, at, at + meta, body, caps)?;
        }
    }
    Ok(())
}

/// Checks an Arrow IPC stream's messages against `caps`.
pub fn check_stream(file: &File, caps: Caps) -> Result<(), Problem> {
    let size = file.metadata().map_err(io)?.len();
    let mut at = 0u64;
    let mut dictionaries = 0u64;
    // Each message: [continuation] length, metadata, body; a length of 0
    // (or the file's end) ends the stream.
    while at < size {
        let message_at = at;
        let mut len = read(file, at, 4)?;
        at += len.len() as u64;
        if len == CONTINUATION {
            len = read(file, at, 4)?;
            at += len.len() as u64;
        }
        let Ok(len) = <[u8; 4]>::try_from(len.as_slice()) else {
            return Err(Malformed(format!(
                "the message at byte {message_at} is cut short"
            )));
        };
        let meta = i32::from_le_bytes(len);
        if meta == 0 {
            break;
        }
        let meta = u64::try_from(meta).map_err(|_| {
            Malformed(format!(
                "the message at byte {message_at} claims {meta} bytes of metadata"
            ))
        })?;
        if meta > caps.metadata {
            return Err(Over(format!(
                "the message at byte {message_at} claims {meta} bytes of metadata, over the {} bytes a Flight call decodes",
                caps.metadata
            )));
        }
        let buf = read(file, at, meta)?;
        if buf.len() as u64 != meta {
            return Err(Malformed(format!(
                "the message at byte {message_at} is cut short"
            )));
        }
        let message = message(&buf, message_at)?;
        let body_at = at + meta;
        let body = u64::try_from(message.bodyLength()).map_err(|_| {
            Malformed(format!(
                "the message at byte {message_at} claims a body of {} bytes",
                message.bodyLength()
            ))
        })?;
        if body > size - body_at.min(size) {
            return Err(Malformed(format!(
                "the message at byte {message_at} claims a body of {body} bytes, past the file's end"
            )));
        }
        match message.header_type() {
            MessageHeader::RecordBatch => {
                if body > caps.batch {
                    return Err(over_batch(message_at, body, "", caps));
                }
                if let Some(batch) = message.header_as_record_batch() {
                    check_batch(file, batch, message_at, body_at, body, caps)?;
                }
            }
            MessageHeader::DictionaryBatch => {
                if let Some(data) = message.header_as_dictionary_batch().and_then(|d| d.data()) {
                    dictionaries =
                        add_dictionary(file, data, message_at, body_at, body, dictionaries, caps)?;
                }
            }
            _ => {}
        }
        at = body_at + body;
    }
    Ok(())
}

/// A footer block's metadata and body lengths, checked against the file
/// and the metadata cap.
fn block_lengths(block: &arrow_ipc::Block, size: u64, caps: Caps) -> Result<(u64, u64), Problem> {
    let at = block.offset();
    let (Ok(offset), Ok(meta), Ok(body)) = (
        u64::try_from(at),
        u64::try_from(block.metaDataLength()),
        u64::try_from(block.bodyLength()),
    ) else {
        return Err(Malformed(format!(
            "a block at byte {at} has a negative offset or length"
        )));
    };
    if meta > caps.metadata {
        return Err(Over(format!(
            "the message at byte {offset} claims {meta} bytes of metadata, over the {} bytes a Flight call decodes",
            caps.metadata
        )));
    }
    if meta < 8 || offset.saturating_add(meta).saturating_add(body) > size {
        return Err(Malformed(format!(
            "the block at byte {offset} ({meta} + {body} bytes) does not lie within the file"
        )));
    }
    Ok((meta, body))
}

/// The metadata flatbuffer of a file block's message: `meta` bytes at
/// `at`, after the continuation marker and length (or the length alone).
fn block_metadata(file: &File, at: u64, meta: u64) -> Result<Vec<u8>, Problem> {
    let mut buf = read(file, at, meta)?;
    let skip = if buf.starts_with(&CONTINUATION) { 8 } else { 4 };
    buf.drain(..skip.min(buf.len()));
    Ok(buf)
}

/// `buf` as the message at byte `at`.
fn message(buf: &[u8], at: u64) -> Result<arrow_ipc::Message<'_>, Problem> {
    arrow_ipc::root_as_message(buf).map_err(|e| Malformed(format!("the message at byte {at}: {e}")))
}

/// The running total of dictionary bytes with the dictionary batch `data`
/// (at `at`, its body of `body` bytes at `body_at`) added.
fn add_dictionary(
    file: &File,
    data: RecordBatch<'_>,
    at: u64,
    body_at: u64,
    body: u64,
    total: u64,
    caps: Caps,
) -> Result<u64, Problem> {
    let decoded = decompressed(file, data, at, body_at, body)?;
    let total = total.saturating_add(body).saturating_add(decoded);
    if total > caps.dictionaries {
        return Err(Over(format!(
            "its dictionaries take {total} bytes or more (up to the one at byte {at}), over the {} bytes a Flight call holds for them",
            caps.dictionaries
        )));
    }
    Ok(total)
}

/// Refuses a record batch that decompresses to more than the cap.
fn check_batch(
    file: &File,
    batch: RecordBatch<'_>,
    at: u64,
    body_at: u64,
    body: u64,
    caps: Caps,
) -> Result<(), Problem> {
    let decoded = decompressed(file, batch, at, body_at, body)?;
    if decoded > caps.batch {
        return Err(over_batch(
            at,
            decoded,
            &format!(" decompressed (from {body})"),
            caps,
        ));
    }
    Ok(())
}

fn over_batch(at: u64, bytes: u64, how: &str, caps: Caps) -> Problem {
    Over(format!(
        "the record batch at byte {at} takes {bytes} bytes{how}, over the {} bytes a Flight call decodes at once; write the file in smaller batches",
        caps.batch
    ))
}

/// The bytes a (compressed) batch's buffers claim to decompress to: 0
/// when the body is not compressed (its buffers are slices of the body).
fn decompressed(
    file: &File,
    batch: RecordBatch<'_>,
    at: u64,
    body_at: u64,
    body: u64,
) -> Result<u64, Problem> {
    if batch.compression().is_none() {
        return Ok(0);
    }
    let mut total = 0u64;
    for b in batch.buffers().into_iter().flatten() {
        let (Ok(offset), Ok(len)) = (u64::try_from(b.offset()), u64::try_from(b.length())) else {
            return Err(Malformed(format!(
                "the message at byte {at} has a buffer of negative offset or length"
            )));
        };
        if len == 0 {
            continue;
        }
        if len < 8 || offset.saturating_add(len) > body {
            return Err(Malformed(format!(
                "the message at byte {at} has a compressed buffer ({len} bytes at {offset}) outside its body or without its length"
            )));
        }
        let prefix = read(file, body_at + offset, 8)?;
        let prefix = <[u8; 8]>::try_from(prefix.as_slice())
            .map_err(|_| Malformed(format!("the message at byte {at} is cut short")))?;
        match i64::from_le_bytes(prefix) {
            NOT_COMPRESSED => {}
            n => {
                let n = u64::try_from(n).map_err(|_| {
                    Malformed(format!(
                        "the message at byte {at} has a buffer claiming {n} bytes decompressed"
                    ))
                })?;
                total = total.saturating_add(n);
            }
        }
    }
    Ok(total)
}

/// Up to `len` bytes at `at` (fewer at the file's end).
fn read(file: &File, at: u64, len: u64) -> Result<Vec<u8>, Problem> {
    let len = usize::try_from(len).map_err(|_| Malformed("a length past memory".into()))?;
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

fn io(e: std::io::Error) -> Problem {
    Problem::Io(e)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, DictionaryArray, Int64Array, StringArray};
    use arrow_ipc::writer::{FileWriter, IpcWriteOptions, StreamWriter};
    use arrow_schema::{Field, Schema};

    use super::*;

    const CAPS: Caps = Caps {
        batch: 64 << 10,
        dictionaries: 64 << 10,
        metadata: 64 << 10,
    };

    fn batch(column: ArrayRef) -> arrow_array::RecordBatch {
        let field = Field::new("x", column.data_type().clone(), false);
        arrow_array::RecordBatch::try_new(Arc::new(Schema::new(vec![field])), vec![column]).unwrap()
    }

    /// `rows` zeros: 8 bytes each decoded, a few bytes compressed.
    fn zeros(rows: usize) -> arrow_array::RecordBatch {
        batch(Arc::new(Int64Array::from(vec![0i64; rows])))
    }

    /// A dictionary column of one `len`-byte value.
    fn dictionary(len: usize) -> arrow_array::RecordBatch {
        let values = StringArray::from(vec!["v".repeat(len)]);
        let keys = arrow_array::Int32Array::from(vec![0; 4]);
        let d = DictionaryArray::<arrow_array::types::Int32Type>::try_new(keys, Arc::new(values))
            .unwrap();
        batch(Arc::new(d))
    }

    /// The batches written as an IPC file and as a stream (zstd when
    /// `zstd`), each checked.
    fn check_both(batches: &[arrow_array::RecordBatch], zstd: bool) -> [Result<(), Problem>; 2] {
        let opts = IpcWriteOptions::default()
            .try_with_compression(zstd.then_some(arrow_ipc::CompressionType::ZSTD))
            .unwrap();
        let schema = batches[0].schema();
        let file = tempfile::tempfile().unwrap();
        let mut w =
            FileWriter::try_new_with_options(file.try_clone().unwrap(), &schema, opts.clone())
                .unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
        let stream = tempfile::tempfile().unwrap();
        let mut w =
            StreamWriter::try_new_with_options(stream.try_clone().unwrap(), &schema, opts).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
        [check_file(&file, CAPS), check_stream(&stream, CAPS)]
    }

    fn over(r: &Result<(), Problem>) -> &str {
        match r {
            Err(Over(why)) => why,
            other => panic!("not refused for its size: {other:?}"),
        }
    }

    #[test]
    fn batches_within_the_caps_pass_compressed_or_not() {
        for zstd in [false, true] {
            let small = [zeros(1000), zeros(1000), dictionary(100)];
            // Columns differ: one file per schema.
            for r in check_both(&small[..2], zstd) {
                r.unwrap();
            }
            for r in check_both(&small[2..], zstd) {
                r.unwrap();
            }
        }
    }

    #[test]
    fn a_compressed_batch_is_bounded_by_what_it_claims() {
        // 80 KiB of zeros: a few bytes with zstd, over the 64 KiB cap.
        let rows = 10 << 10;
        for r in check_both(&[zeros(rows)], true) {
            let why = over(&r);
            assert!(why.contains("decompressed"), "{why}");
            assert!(why.contains(&CAPS.batch.to_string()), "{why}");
        }
        // Uncompressed, the body itself is over.
        for r in check_both(&[zeros(rows)], false) {
            let why = over(&r);
            assert!(why.contains("record batch at byte"), "{why}");
        }
    }

    #[test]
    fn dictionaries_are_bounded_together() {
        // A dictionary is held for the whole file: counted as such (the
        // batches that point at it are a few bytes).
        let one = dictionary(24 << 10);
        for r in check_both(&[one], true) {
            r.unwrap();
        }
        let big = dictionary(80 << 10);
        for r in check_both(&[big], false) {
            let why = over(&r);
            assert!(why.contains("dictionaries"), "{why}");
        }
    }

    #[test]
    fn malformed_headers_are_said_so_without_reading_what_they_claim() {
        let file = tempfile::tempfile().unwrap();
        // A stream message claiming 2 GiB of metadata, then nothing.
        let mut b = CONTINUATION.to_vec();
        b.extend_from_slice(&i32::MAX.to_le_bytes());
        file.write_all_at(&b, 0).unwrap();
        assert!(matches!(check_stream(&file, CAPS), Err(Over(_))));
        // Negative metadata length.
        file.write_all_at(&(-5i32).to_le_bytes(), 4).unwrap();
        assert!(matches!(check_stream(&file, CAPS), Err(Malformed(_))));
        // Metadata that is no flatbuffer.
        file.set_len(0).unwrap();
        let mut b = CONTINUATION.to_vec();
        b.extend_from_slice(&16i32.to_le_bytes());
        b.extend_from_slice(&[0xab; 16]);
        file.write_all_at(&b, 0).unwrap();
        assert!(matches!(check_stream(&file, CAPS), Err(Malformed(_))));
        // A file without its footer magic, and one whose footer claims
        // more than the file.
        file.set_len(0).unwrap();
        file.write_all_at(b"ARROW1\0\0junk", 0).unwrap();
        assert!(matches!(check_file(&file, CAPS), Err(Malformed(_))));
        let mut b = b"ARROW1\0\0".to_vec();
        b.extend_from_slice(&1000i32.to_le_bytes());
        b.extend_from_slice(MAGIC);
        file.set_len(0).unwrap();
        file.write_all_at(&b, 0).unwrap();
        assert!(matches!(check_file(&file, CAPS), Err(Malformed(_))));
        // An empty stream is an empty stream.
        file.set_len(0).unwrap();
        check_stream(&file, CAPS).unwrap();
    }
}
