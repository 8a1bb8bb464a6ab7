//! How many bytes a directory holds on disk, as a soak or a bench samples
//! it (a staging area's peak, a data set's size).

use std::path::Path;

/// Bytes of the regular files below `dir`, now: subdirectories are
/// walked, symlinks are not followed (nor counted), and what cannot be
/// read (a file removed meanwhile, a missing `dir`) counts as 0.
pub fn disk_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => disk_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_regular_files_below_not_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
        std::fs::write(dir.path().join("top"), [0u8; 10]).unwrap();
        std::fs::write(dir.path().join("a/b/deep"), [0u8; 32]).unwrap();
        std::os::unix::fs::symlink("a/b/deep", dir.path().join("link")).unwrap();
        assert_eq!(disk_bytes(dir.path()), 42);
        assert_eq!(disk_bytes(&dir.path().join("missing")), 0);
    }
}
