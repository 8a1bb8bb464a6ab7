//! Opening a file of a served tree without leaving it.
//!
//! A source checks an exported tree's files before it serves them, but
//! whoever owns the files can swap a directory on the way for a symlink
//! between that check and the open, or put a FIFO or a device where a file
//! was. [`open_file_beneath`] closes both: the path is resolved below the
//! tree's root with no symlink anywhere (`openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS`; where the kernel or a seccomp profile refuses
//! `openat2`, one `openat(O_NOFOLLOW)` per component), and the file is
//! opened non-blocking and checked with `fstat` to be a regular file, so a
//! FIFO with no writer fails at once instead of holding a thread.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Opens `rel` below the directory `root` for reading: `rel` is relative
/// and plain (no `..`, no root), no component on the way nor the file is a
/// symlink, and the file is a regular file.
pub fn open_file_beneath(root: &Path, rel: &Path) -> io::Result<File> {
    let plain = rel.components().all(|c| matches!(c, Component::Normal(_)));
    if !plain || rel.as_os_str().is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{rel:?} is not a plain relative path"),
        ));
    }
    let dir = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let file = match rustix::fs::openat2(
        &dir,
        rel,
        file_flags(),
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        // No openat2 here (Linux before 5.6, or a seccomp profile that
        // does not know it).
        Err(Errno::NOSYS) | Err(Errno::PERM) => walk(dir, rel)?,
        r => r?,
    };
    regular(file)
}

fn file_flags() -> OFlags {
    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC
}

/// `rel` opened one component at a time from `dir`, never following a
/// symlink.
fn walk(mut dir: OwnedFd, rel: &Path) -> io::Result<OwnedFd> {
    let mut parts = rel.components().peekable();
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            return Ok(rustix::fs::openat(
                &dir,
                part.as_os_str(),
                file_flags(),
                Mode::empty(),
            )?);
        }
        dir = rustix::fs::openat(
            &dir,
            part.as_os_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    Err(io::Error::new(io::ErrorKind::InvalidInput, "an empty path"))
}

/// `fd` as a blocking `File` if it is a regular file.
fn regular(fd: OwnedFd) -> io::Result<File> {
    let kind = FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode);
    if kind != FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a regular file ({kind:?})"),
        ));
    }
    let flags = rustix::fs::fcntl_getfl(&fd)?;
    rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)?;
    Ok(File::from(fd))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::fs::symlink;

    use super::*;

    fn tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::write(d.path().join("a/b/f.txt"), b"inside").unwrap();
        d
    }

    fn read(root: &Path, rel: &str) -> io::Result<String> {
        let mut s = String::new();
        open_file_beneath(root, Path::new(rel))?.read_to_string(&mut s)?;
        Ok(s)
    }

    #[test]
    fn a_file_of_the_tree_opens() {
        let d = tree();
        assert_eq!(read(d.path(), "a/b/f.txt").unwrap(), "inside");
        let mut s = String::new();
        walk(
            rustix::fs::open(d.path(), OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap(),
            Path::new("a/b/f.txt"),
        )
        .map(File::from)
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
        assert_eq!(s, "inside");
    }

    #[test]
    fn no_symlink_is_followed_on_the_way_or_at_the_end() {
        let d = tree();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("f.txt"), b"secret").unwrap();
        // A directory swapped for a link to elsewhere, and a file that is a link.
        std::fs::rename(d.path().join("a/b"), d.path().join("a/b.real")).unwrap();
        symlink(outside.path(), d.path().join("a/b")).unwrap();
        symlink(outside.path().join("f.txt"), d.path().join("a/link.txt")).unwrap();
        // An inner link that stays inside is refused too (no link at all).
        symlink("b.real", d.path().join("a/inner")).unwrap();
        for rel in ["a/b/f.txt", "a/link.txt", "a/inner/f.txt"] {
            assert!(read(d.path(), rel).is_err(), "{rel} was followed");
            let root =
                rustix::fs::open(d.path(), OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
                    .unwrap();
            assert!(walk(root, Path::new(rel)).is_err(), "{rel} was walked");
        }
        assert_eq!(read(d.path(), "a/b.real/f.txt").unwrap(), "inside");
    }

    #[test]
    fn only_plain_relative_paths_are_taken() {
        let d = tree();
        for rel in ["", "/etc/passwd", "../x", "a/../a/b/f.txt", "./a/b/f.txt"] {
            let e = read(d.path(), rel).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{rel}: {e}");
        }
    }

    #[test]
    fn a_fifo_or_a_directory_fails_at_once() {
        let d = tree();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            d.path().join("a/pipe"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        // Opened without O_NONBLOCK, a FIFO with no writer would block here.
        let e = read(d.path(), "a/pipe").unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(read(d.path(), "a/b").is_err());
    }
}
