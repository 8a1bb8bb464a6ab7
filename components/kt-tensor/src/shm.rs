//! Shared-memory files: the host backend's memory handles.
//!
//! An application creates a file in the shared-memory directory
//! ([`shm_dir`]: `KT_SHM_DIR`, default `/dev/shm`), sizes it, maps it and
//! lends `(path, offset, len)` to its agent, which maps the same file. Both
//! containers of a pod must see the same directory (the `agent-sidecar`
//! component mounts one memory-backed emptyDir there in both).
//!
//! The agent maps only regular files inside its shared-memory directory,
//! never through a symlink, and only ranges inside the file.
//!
//! The application and its agent may run as different users (a workload as
//! 10001, the agent as 65532) sharing a group: the agent's control socket's
//! (`KT_AGENT_SOCKET_GROUP`, the pod's fsGroup). A client learns the
//! agent's directory and that group when it connects ([`use_agent`]); the
//! files it then creates are given to the group, mode 0660 (the agent maps
//! them read-write), and otherwise stay its user's alone (0600). Other
//! users never get access.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use kt_types::tensor::Device;
use memmap2::{MmapMut, MmapOptions};

use crate::transport::{Region, TransportError};

/// `KT_SHM_DIR`, else `/dev/shm`.
pub fn shm_dir() -> PathBuf {
    std::env::var_os(kt_types::env::SHM_DIR)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// How this process shares the memory it lends with its agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharing {
    /// The agent's shared-memory directory (named in its hello).
    pub dir: PathBuf,
    /// The group new files are given (mode 0660); `None`: the user alone (0600).
    pub group: Option<u32>,
}

static AGENT: std::sync::RwLock<Option<Sharing>> = std::sync::RwLock::new(None);

/// Records how this process's agent takes lent memory (set by the client
/// when it connects to the agent): [`lend_dir`] and [`ShmFile::create`]
/// follow it from then on.
pub fn use_agent(sharing: Sharing) {
    if let Ok(mut a) = AGENT.write() {
        *a = Some(sharing);
    }
}

fn agent_sharing() -> Option<Sharing> {
    AGENT.read().ok().and_then(|a| a.clone())
}

/// Where this process creates the host tensors it lends: the directory
/// its agent named, else [`shm_dir`].
pub fn lend_dir() -> PathBuf {
    agent_sharing().map_or_else(shm_dir, |s| s.dir)
}

/// The group to share memory with an agent whose control socket has
/// `mode` and group `gid`: that group when the socket is open to it (read
/// and write: its members are the agent's clients), else none.
pub fn socket_group(mode: u32, gid: u32) -> Option<u32> {
    (mode & 0o060 == 0o060).then_some(gid)
}

/// The mode of a new shared-memory file given to `group` (or to none).
pub fn file_mode(group: Option<u32>) -> u32 {
    if group.is_some() { 0o660 } else { 0o600 }
}

/// Gives `file` (created 0600) to `group`, mode 0660; on a failure (this
/// user not in the group) it stays 0600, which an agent of the same user
/// still maps.
fn share(file: &File, path: &Path, group: Option<u32>) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let Some(gid) = group else { return };
    // A setgid directory (an fsGroup volume) already gave it the group.
    let has = file.metadata().map(|m| m.gid() == gid).unwrap_or(false);
    if !has && let Err(e) = std::os::unix::fs::fchown(file, None, Some(gid)) {
        tracing::warn!(path = %path.display(), gid, error = %e, "shared memory stays this user's alone (0600): an agent of another uid cannot map it");
        return;
    }
    if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(file_mode(group))) {
        tracing::warn!(path = %path.display(), error = %e, "shared memory stays 0600");
    }
}

/// A mapped range of a shared-memory file.
pub struct ShmRegion {
    /// `None` for an empty range (nothing to map).
    map: Option<MmapMut>,
    /// Where the range starts inside `map` (mappings start on a page).
    start: usize,
    len: usize,
    /// The file and where the range starts in it: copies go through the
    /// file (`pread`/`pwrite`), never through the mapping, so a file its
    /// owner shrinks under a copy fails that copy instead of raising
    /// SIGBUS in the agent.
    file: File,
    offset: u64,
    path: PathBuf,
}

impl std::fmt::Debug for ShmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRegion")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish()
    }
}

/// Opens `rel` below the directory `dir` one component at a time, never
/// following a symlink (`O_NOFOLLOW` on every component, directories
/// opened with `O_DIRECTORY`): a link anywhere on the way fails the open.
fn open_beneath(dir: &Path, rel: &Path) -> std::io::Result<File> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::ffi::OsStrExt;

    let mut at = File::open(dir)?;
    let parts: Vec<_> = rel.components().collect();
    for (i, c) in parts.iter().enumerate() {
        let name = CString::new(c.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let last = i + 1 == parts.len();
        let flags = libc::O_NOFOLLOW
            | libc::O_CLOEXEC
            | libc::O_NOCTTY
            | if last {
                libc::O_RDWR
            } else {
                libc::O_RDONLY | libc::O_DIRECTORY
            };
        // SAFETY: `at` is an open directory descriptor and `name` a
        // NUL-terminated string, both alive for the call.
        let fd = unsafe { libc::openat(at.as_raw_fd(), name.as_ptr(), flags) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened here and is owned by nothing else.
        at = unsafe { File::from_raw_fd(fd) };
    }
    Ok(at)
}

impl ShmRegion {
    /// Maps `[offset, offset + len)` of `path`, which must be a regular file
    /// inside `dir`, reached without a symlink anywhere below `dir`.
    pub fn open(dir: &Path, path: &str, offset: u64, len: u64) -> Result<Self, TransportError> {
        let p = Path::new(path);
        if !p.is_absolute() {
            return Err(TransportError::Invalid(format!(
                "shared-memory path {path:?} must be absolute"
            )));
        }
        let dir = dir.canonicalize().map_err(|e| {
            TransportError::io(format!("shared-memory directory {}", dir.display()), e)
        })?;
        let rel = p.strip_prefix(&dir).map_err(|_| {
            TransportError::Invalid(format!(
                "shared-memory file {path:?} is not inside this agent's shared-memory directory {} (KT_SHM_DIR)",
                dir.display()
            ))
        })?;
        if rel.as_os_str().is_empty()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(TransportError::Invalid(format!(
                "shared-memory path {path:?} must name a file below the directory, without . or .."
            )));
        }
        let file = open_beneath(&dir, rel).map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::PermissionDenied {
                " (symlinks are not followed; the agent must be able to read and write it: \
                 create it as kt does, given to the agent's socket group, mode 0660)"
            } else {
                " (symlinks are not followed)"
            };
            TransportError::io(format!("opening shared memory {path:?}{why}"), e)
        })?;
        let md = file
            .metadata()
            .map_err(|e| TransportError::io(format!("shared memory {path:?}"), e))?;
        if !md.is_file() {
            return Err(TransportError::Invalid(format!(
                "shared memory {path:?} is not a regular file"
            )));
        }
        if offset.checked_add(len).is_none_or(|end| end > md.len()) {
            return Err(TransportError::Invalid(format!(
                "shared memory {path:?} has {} bytes; bytes {offset}..{offset}+{len} are outside it",
                md.len()
            )));
        }
        Self::map(file, p, offset, len, true)
    }

    /// `populate`: fault every page in at once (`MAP_POPULATE`), far cheaper
    /// than one fault per page as a transfer first touches them.
    fn map(
        file: File,
        path: &Path,
        offset: u64,
        len: u64,
        populate: bool,
    ) -> Result<Self, TransportError> {
        let page = page_size();
        let aligned = offset - offset % page;
        let start = (offset - aligned) as usize;
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is shared with the application that lent it;
            // it may write to it concurrently, which can only change the
            // bytes we read (never memory safety: we hand out byte slices,
            // no typed data). The range lies inside the file (checked by
            // the caller). Should the owner shrink the file while it is
            // registered, transfers touch the mapping only through
            // syscalls (socket reads and writes, `pread`/`pwrite` in
            // copies), which then fail with EFAULT rather than SIGBUS.
            let mut options = MmapOptions::new();
            options.offset(aligned).len(start + len as usize);
            if populate {
                options.populate();
            }
            Some(unsafe { options.map_mut(&file) }.map_err(|e| {
                TransportError::io(format!("mapping shared memory {}", path.display()), e)
            })?)
        };
        Ok(ShmRegion {
            map,
            start,
            len: len as usize,
            file,
            offset,
            path: path.to_owned(),
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.map {
            Some(m) => &m[self.start..self.start + self.len],
            None => &[],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.map {
            Some(m) => &mut m[self.start..self.start + self.len],
            None => &mut [],
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Region for ShmRegion {
    fn len(&self) -> u64 {
        self.len as u64
    }
    fn shm_file(&self) -> Option<(&File, u64)> {
        Some((&self.file, self.offset))
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn host(&self) -> Option<&[u8]> {
        Some(self.as_slice())
    }
    fn host_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.as_mut_slice())
    }
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

/// A host staging buffer (pack buckets).
#[derive(Debug)]
pub struct HostBuf(pub Vec<u8>);

impl Region for HostBuf {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn host(&self) -> Option<&[u8]> {
        Some(&self.0)
    }
    fn host_mut(&mut self) -> Option<&mut [u8]> {
        Some(&mut self.0)
    }
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as u64 } else { 4096 }
}

/// Sizes `file` to `len` bytes with every page allocated (not a sparse
/// file whose pages the first writer, maybe the agent, would allocate).
fn allocate(file: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `file` is an open descriptor for the duration of the call.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Shared memory an application owns: a new file in the shared-memory
/// directory, mapped; removed when dropped. Its [`ShmFile::handle`] is what
/// the application lends its agent.
pub struct ShmFile {
    region: ShmRegion,
}

impl std::fmt::Debug for ShmFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.region.fmt(f)
    }
}

impl ShmFile {
    /// A zero-filled file of `len` bytes, its pages allocated here
    /// (`posix_fallocate`), so they count against the application's memory
    /// and not its agent's, which only maps them. Shared with the group of
    /// this process's agent ([`use_agent`]), else this user's alone.
    pub fn create(dir: &Path, len: u64) -> Result<Self, TransportError> {
        Self::create_shared(dir, len, agent_sharing().and_then(|s| s.group))
    }

    /// [`ShmFile::create`], given to `group` (mode 0660) or to this user
    /// alone (0600).
    pub fn create_shared(dir: &Path, len: u64, group: Option<u32>) -> Result<Self, TransportError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = dir.canonicalize().map_err(|e| {
            TransportError::io(format!("shared-memory directory {}", dir.display()), e)
        })?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(
            "kt-{}-{}-{nanos:x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| {
                TransportError::io(format!("creating shared memory {}", path.display()), e)
            })?;
        share(&file, &path, group);
        let sized = allocate(&file, len)
            .map_err(|e| TransportError::io(format!("sizing shared memory {}", path.display()), e));
        let region = sized.and_then(|()| ShmRegion::map(file, &path, 0, len, false));
        match region {
            Ok(region) => Ok(ShmFile { region }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        self.region.path()
    }

    pub fn len(&self) -> u64 {
        self.region.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        self.region.as_slice()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.region.as_mut_slice()
    }

    /// The handle of bytes `[offset, offset + len)` of this file.
    pub fn handle(&self, offset: u64, len: u64) -> kt_types::tensor::MemHandle {
        kt_types::tensor::MemHandle::Shm {
            path: self.path().to_string_lossy().into_owned(),
            offset,
            len,
        }
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.region.path());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_shared_with_the_agents_group_only() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // A socket open to its group names that group; a private one none.
        assert_eq!(socket_group(0o140660, 2000), Some(2000));
        assert_eq!(socket_group(0o140600, 2000), None);
        assert_eq!(socket_group(0o140640, 2000), None);
        assert_eq!(file_mode(Some(2000)), 0o660);
        assert_eq!(file_mode(None), 0o600);
        let dir = tempfile::tempdir().unwrap();
        let mine = std::fs::metadata(dir.path()).unwrap().gid();
        let private = ShmFile::create_shared(dir.path(), 10, None).unwrap();
        let md = std::fs::metadata(private.path()).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        let shared = ShmFile::create_shared(dir.path(), 10, Some(mine)).unwrap();
        let md = std::fs::metadata(shared.path()).unwrap();
        assert_eq!(
            md.permissions().mode() & 0o777,
            0o660,
            "never open to others"
        );
        assert_eq!(md.gid(), mine);
    }

    /// As root: an agent of another uid, in the group, maps what an
    /// application shared with the group, and not what it kept private.
    #[test]
    fn another_uid_in_the_group_maps_shared_memory() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: switching to another uid needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let (agent_uid, group) = (65532, 4242);
        let shared = ShmFile::create_shared(dir.path(), 10, Some(group)).unwrap();
        let private = ShmFile::create_shared(dir.path(), 10, None).unwrap();
        let opens = |f: &ShmFile| {
            // What the agent does: open it read-write.
            std::process::Command::new("sh")
                .arg("-c")
                .arg(r#"exec 3<>"$0""#)
                .arg(f.path())
                .uid(agent_uid)
                .gid(group)
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap()
                .success()
        };
        assert!(opens(&shared), "the agent's group maps shared memory");
        assert!(!opens(&private), "private memory stays private");
    }

    #[test]
    fn an_agent_sees_what_the_application_writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = ShmFile::create(dir.path(), 10_000).unwrap();
        f.as_mut_slice()[5000..5004].copy_from_slice(b"kt!!");
        let path = f.path().to_string_lossy().into_owned();
        // An unaligned range: the mapping starts on a page boundary.
        let mut r = ShmRegion::open(dir.path(), &path, 5000, 4).unwrap();
        assert_eq!(r.as_slice(), b"kt!!");
        r.as_mut_slice().copy_from_slice(b"back");
        assert_eq!(&f.as_slice()[5000..5004], b"back");
        drop(f);
        assert!(!Path::new(&path).exists());
    }

    #[test]
    fn handles_outside_the_directory_or_the_file_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let f = ShmFile::create(other.path(), 100).unwrap();
        let path = f.path().to_string_lossy().into_owned();
        let e = ShmRegion::open(dir.path(), &path, 0, 10).unwrap_err();
        assert!(e.to_string().contains("not inside"), "{e}");
        let g = ShmFile::create(dir.path(), 100).unwrap();
        let gp = g.path().to_string_lossy().into_owned();
        let e = ShmRegion::open(dir.path(), &gp, 90, 20).unwrap_err();
        assert!(e.to_string().contains("outside it"), "{e}");
        let e = ShmRegion::open(dir.path(), "relative", 0, 1).unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
        let dotted = format!("{}/../x", dir.path().canonicalize().unwrap().display());
        assert!(ShmRegion::open(dir.path(), &dotted, 0, 1).is_err());
        let link = dir.path().canonicalize().unwrap().join("link");
        std::os::unix::fs::symlink(&gp, &link).unwrap();
        let e = ShmRegion::open(dir.path(), &link.to_string_lossy(), 0, 1).unwrap_err();
        assert!(e.to_string().contains("opening"), "{e}");
    }

    #[test]
    fn no_symlink_on_the_way_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        // A real subdirectory is fine.
        std::fs::create_dir(root.join("app")).unwrap();
        let f = ShmFile::create(&root.join("app"), 64).unwrap();
        let path = f.path().to_string_lossy().into_owned();
        assert_eq!(ShmRegion::open(&root, &path, 0, 64).unwrap().len(), 64);
        // A directory link inside the shared-memory directory, even one
        // pointing back inside it, is not followed.
        std::os::unix::fs::symlink(root.join("app"), root.join("via")).unwrap();
        let name = f.path().file_name().unwrap().to_string_lossy().into_owned();
        let through = root.join("via").join(&name);
        let e = ShmRegion::open(&root, &through.to_string_lossy(), 0, 64).unwrap_err();
        assert!(e.to_string().contains("symlinks are not followed"), "{e}");
        // The directory itself is no file.
        let e = ShmRegion::open(&root, &root.to_string_lossy(), 0, 0).unwrap_err();
        assert!(e.to_string().contains("must name a file"), "{e}");
    }

    #[test]
    fn empty_tensors_map_and_files_are_allocated_by_their_creator() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let empty = ShmFile::create(dir.path(), 0).unwrap();
        assert!(empty.is_empty() && empty.as_slice().is_empty());
        let path = empty.path().to_string_lossy().into_owned();
        let r = ShmRegion::open(dir.path(), &path, 0, 0).unwrap();
        assert!(r.is_empty() && r.as_slice().is_empty());
        // Not sparse: the pages are the creator's, not the first writer's.
        let f = ShmFile::create(dir.path(), 1 << 20).unwrap();
        let md = std::fs::metadata(f.path()).unwrap();
        assert!(md.blocks() * 512 >= 1 << 20, "{} blocks", md.blocks());
    }

    #[test]
    fn copies_out_of_a_shrunk_file_fail_instead_of_killing_the_agent() {
        use crate::transport::Backend;
        let dir = tempfile::tempdir().unwrap();
        let b = crate::host::HostBackend::new(dir.path());
        let mut src = ShmFile::create(dir.path(), 3 << 20).unwrap();
        src.as_mut_slice().fill(7);
        let dst = ShmFile::create(dir.path(), 3 << 20).unwrap();
        let open = |f: &ShmFile| {
            ShmRegion::open(dir.path(), &f.path().to_string_lossy(), 0, 3 << 20).unwrap()
        };
        let (s, mut d) = (open(&src), open(&dst));
        b.copy(&mut d, 0, &s, 0, 3 << 20).unwrap();
        assert!(dst.as_slice().iter().all(|x| *x == 7));
        // The owner shrinks the source: touching its mapping past the end
        // would raise SIGBUS; the copy reports an error instead.
        std::fs::OpenOptions::new()
            .write(true)
            .open(src.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = b.copy(&mut d, 0, &s, 0, 3 << 20).unwrap_err();
        assert!(e.to_string().contains("was a file shrunk"), "{e}");
        // Into plain memory from the shrunk file: a short read, an error.
        let mut plain = HostBuf(vec![0; 3 << 20]);
        assert!(b.copy(&mut plain, 0, &s, 0, 3 << 20).is_err());
    }
}
