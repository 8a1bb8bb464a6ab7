//! Source leases as a plain state machine: no I/O, no clock (callers pass `now`),
//! no randomness (callers pass lease ids).
//!
//! A lease counts in its source's load until it is released or expires, so a
//! getter that crashes never leaks a slot. Expired leases are dropped lazily by
//! every operation (and by the server's sweeper), so loads never count them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kt_types::api::LeaseInfo;
use kt_types::auth::Principal;
use kt_types::{Key, Source};

/// A source a getter may be handed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub source: Source,
    /// True for the key's origin (the store or the producer's agent).
    pub origin: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: String,
    pub key: Key,
    pub source: Source,
    pub expires_at_ms: u64,
    /// Who took it: only they (or an admin) report its source failed.
    pub getter: Principal,
}

impl Lease {
    pub fn info(&self, now_ms: u64) -> LeaseInfo {
        LeaseInfo {
            lease: self.id.clone(),
            key: self.key.clone(),
            source: self.source.id.clone(),
            expires_in_ms: self.expires_at_ms.saturating_sub(now_ms),
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct Leases {
    by_id: BTreeMap<String, Lease>,
    /// `(expires_at_ms, lease id)`: the next lease to expire comes first.
    by_expiry: BTreeSet<(u64, String)>,
    /// Unexpired leases per source id.
    load: HashMap<String, usize>,
}

impl Leases {
    /// Drops leases whose expiry has passed; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut n = 0;
        while let Some((at, _)) = self.by_expiry.first()
            && *at <= now_ms
        {
            if let Some((_, id)) = self.by_expiry.pop_first() {
                self.forget(&id);
                n += 1;
            }
        }
        n
    }

    /// Unexpired leases held on the source `source_id`.
    pub fn load(&mut self, source_id: &str, now_ms: u64) -> usize {
        self.expire(now_ms);
        self.load.get(source_id).copied().unwrap_or(0)
    }

    /// The least-loaded candidate; ties go to peers before the origin (to
    /// offload it), then to the smaller id.
    pub fn pick<'c>(&mut self, candidates: &'c [Candidate], now_ms: u64) -> Option<&'c Candidate> {
        self.expire(now_ms);
        candidates.iter().min_by(|a, b| {
            let load = |c: &Candidate| self.load.get(&c.source.id).copied().unwrap_or(0);
            (load(a), a.origin, &a.source.id).cmp(&(load(b), b.origin, &b.source.id))
        })
    }

    /// Leases the least-loaded candidate to a getter under `id`.
    pub fn grant(
        &mut self,
        id: String,
        (key, getter): (Key, Principal),
        candidates: &[Candidate],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Option<Lease> {
        let source = self.pick(candidates, now_ms)?.source.clone();
        let lease = Lease {
            id: id.clone(),
            key,
            source,
            expires_at_ms: now_ms.saturating_add(ttl_ms),
            getter,
        };
        // An id is never reused; should one be, the old lease is replaced, not leaked.
        self.release(&id, now_ms);
        *self.load.entry(lease.source.id.clone()).or_default() += 1;
        self.by_expiry.insert((lease.expires_at_ms, id.clone()));
        self.by_id.insert(id, lease.clone());
        Some(lease)
    }

    /// Extends an unexpired lease by `ttl_ms` from now.
    pub fn renew(&mut self, id: &str, now_ms: u64, ttl_ms: u64) -> Option<Lease> {
        self.expire(now_ms);
        let lease = self.by_id.get_mut(id)?;
        self.by_expiry.remove(&(lease.expires_at_ms, id.to_owned()));
        lease.expires_at_ms = now_ms.saturating_add(ttl_ms);
        self.by_expiry.insert((lease.expires_at_ms, id.to_owned()));
        Some(lease.clone())
    }

    /// An unexpired lease.
    pub fn get(&mut self, id: &str, now_ms: u64) -> Option<&Lease> {
        self.expire(now_ms);
        self.by_id.get(id)
    }

    /// Ends an unexpired lease, returning it.
    pub fn release(&mut self, id: &str, now_ms: u64) -> Option<Lease> {
        self.expire(now_ms);
        let lease = self.forget(id)?;
        self.by_expiry.remove(&(lease.expires_at_ms, id.to_owned()));
        Some(lease)
    }

    /// Unexpired leases, by id.
    pub fn list(&mut self, now_ms: u64) -> Vec<LeaseInfo> {
        self.expire(now_ms);
        self.by_id.values().map(|l| l.info(now_ms)).collect()
    }

    /// Removes a lease from `by_id` and `load` (not from `by_expiry`).
    fn forget(&mut self, id: &str) -> Option<Lease> {
        let lease = self.by_id.remove(id)?;
        if let Some(n) = self.load.get_mut(&lease.source.id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.load.remove(&lease.source.id);
            }
        }
        Some(lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: &str, origin: bool) -> Candidate {
        Candidate {
            source: Source {
                id: id.into(),
                url: format!("http://{id}"),
                version: "v1".into(),
            },
            origin,
        }
    }
    fn key() -> Key {
        Key::parse("svc/k").unwrap()
    }

    /// Grants `n` leases with ids `prefix-0..n` and returns the chosen source ids.
    fn grant_n(
        l: &mut Leases,
        cands: &[Candidate],
        prefix: &str,
        n: usize,
        now: u64,
    ) -> Vec<String> {
        (0..n)
            .map(|i| {
                l.grant(
                    format!("{prefix}-{i}"),
                    (key(), Principal::admin()),
                    cands,
                    now,
                    1_000,
                )
                .unwrap()
                .source
                .id
            })
            .collect()
    }

    #[test]
    fn least_loaded_with_peers_before_origin_then_by_id() {
        let mut l = Leases::default();
        let cands = [cand("store", true), cand("p2", false), cand("p1", false)];
        // All idle: a peer before the origin, the smaller id first; then spread.
        assert_eq!(
            grant_n(&mut l, &cands, "a", 6, 0),
            ["p1", "p2", "store", "p1", "p2", "store"]
        );
        assert_eq!(l.load("p1", 0), 2);
        assert_eq!(l.load("store", 0), 2);
        // Releasing one of p2's leases makes it the least loaded.
        assert_eq!(l.release("a-1", 0).unwrap().source.id, "p2");
        assert_eq!(grant_n(&mut l, &cands, "b", 1, 0), ["p2"]);
        assert!(l.pick(&[], 0).is_none());
    }

    #[test]
    fn origin_wins_when_peers_are_busier() {
        let mut l = Leases::default();
        grant_n(&mut l, &[cand("p1", false)], "a", 1, 0);
        let cands = [cand("p1", false), cand("origin", true)];
        assert_eq!(grant_n(&mut l, &cands, "b", 1, 0), ["origin"]);
    }

    #[test]
    fn expired_leases_are_not_counted() {
        let mut l = Leases::default();
        let cands = [cand("p1", false), cand("p2", false)];
        grant_n(&mut l, &cands[..1], "a", 3, 0);
        assert_eq!(l.load("p1", 999), 3);
        // p1 is busier until its leases expire at 1000; nothing sweeps in between.
        assert_eq!(l.pick(&cands, 999).unwrap().source.id, "p2");
        assert_eq!(l.pick(&cands, 1_000).unwrap().source.id, "p1");
        assert_eq!(l.load("p1", 1_000), 0);
        assert!(l.list(1_000).is_empty());
        assert!(l.renew("a-0", 1_000, 1_000).is_none());
        assert!(l.release("a-0", 1_000).is_none());
    }

    #[test]
    fn renew_extends_and_lists() {
        let mut l = Leases::default();
        grant_n(&mut l, &[cand("p1", false)], "a", 2, 0);
        assert_eq!(l.renew("a-0", 900, 1_000).unwrap().expires_at_ms, 1_900);
        assert_eq!(l.expire(1_000), 1);
        let list = l.list(1_000);
        assert_eq!(list.len(), 1);
        assert_eq!(
            (list[0].lease.as_str(), list[0].expires_in_ms),
            ("a-0", 900)
        );
        assert_eq!(list[0].source, "p1");
        assert_eq!(l.expire(1_900), 1);
        assert_eq!(l.load("p1", 1_900), 0);
        assert!(l.renew("missing", 0, 1).is_none());
    }
}
