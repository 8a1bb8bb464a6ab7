//! The local side of transfers, shared by puts (`transfer`) and downloads
//! (`download`): blocking file work off the async threads, the scan of a
//! source with its cache, and the split of files into parallel streams.

use std::path::{Path, PathBuf};

use kt_sync::scan::{Kept, scan_deferring};
use kt_sync::{ScanCache, SyncError};
use kt_types::Manifest;

use crate::api::Client;
use crate::error::ClientError;

/// File work off the async threads ([`kt_sync::task::blocking`]).
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SyncError> + Send + 'static,
) -> Result<T, ClientError> {
    kt_sync::task::blocking(move || f().map_err(ClientError::from)).await
}

/// Splits `items` (in manifest order) into at most `n` contiguous runs of
/// similar byte size. Contiguous runs keep each stream in its own directories,
/// so receivers creating files in parallel do not contend on one directory.
pub(crate) fn balance<T>(items: Vec<(u64, T)>, n: usize) -> Vec<Vec<T>> {
    let total: u64 = items.iter().map(|(size, _)| size.max(&1)).sum();
    let n = n.max(1) as u64;
    let mut groups: Vec<Vec<T>> = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0u64;
    for (size, item) in items {
        current.push(item);
        filled += size.max(1);
        // Close a run once it holds its share of the bytes.
        if filled * n >= total * (groups.len() as u64 + 1) && (groups.len() as u64) < n - 1 {
            groups.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        groups.push(current);
    }
    groups
}

pub(crate) fn cache_file(client: &Client, src: &Path) -> Option<PathBuf> {
    let dir = client.cfg.cache_dir.as_ref()?;
    let abs = std::path::absolute(src).ok()?;
    let id = blake3::hash(abs.as_os_str().as_encoded_bytes()).to_hex();
    Some(dir.join("scan").join(format!("{}.json", &id[..32])))
}

/// Small-file contents a put keeps from its scan (so it does not read them twice).
pub(crate) const KEEP_BUDGET: u64 = 256 << 20;

/// Scans `src` with its cache, keeping up to `keep` bytes of what it reads.
pub(crate) async fn scan_cached(
    client: &Client,
    src: &Path,
    keep: u64,
) -> Result<(Manifest, Kept), ClientError> {
    let (m, kept, _) = scan_cached_deferring(client, src, keep, None).await?;
    Ok((m, kept))
}

/// [`scan_cached`], leaving unhashed the files larger than `defer_above`
/// the cache has no hash for ([`kt_sync::scan::scan_deferring`]).
pub(crate) async fn scan_cached_deferring(
    client: &Client,
    src: &Path,
    keep: u64,
    defer_above: Option<u64>,
) -> Result<(Manifest, Kept, Vec<u32>), ClientError> {
    let cache_path = cache_file(client, src);
    let src = src.to_owned();
    blocking(move || {
        let mut cache = cache_path
            .as_deref()
            .map(ScanCache::load)
            .unwrap_or_default();
        let scanned = scan_deferring(&src, &mut cache, keep, defer_above)?;
        if let Some(p) = cache_path.filter(|_| cache.dirty)
            && let Err(e) = cache.save(&p)
        {
            tracing::debug!(error = %e, "scan cache not saved");
        }
        Ok(scanned)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::balance;

    #[test]
    fn balances_by_size() {
        let groups = balance(vec![(10, 'a'), (1, 'b'), (1, 'c'), (9, 'd')], 2);
        assert_eq!(groups, vec![vec!['a', 'b'], vec!['c', 'd']]);
        let even = balance((0..8).map(|i| (1, i)).collect(), 4);
        assert_eq!(even, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(balance::<u8>(vec![], 4).len(), 0);
        assert_eq!(balance(vec![(1, 1)], 4), vec![vec![1]]);
    }
}
