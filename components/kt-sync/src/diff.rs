//! What a receiver lacks.

use std::collections::{HashMap, HashSet};

use kt_types::{Entry, EntryKind, Hash, Manifest};

/// Indices of `source` files whose content is in none of `have`'s files.
pub fn missing_content(source: &Manifest, have: &HashSet<Hash>) -> Vec<u32> {
    source
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == EntryKind::File && e.hash.is_some_and(|h| !have.contains(&h)))
        .map(|(i, _)| i as u32)
        .collect()
}

/// Every content hash a manifest holds.
pub fn content_hashes(m: &Manifest) -> HashSet<Hash> {
    m.entries.iter().filter_map(|e| e.hash).collect()
}

/// Files of `want` that differ in content from the same path in `have`
/// (or are absent there). Metadata-only differences are not content changes.
pub fn changed_files(want: &Manifest, have: &Manifest) -> Vec<u32> {
    let by_path: HashMap<&str, &Entry> =
        have.entries.iter().map(|e| (e.path.as_str(), e)).collect();
    want.entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == EntryKind::File)
        .filter(|(_, e)| {
            by_path
                .get(e.path.as_str())
                .is_none_or(|h| h.kind != EntryKind::File || h.hash != e.hash)
        })
        .map(|(i, _)| i as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, h: u8) -> Entry {
        Entry {
            path: path.into(),
            kind: EntryKind::File,
            size: 1,
            mode: 0o644,
            mtime: 0,
            mtime_nsec: 0,
            hash: Some(Hash([h; 32])),
            target: None,
        }
    }

    #[test]
    fn only_new_content_is_missing() {
        let old = Manifest {
            entries: vec![file("a", 1), file("b", 2)],
            ..Default::default()
        };
        let new = Manifest {
            entries: vec![file("a", 1), file("c", 2), file("d", 3)],
            ..Default::default()
        };
        // "c" is a rename of "b": its content is already there.
        assert_eq!(missing_content(&new, &content_hashes(&old)), vec![2]);
        assert_eq!(changed_files(&new, &old), vec![1, 2]);
    }
}
