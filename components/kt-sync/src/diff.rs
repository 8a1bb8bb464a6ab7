//! What a receiver lacks.

use std::collections::HashMap;

use kt_types::{Entry, EntryKind, Hash, Manifest};

/// How a new tree relates to the version a receiver already has.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AgainstBase<'b> {
    /// New files whose content the base holds: (index in the new manifest, base entry).
    pub reuse: Vec<(u32, &'b Entry)>,
    /// New files whose content must be sent.
    pub needed: Vec<u32>,
}

/// Splits the files of `new` into those whose content `base` already has (by
/// hash, whatever their path: renames are free) and those that must be sent.
pub fn against_base<'b>(new: &Manifest, base: Option<&'b Manifest>) -> AgainstBase<'b> {
    let mut have: HashMap<Hash, &'b Entry> = HashMap::new();
    for e in base.iter().flat_map(|b| &b.entries) {
        if let (EntryKind::File, Some(h)) = (e.kind, e.hash) {
            have.entry(h).or_insert(e);
        }
    }
    let mut out = AgainstBase::default();
    for (i, e) in new.entries.iter().enumerate() {
        if e.kind != EntryKind::File {
            continue;
        }
        match e.hash.and_then(|h| have.get(&h)) {
            Some(old) => out.reuse.push((i as u32, old)),
            None => out.needed.push(i as u32),
        }
    }
    out
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
        let d = against_base(&new, Some(&old));
        assert_eq!(d.needed, vec![2]);
        assert_eq!(
            d.reuse
                .iter()
                .map(|(i, e)| (*i, e.path.as_str()))
                .collect::<Vec<_>>(),
            vec![(0, "a"), (1, "b")]
        );
        assert_eq!(against_base(&new, None).needed, vec![0, 1, 2]);
        assert_eq!(changed_files(&new, &old), vec![1, 2]);
    }
}
