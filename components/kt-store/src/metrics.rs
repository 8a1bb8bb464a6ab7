//! The store's gauges, read at each scrape: its data directory's file
//! system (free and size, for the disk alert), uploads and reads in
//! progress, keys held. No label: one store per series.

use std::sync::Weak;

use kt_service::metrics::{Collect, Snapshot};

use crate::state::Shared;

/// Reads [`Shared`] weakly: the state holds the metrics that hold this.
#[derive(Debug)]
pub struct StoreGauges(pub Weak<Shared>);

/// The gauges of `s` now.
pub fn snapshot(s: &Shared) -> Snapshot {
    let mut snap = Snapshot::default();
    match crate::put::free_space(&s.cfg.data_dir) {
        Ok((free, size)) => {
            snap.gauge(
                "store_disk_free_bytes",
                "Bytes free to the store on its data directory's file system",
                &[],
                free as f64,
            );
            snap.gauge(
                "store_disk_size_bytes",
                "Size in bytes of the store's data directory's file system",
                &[],
                size as f64,
            );
        }
        Err(e) => tracing::warn!(error = %e, "statvfs of the data directory failed"),
    }
    let sessions = s.puts.lock().unwrap_or_else(|p| p.into_inner()).len();
    snap.gauge(
        "store_put_sessions",
        "Uploads (put sessions) in progress",
        &[],
        sessions as f64,
    );
    snap.gauge(
        "read_leases",
        "Read leases open on this server (getters reading from it)",
        &[],
        s.reads.open_leases() as f64,
    );
    snap.gauge(
        "store_keys",
        "Keys the store holds a current version of",
        &[],
        s.keys.all().len() as f64,
    );
    snap
}

impl Collect for StoreGauges {
    fn collect(&self) -> std::pin::Pin<Box<dyn Future<Output = Snapshot> + Send + '_>> {
        let shared = self.0.upgrade();
        Box::pin(async move {
            match shared {
                Some(s) => kt_service::blocking(move || Ok(snapshot(&s)))
                    .await
                    .unwrap_or_default(),
                None => Snapshot::default(),
            }
        })
    }
}
