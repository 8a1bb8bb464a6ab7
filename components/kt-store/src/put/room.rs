//! Room on disk for a put, asked when it is planned.
//!
//! Invariant: the room a put is given counts what every session in
//! progress was promised (`PutSession::bytes_needed`) and the reserve,
//! so concurrent puts cannot together overrun the disk; a refusal is a
//! final `insufficient_storage` answer, naming the sizes.

use kt_service::ApiError;
use kt_sync::SyncError;
use kt_types::ErrorCode;

use crate::state::Shared;

/// What each file costs on disk besides its bytes (a block, an inode, the
/// staging's directory entries), counted when a put asks for room.
const PER_FILE: u64 = 4096;

/// Bytes free to this process on the data directory's file system, and
/// its size.
pub(crate) fn free_space(dir: &std::path::Path) -> Result<(u64, u64), SyncError> {
    let v = rustix::fs::statvfs(dir).map_err(|e| SyncError::io(dir, e.into()))?;
    Ok((
        v.f_bavail.saturating_mul(v.f_frsize),
        v.f_blocks.saturating_mul(v.f_frsize),
    ))
}

/// Refuses a put that needs `bytes` in `files` new files when the data
/// directory's free room, less what uploads in progress were promised and
/// the reserve ([`crate::Config::reserve`]), cannot take it.
pub(super) fn room_for(
    s: &Shared,
    (free, total): (u64, u64),
    bytes: u64,
    files: u64,
) -> Result<(), ApiError> {
    let promised: u64 = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|p| p.bytes_needed)
        .sum();
    let reserve = s.cfg.reserve.unwrap_or((total / 50).min(1 << 30));
    let needs = bytes.saturating_add(files.saturating_mul(PER_FILE));
    let usable = free.saturating_sub(reserve).saturating_sub(promised);
    if needs <= usable {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::InsufficientStorage,
        format!(
            "store full: this put needs {}, {} is free ({} kept in reserve, {} promised to uploads in progress)",
            iec(needs),
            iec(free),
            iec(reserve),
            iec(promised)
        ),
    ))
}

/// `n` bytes for people: `52428800 bytes (50.00 MiB)`.
fn iec(n: u64) -> String {
    format!("{n} bytes ({})", kt_types::size::human(n))
}
