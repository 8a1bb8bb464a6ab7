//! Host-wide kernel limits that a testbed of many network namespaces on one
//! bridge outgrows (the netns target's namespaces, the docker target's
//! containers).

/// Raises the limits that a flat network of `namespaces` ports outgrows
/// (never lowers them, and leaves them raised: by then other users of the
/// host may rely on the value):
/// - the ARP table, shared by all namespaces, refuses entries beyond
///   `gc_thresh3` (1024 by default), and each server namespace alone caches
///   one per pod: 64 entries a namespace. Past it the kernel logs
///   "neighbor table overflow" and connects time out (a broadcast's
///   children then leave their parents for the store);
/// - every ARP broadcast is copied to every port at once, into a per-CPU
///   backlog of `netdev_max_backlog` (1000 by default) packets: with more
///   ports than that, broadcasts are dropped and pods fail with "No route to
///   host". Room for 8 broadcasts at once.
///
/// Raising them takes root; without it a warning says what to run.
pub fn raise_limits(namespaces: usize) {
    for (knob, want) in wanted(namespaces) {
        let path = format!("/proc/sys/{knob}");
        let current = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        if current.is_some_and(|c| c < want) {
            let name = knob.replace('/', ".");
            match std::fs::write(&path, want.to_string()) {
                Ok(()) => tracing::info!("raised {name} to {want}"),
                Err(e) => tracing::warn!(
                    "could not raise {name} to {want} ({e}): a testbed of {namespaces} network \
                     namespaces may see connects time out (dmesg: neighbor table overflow); \
                     run `sudo sysctl -w {name}={want}` first"
                ),
            }
        }
    }
}

/// Each limit (a path under `/proc/sys`) and the least value `namespaces`
/// ports need.
fn wanted(namespaces: usize) -> [(&'static str, u64); 3] {
    let n = namespaces as u64;
    [
        ("net/ipv4/neigh/default/gc_thresh2", n * 32),
        ("net/ipv4/neigh/default/gc_thresh3", n * 64),
        ("net/core/netdev_max_backlog", n * 8),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_testbed_fits_the_default_limits_and_a_large_one_does_not() {
        // Defaults: gc_thresh2 512, gc_thresh3 1024, netdev_max_backlog 1000.
        let defaults = [512, 1024, 1000];
        let fits = |n| wanted(n).iter().zip(defaults).all(|((_, w), d)| *w <= d);
        assert!(fits(5), "a few pods need no change");
        // broadcast-200 on docker: 200 pods, the metadata server and the store.
        assert!(!fits(202));
        assert_eq!(
            wanted(202)[1],
            ("net/ipv4/neigh/default/gc_thresh3", 202 * 64)
        );
    }
}
