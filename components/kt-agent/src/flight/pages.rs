//! What decoding a Parquet file may cost, read from its page headers
//! before a page is decompressed or a value decoded: a small file can
//! claim (a compressed page's `uncompressed_page_size`) or expand to (one
//! large dictionary value that every row's index points at) gigabytes.
//!
//! [`batch_rows`] walks every column chunk's page headers (Thrift compact
//! protocol, read here: the parquet crate keeps its reader private),
//! refuses a page that claims more than the cap uncompressed or
//! compressed (the reader holds a page's compressed bytes whole before it
//! decompresses them), reads each byte-array dictionary (its size checked
//! first) for its longest value, and answers how many rows a batch may
//! hold so that its worst case — every dictionary index pointing at the
//! longest value — stays within the cap. A row whose worst case alone is
//! over the cap is refused. Repeated (list) columns are counted by their
//! average values per row.
//!
//! The reader decodes a row group's columns side by side: it holds a page
//! of every column at once (and its compressed copy while it reads it),
//! and every column's dictionary. A row group whose largest pages and
//! dictionaries together are over the reader's cap is refused.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use parquet::basic::Type as PhysicalType;
use parquet::column::page::Page;
use parquet::file::metadata::page_index::RowGroupPageIndex;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData, RowGroupMetaData};
use parquet::file::properties::ReaderProperties;
use parquet::file::reader::RowGroupReader;
use parquet::file::serialized_reader::SerializedRowGroupReader;

/// Page types of the format (`PageType`).
const DICTIONARY_PAGE: i64 = 2;
/// A page header longer than this is refused (statistics included).
const MAX_HEADER: usize = 16 << 20;
/// Nesting of Thrift structures, lists and maps a header may use.
const MAX_DEPTH: usize = 32;
/// Bytes counted per decoded value besides its data (offsets, validity).
const PER_VALUE: u64 = 16;

/// Rows per batch (at most `max_rows`) whose decoded size stays within
/// `cap` bytes in the worst case, or why the file is refused: a page over
/// `cap`, or a row group whose pages held at once are over `reader_cap`.
pub fn batch_rows(
    file: &File,
    meta: &ParquetMetaData,
    cap: u64,
    reader_cap: u64,
    max_rows: usize,
) -> Result<usize, String> {
    let mut rows = max_rows.max(1);
    // Dictionaries are read with the footer already decoded (never a
    // second copy of it).
    let shared = Arc::new(file.try_clone().map_err(|e| e.to_string())?);
    for (g, group) in meta.row_groups().iter().enumerate() {
        let group_rows = u64::try_from(group.num_rows()).unwrap_or(0).max(1);
        let mut per_row: u64 = 0;
        // What the reader holds at once: a page of every column and every
        // column's dictionary, decoded; and, one column at a time, the
        // compressed page it reads (or a dictionary page it decodes).
        let mut resident: u64 = 0;
        let mut transient: u64 = 0;
        for (c, chunk) in group.columns().iter().enumerate() {
            let column = chunk.column_path().string();
            let pages = walk(file, chunk, cap)
                .map_err(|why| format!("row group {g}, column {column}: {why}"))?;
            resident = resident
                .saturating_add(pages.largest)
                .saturating_add(pages.dictionary);
            transient = transient
                .max(pages.largest_compressed)
                .max(pages.dictionary_compressed.saturating_add(pages.dictionary));
            let value = match chunk.column_descr().physical_type() {
                PhysicalType::BYTE_ARRAY if pages.dictionary > 0 => {
                    longest_value(shared.clone(), group, g, c)
                        .map_err(|why| format!("row group {g}, column {column}: {why}"))?
                }
                PhysicalType::BYTE_ARRAY => 0,
                PhysicalType::FIXED_LEN_BYTE_ARRAY => {
                    u64::try_from(chunk.column_descr().type_length()).unwrap_or(0)
                }
                _ => 0,
            };
            let values_per_row = pages.values.div_ceil(group_rows).max(1);
            let column_row = values_per_row
                .saturating_mul(value.saturating_add(PER_VALUE))
                .saturating_add(pages.data.div_ceil(group_rows));
            per_row = per_row.saturating_add(column_row);
        }
        let held = resident.saturating_add(transient);
        if held > reader_cap {
            return Err(format!(
                "row group {g}'s {} columns may hold {held} bytes of pages at once (the largest page of each and its dictionary, decoded, and one page as read), over the {reader_cap} bytes a Flight call's reader may hold; write smaller pages, or fewer columns per file",
                group.columns().len()
            ));
        }
        let fits = cap / per_row.max(1);
        if fits == 0 {
            return Err(format!(
                "a row of row group {g} may decode to {per_row} bytes, over the {cap} bytes a Flight batch may hold"
            ));
        }
        rows = rows.min(usize::try_from(fits).unwrap_or(usize::MAX));
    }
    Ok(rows)
}

/// A column chunk's pages, by their headers.
#[derive(Debug, Default, PartialEq, Eq)]
struct Pages {
    /// Uncompressed bytes of its dictionary pages.
    dictionary: u64,
    /// Compressed bytes of its dictionary pages.
    dictionary_compressed: u64,
    /// Uncompressed bytes of its data pages.
    data: u64,
    /// Its largest data page, uncompressed.
    largest: u64,
    /// Its largest data page, compressed.
    largest_compressed: u64,
    /// Values (levels) of its data pages.
    values: u64,
}

/// Reads the page headers of `chunk` (none of its pages); refuses a page
/// that claims more than `cap` bytes uncompressed or compressed.
fn walk(file: &File, chunk: &ColumnChunkMetaData, cap: u64) -> Result<Pages, String> {
    let start = chunk
        .dictionary_page_offset()
        .filter(|&d| d > 0)
        .unwrap_or(chunk.data_page_offset());
    let (Ok(start), Ok(len)) = (u64::try_from(start), u64::try_from(chunk.compressed_size()))
    else {
        return Err("a negative offset or size in the footer".into());
    };
    let end = start.saturating_add(len);
    let mut pages = Pages::default();
    let mut at = start;
    while at < end {
        let head = read_header(file, at, end)?;
        let size = |v: i64, what: &str| {
            u64::try_from(v).map_err(|_| format!("a page at byte {at} claims {v} bytes {what}"))
        };
        let uncompressed = size(head.uncompressed, "uncompressed")?;
        let compressed = size(head.compressed, "compressed")?;
        if uncompressed > cap {
            return Err(format!(
                "a page at byte {at} claims {uncompressed} bytes uncompressed, over the {cap} bytes a Flight call decodes at once"
            ));
        }
        if compressed > cap {
            return Err(format!(
                "a page at byte {at} claims {compressed} bytes compressed, over the {cap} bytes a Flight call reads at once (a page is read whole before it is decompressed)"
            ));
        }
        if head.kind == DICTIONARY_PAGE {
            pages.dictionary = pages.dictionary.saturating_add(uncompressed);
            pages.dictionary_compressed = pages.dictionary_compressed.saturating_add(compressed);
        } else {
            pages.data = pages.data.saturating_add(uncompressed);
            pages.largest = pages.largest.max(uncompressed);
            pages.largest_compressed = pages.largest_compressed.max(compressed);
            pages.values = pages
                .values
                .saturating_add(u64::try_from(head.values).unwrap_or(0));
        }
        at = at
            .saturating_add(head.len as u64)
            .saturating_add(compressed);
    }
    Ok(pages)
}

/// The longest value of column `c`'s dictionary in row group `g` (its
/// size already checked by [`walk`]).
fn longest_value(
    file: Arc<File>,
    group: &RowGroupMetaData,
    g: usize,
    c: usize,
) -> Result<u64, String> {
    let reader = SerializedRowGroupReader::new(
        file,
        group,
        RowGroupPageIndex::new(g, None),
        Arc::new(ReaderProperties::builder().build()),
    )
    .map_err(|e| e.to_string())?;
    let mut pages = reader
        .get_column_page_reader(c)
        .map_err(|e| e.to_string())?;
    let Some(Page::DictionaryPage { buf, .. }) =
        pages.get_next_page().map_err(|e| e.to_string())?
    else {
        return Ok(0);
    };
    // PLAIN byte arrays: a 4-byte length, then the bytes.
    let mut longest = 0u64;
    let mut at = 0usize;
    while let Some(len) = buf.get(at..at + 4) {
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]);
        longest = longest.max(u64::from(len));
        at = at.saturating_add(4).saturating_add(len as usize);
    }
    Ok(longest)
}

/// A page header's fields that matter here.
#[derive(Debug, Default, PartialEq, Eq)]
struct Header {
    kind: i64,
    uncompressed: i64,
    compressed: i64,
    /// Values of a data page (v1 or v2), or of a dictionary page.
    values: i64,
    /// The header's own length in bytes.
    len: usize,
}

/// The page header at `at` (before `end`): read in a growing window.
fn read_header(file: &File, at: u64, end: u64) -> Result<Header, String> {
    let mut window = 4096usize;
    loop {
        let want = window.min(usize::try_from(end - at).unwrap_or(usize::MAX));
        let mut buf = vec![0u8; want];
        let mut got = 0;
        while got < want {
            match file.read_at(&mut buf[got..], at + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) => return Err(e.to_string()),
            }
        }
        buf.truncate(got);
        match parse_header(&buf) {
            Ok(h) => return Ok(h),
            Err(Short) if got == want && want < MAX_HEADER && (want as u64) < end - at => {
                window = window.saturating_mul(4).min(MAX_HEADER);
            }
            Err(Short) => {
                return Err(format!(
                    "the page header at byte {at} is cut short or over {MAX_HEADER} bytes"
                ));
            }
            Err(Malformed(why)) => return Err(format!("the page header at byte {at}: {why}")),
        }
    }
}

/// Why a header could not be read.
#[derive(Debug, PartialEq, Eq)]
enum HeaderError {
    /// More bytes are needed.
    Short,
    Malformed(&'static str),
}
use HeaderError::{Malformed, Short};

/// Parses a `PageHeader` (Thrift compact protocol) at the start of `buf`.
fn parse_header(buf: &[u8]) -> Result<Header, HeaderError> {
    let mut r = Compact {
        buf,
        at: 0,
        depth: 0,
    };
    let mut h = Header::default();
    r.fields(&mut |r, id, ty| {
        Ok(match (id, ty) {
            (1, I32) => {
                h.kind = r.zigzag()?;
                true
            }
            (2, I32) => {
                h.uncompressed = r.zigzag()?;
                true
            }
            (3, I32) => {
                h.compressed = r.zigzag()?;
                true
            }
            // data_page_header, dictionary_page_header, data_page_header_v2:
            // num_values is field 1 of each.
            (5 | 7 | 8, STRUCT) => {
                r.fields(&mut |r, id, ty| {
                    Ok(if (id, ty) == (1, I32) {
                        h.values = r.zigzag()?;
                        true
                    } else {
                        false
                    })
                })?;
                true
            }
            _ => false,
        })
    })?;
    h.len = r.at;
    Ok(h)
}

/// Compact protocol type ids.
const I32: u8 = 5;
const STRUCT: u8 = 12;

/// A Thrift compact protocol reader that can skip any value.
struct Compact<'a> {
    buf: &'a [u8],
    at: usize,
    depth: usize,
}

type Field<'f, 'a> = dyn FnMut(&mut Compact<'a>, i16, u8) -> Result<bool, HeaderError> + 'f;

impl<'a> Compact<'a> {
    fn byte(&mut self) -> Result<u8, HeaderError> {
        let b = *self.buf.get(self.at).ok_or(Short)?;
        self.at += 1;
        Ok(b)
    }

    fn advance(&mut self, n: u64) -> Result<(), HeaderError> {
        let n = usize::try_from(n).map_err(|_| Short)?;
        let to = self.at.checked_add(n).ok_or(Short)?;
        if to > self.buf.len() {
            return Err(Short);
        }
        self.at = to;
        Ok(())
    }

    fn varint(&mut self) -> Result<u64, HeaderError> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Malformed("a varint longer than 10 bytes"))
    }

    fn zigzag(&mut self) -> Result<i64, HeaderError> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn nest(&mut self) -> Result<(), HeaderError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Malformed("nested too deeply"));
        }
        Ok(())
    }

    /// A structure's fields up to its stop: `f` reads the ones it wants
    /// (answering `true`), the others are skipped.
    fn fields(&mut self, f: &mut Field<'_, 'a>) -> Result<(), HeaderError> {
        self.nest()?;
        let mut last: i16 = 0;
        loop {
            let h = self.byte()?;
            if h == 0 {
                break;
            }
            let ty = h & 0x0f;
            let delta = h >> 4;
            let id = if delta == 0 {
                i16::try_from(self.zigzag()?).map_err(|_| Malformed("a field id out of range"))?
            } else {
                last.saturating_add(i16::from(delta))
            };
            last = id;
            if !f(self, id, ty)? {
                self.skip(ty)?;
            }
        }
        self.depth -= 1;
        Ok(())
    }

    /// Skips a value of type `ty` (a field's: booleans hold no byte).
    fn skip(&mut self, ty: u8) -> Result<(), HeaderError> {
        match ty {
            1 | 2 => Ok(()),
            _ => self.skip_element(ty),
        }
    }

    /// Skips a value of type `ty` in a list, a set or a map (booleans hold
    /// a byte there).
    fn skip_element(&mut self, ty: u8) -> Result<(), HeaderError> {
        match ty {
            1..=3 => self.advance(1),
            4..=6 => self.varint().map(drop),
            7 => self.advance(8),
            8 => {
                let n = self.varint()?;
                self.advance(n)
            }
            9 | 10 => {
                let h = self.byte()?;
                let mut n = u64::from(h >> 4);
                if n == 15 {
                    n = self.varint()?;
                }
                self.nest()?;
                // Every element takes a byte at least: a count past the
                // buffer ends as `Short`.
                for _ in 0..n {
                    self.skip_element(h & 0x0f)?;
                }
                self.depth -= 1;
                Ok(())
            }
            11 => {
                let n = self.varint()?;
                if n > 0 {
                    let kv = self.byte()?;
                    self.nest()?;
                    for _ in 0..n {
                        self.skip_element(kv >> 4)?;
                        self.skip_element(kv & 0x0f)?;
                    }
                    self.depth -= 1;
                }
                Ok(())
            }
            12 => self.fields(&mut |_, _, _| Ok(false)),
            _ => Err(Malformed("an unknown Thrift type")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compact-protocol header: type, sizes, then a nested data page
    /// header with `values` and a skipped statistics-like binary and list.
    fn header(kind: i32, uncompressed: i32, compressed: i32, values: i32) -> Vec<u8> {
        fn zz(v: i32) -> Vec<u8> {
            let mut u = ((v << 1) ^ (v >> 31)) as u32;
            let mut out = Vec::new();
            loop {
                let b = (u & 0x7f) as u8;
                u >>= 7;
                if u == 0 {
                    out.push(b);
                    return out;
                }
                out.push(b | 0x80);
            }
        }
        let mut b = vec![0x15];
        b.extend(zz(kind));
        b.push(0x15);
        b.extend(zz(uncompressed));
        b.push(0x15);
        b.extend(zz(compressed));
        // field 5 (delta 2): a struct
        b.push(0x2c);
        b.push(0x15); // num_values
        b.extend(zz(values));
        b.push(0x18); // field 2 as a binary (skipped)
        b.push(3);
        b.extend_from_slice(b"abc");
        b.push(0x19); // field 3 as a list of 2 i32 (skipped)
        b.push(0x25);
        b.extend(zz(7));
        b.extend(zz(-7));
        b.push(0x11); // field 4: bool true, no byte
        b.push(0); // end of the nested struct
        b.push(0); // end of the header
        b
    }

    #[test]
    fn headers_are_read_without_their_pages() {
        let mut b = header(0, 1 << 30, 100, 8192);
        let len = b.len();
        b.extend_from_slice(&[9; 100]);
        assert_eq!(
            parse_header(&b),
            Ok(Header {
                kind: 0,
                uncompressed: 1 << 30,
                compressed: 100,
                values: 8192,
                len,
            })
        );
        for cut in 0..len {
            assert_eq!(parse_header(&b[..cut]), Err(Short), "{cut}");
        }
        // Nested too deeply: a struct in a struct... past the limit.
        let mut deep = vec![0x1c; MAX_DEPTH + 2];
        deep.extend(vec![0; MAX_DEPTH + 3]);
        assert!(matches!(parse_header(&deep), Err(Malformed(_))));
    }
}
