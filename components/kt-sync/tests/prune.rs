//! A mirror get's last step: what the key does not name goes, and nothing
//! outside the destination is touched.

use std::fs;
use std::os::unix::fs::symlink;

use kt_sync::{ScanCache, apply, scan};

#[test]
fn prune_leaves_exactly_the_manifests_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dest, outside) = (
        tmp.path().join("src"),
        tmp.path().join("dest"),
        tmp.path().join("outside"),
    );
    for d in [&src, &outside] {
        fs::create_dir_all(d).unwrap();
    }
    fs::create_dir_all(src.join("keep/deep")).unwrap();
    fs::write(src.join("a.txt"), "a").unwrap();
    fs::write(src.join("keep/deep/b.txt"), "b").unwrap();
    symlink("a.txt", src.join("link")).unwrap();
    let m = scan(&src, &mut ScanCache::default()).unwrap();

    // The destination as a get leaves it, plus what an older tree had.
    fs::create_dir_all(dest.join("keep/deep")).unwrap();
    fs::create_dir_all(dest.join("gone/sub")).unwrap();
    fs::write(dest.join("a.txt"), "a").unwrap();
    fs::write(dest.join("keep/deep/b.txt"), "b").unwrap();
    fs::write(dest.join("keep/deep/stale.txt"), "old").unwrap();
    fs::write(dest.join("gone/sub/x"), "x").unwrap();
    fs::write(dest.join("old.txt"), "old").unwrap();
    symlink("a.txt", dest.join("link")).unwrap();
    // A link to a directory outside, named like nothing in the key: the
    // link goes, the directory it points to stays whole.
    fs::write(outside.join("precious"), "p").unwrap();
    symlink(&outside, dest.join("escape")).unwrap();

    let removed = apply::prune(&dest, &m).unwrap();
    assert_eq!(removed, 4, "gone/, stale.txt, old.txt, escape");
    let mut left: Vec<String> = walk(&dest);
    left.sort();
    assert_eq!(
        left,
        ["a.txt", "keep", "keep/deep", "keep/deep/b.txt", "link"]
    );
    assert_eq!(fs::read_to_string(outside.join("precious")).unwrap(), "p");
    // Again: nothing more to do.
    assert_eq!(apply::prune(&dest, &m).unwrap(), 0);
}

fn walk(root: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_owned()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            if e.file_type().unwrap().is_dir() {
                todo.push(p);
            }
        }
    }
    out
}

#[test]
fn temporary_files_of_a_killed_get_go_once_idle_and_nothing_else_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    fs::create_dir_all(dest.join("sub")).unwrap();
    fs::write(dest.join("sub/f"), "f").unwrap();
    let m = scan(&dest, &mut ScanCache::default()).unwrap();
    let old = filetime::FileTime::from_unix_time(1_000_000_000, 0);
    // Left by a get killed long ago: at the top and below.
    for p in [".kt-tmp.big.1", "sub/.kt-tmp.f.2"] {
        fs::write(dest.join(p), "partial").unwrap();
        filetime::set_file_mtime(dest.join(p), old).unwrap();
    }
    // Being written now by another get: recent.
    fs::write(dest.join(".kt-tmp.big.3"), "partial").unwrap();
    // Named like one but not a regular file, or not ours at all.
    fs::create_dir(dest.join(".kt-tmp.dir")).unwrap();
    symlink("sub/f", dest.join(".kt-tmp.link")).unwrap();
    fs::write(dest.join("kt-tmp.user"), "u").unwrap();
    filetime::set_file_mtime(dest.join("kt-tmp.user"), old).unwrap();

    let idle = std::time::Duration::from_secs(300);
    assert_eq!(apply::remove_abandoned_temps(&dest, &m, idle), 2);
    let mut left = walk(&dest);
    left.sort();
    assert_eq!(
        left,
        [
            ".kt-tmp.big.3",
            ".kt-tmp.dir",
            ".kt-tmp.link",
            "kt-tmp.user",
            "sub",
            "sub/f"
        ]
    );
}
