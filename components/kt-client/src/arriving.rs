//! A put of a tree whose files are still arriving ([`crate::Client::put_arriving`]):
//! an S3 ingest downloads objects while the put sends the ones already
//! down, instead of sending only once the last one is.
//!
//! The caller knows the tree before its bytes: every entry's path, size,
//! mode and mtime (what a scan of the finished tree will find). A file
//! whose hash it does not know yet goes into the manifest deferred
//! ([`kt_types::api::PutRequest::deferred`]); as each file is in place it
//! says so with its content's blake3 ([`Arrived`], computed by whoever
//! wrote it, so the put reads each file once, to send it). The store
//! hashes what it receives and the commit compares: a file that differs
//! from its announced hash publishes nothing. The commit waits for every
//! announced file: arrivals that stop early (the sender dropped) fail the
//! put, and nothing is published.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use kt_types::{Hash, Manifest};
use tokio::sync::mpsc;

use crate::error::ClientError;

/// One file of an [`Arriving`] tree now complete at its place, with the
/// blake3 of its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrived {
    /// Its manifest index.
    pub index: u32,
    pub hash: Hash,
}

/// A tree whose files are still being written, for
/// [`crate::Client::put_arriving`].
#[derive(Debug)]
pub struct Arriving {
    /// The finished tree, as a scan of it will see it (sorted entries, the
    /// files' final sizes, modes and mtimes); a file whose hash is not
    /// known yet carries `hash: None` and must be pending.
    pub manifest: Manifest,
    /// Manifest indices of the files not yet in place: each is announced
    /// once by an [`Arrived`] on `arrivals` (with the manifest's hash, when
    /// it has one). The others must be in place already.
    pub pending: Vec<u32>,
    pub arrivals: mpsc::Receiver<Arrived>,
}

/// The waits of an empty put session: a session idle this long is sent
/// an empty batch (it would expire after the store's session TTL).
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(60);

/// What of an [`Arriving`] tree has arrived, across a put's attempts.
#[derive(Debug)]
pub(crate) struct Arrivals {
    rx: mpsc::Receiver<Arrived>,
    pending: BTreeSet<u32>,
    arrived: HashMap<u32, Hash>,
}

impl Arrivals {
    /// Checks `pending` against `manifest`: in range, files, named once,
    /// and every file without a hash among them.
    pub(crate) fn new(
        manifest: &Manifest,
        pending: Vec<u32>,
        rx: mpsc::Receiver<Arrived>,
    ) -> Result<Self, ClientError> {
        let mut set = BTreeSet::new();
        for i in pending {
            let e = manifest.entries.get(i as usize).ok_or_else(|| {
                ClientError::Local(format!(
                    "pending entry #{i} is out of range: the manifest has {} entries",
                    manifest.entries.len()
                ))
            })?;
            if e.kind != kt_types::EntryKind::File {
                return Err(ClientError::Local(format!(
                    "pending entry #{i} ({:?}) is not a file",
                    e.path
                )));
            }
            if !set.insert(i) {
                return Err(ClientError::Local(format!(
                    "pending entry #{i} ({:?}) is named twice",
                    e.path
                )));
            }
        }
        if let Some((i, e)) = manifest.entries.iter().enumerate().find(|(i, e)| {
            e.kind == kt_types::EntryKind::File && e.hash.is_none() && !set.contains(&(*i as u32))
        }) {
            return Err(ClientError::Local(format!(
                "entry #{i} ({:?}) has no hash and is not pending: its hash would never be known",
                e.path
            )));
        }
        Ok(Arrivals {
            rx,
            pending: set,
            arrived: HashMap::new(),
        })
    }

    /// Whether entry `i` is still to arrive.
    pub(crate) fn is_pending(&self, i: u32) -> bool {
        self.pending.contains(&i)
    }

    /// Whether entry `i` was announced by the caller (arrived or not).
    pub(crate) fn announced(&self, i: u32) -> bool {
        self.is_pending(i) || self.arrived.contains_key(&i)
    }

    /// The hash entry `i` arrived with.
    pub(crate) fn hash(&self, i: u32) -> Option<Hash> {
        self.arrived.get(&i).copied()
    }

    pub(crate) fn done(&self) -> bool {
        self.pending.is_empty()
    }

    /// Records one arrival: a pending entry, once, with the manifest's
    /// hash when it has one.
    fn record(&mut self, m: &Manifest, a: Arrived) -> Result<u32, ClientError> {
        if !self.pending.remove(&a.index) {
            return Err(ClientError::Local(format!(
                "entry #{} arrived but was not pending (announced twice, or never)",
                a.index
            )));
        }
        let e = &m.entries[a.index as usize];
        if e.hash.is_some_and(|h| h != a.hash) {
            return Err(ClientError::Local(format!(
                "{:?} arrived with hash {}, not the {} the put was planned with",
                e.path,
                a.hash,
                e.hash.unwrap_or(a.hash)
            )));
        }
        self.arrived.insert(a.index, a.hash);
        Ok(a.index)
    }

    /// The next arrival (`None`: all have arrived). Waits at most `wait`
    /// when given (then `Ok(None)` too; tell by [`Arrivals::done`]).
    pub(crate) async fn next(
        &mut self,
        m: &Manifest,
        wait: Option<Duration>,
    ) -> Result<Option<u32>, ClientError> {
        if self.done() {
            return Ok(None);
        }
        let got = match wait {
            None => self.rx.recv().await,
            Some(w) => match tokio::time::timeout(w, self.rx.recv()).await {
                Ok(got) => got,
                Err(_) => return Ok(None),
            },
        };
        match got {
            Some(a) => self.record(m, a).map(Some),
            None => Err(self.ended(m)),
        }
    }

    /// An arrival that is already there, without waiting.
    pub(crate) fn try_next(&mut self, m: &Manifest) -> Result<Option<u32>, ClientError> {
        match self.rx.try_recv() {
            Ok(a) => self.record(m, a).map(Some),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) if self.done() => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(self.ended(m)),
        }
    }

    /// Waits until every entry of `which` has arrived.
    pub(crate) async fn wait_for(
        &mut self,
        m: &Manifest,
        which: &[u32],
    ) -> Result<(), ClientError> {
        while which.iter().any(|i| self.is_pending(*i)) {
            self.next(m, None).await?;
        }
        Ok(())
    }

    /// The error of arrivals that stopped with files still pending.
    fn ended(&self, m: &Manifest) -> ClientError {
        let some: Vec<&str> = self
            .pending
            .iter()
            .take(3)
            .map(|&i| m.entries[i as usize].path.as_str())
            .collect();
        ClientError::Local(format!(
            "the put's source stopped with {} file(s) still to arrive (e.g. {some:?}): nothing is published",
            self.pending.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::{Entry, EntryKind};

    fn manifest() -> Manifest {
        let file = |path: &str, hash: Option<Hash>| Entry {
            path: path.into(),
            kind: EntryKind::File,
            size: 3,
            mode: 0o644,
            mtime: 1,
            mtime_nsec: 0,
            hash,
            target: None,
        };
        Manifest {
            root: kt_types::RootKind::Dir,
            entries: vec![
                file("a", None),
                file("b", Some(Hash([7; 32]))),
                file("c", Some(Hash([8; 32]))),
            ],
        }
    }

    #[tokio::test]
    async fn arrivals_are_checked_and_an_early_end_names_what_is_missing() {
        let m = manifest();
        let (_tx, rx) = mpsc::channel(4);
        // A file without a hash must be pending; pending entries are files named once.
        let e = Arrivals::new(&m, vec![1], rx).unwrap_err();
        assert!(
            e.to_string().contains("has no hash and is not pending"),
            "{e}"
        );
        let (_tx, rx) = mpsc::channel(4);
        let e = Arrivals::new(&m, vec![0, 0], rx).unwrap_err();
        assert!(e.to_string().contains("named twice"), "{e}");
        let (_tx, rx) = mpsc::channel(4);
        assert!(Arrivals::new(&m, vec![0, 5], rx).is_err());

        let (tx, rx) = mpsc::channel(4);
        let mut a = Arrivals::new(&m, vec![0, 1], rx).unwrap();
        assert!(a.announced(1) && !a.announced(2));
        tx.send(Arrived {
            index: 0,
            hash: Hash([1; 32]),
        })
        .await
        .unwrap();
        assert_eq!(a.next(&m, None).await.unwrap(), Some(0));
        assert_eq!(a.hash(0), Some(Hash([1; 32])));
        // Nothing there yet: no wait.
        assert_eq!(a.try_next(&m).unwrap(), None);
        assert_eq!(
            a.next(&m, Some(Duration::from_millis(1))).await.unwrap(),
            None
        );
        assert!(!a.done());
        // Twice: refused.
        tx.send(Arrived {
            index: 0,
            hash: Hash([1; 32]),
        })
        .await
        .unwrap();
        assert!(a.next(&m, None).await.is_err());
        // Another hash than the manifest's: refused.
        tx.send(Arrived {
            index: 1,
            hash: Hash([9; 32]),
        })
        .await
        .unwrap();
        let e = a.next(&m, None).await.unwrap_err();
        assert!(e.to_string().contains("not the"), "{e}");

        let (tx, rx) = mpsc::channel(4);
        let mut a = Arrivals::new(&m, vec![0, 1], rx).unwrap();
        tx.send(Arrived {
            index: 1,
            hash: Hash([7; 32]),
        })
        .await
        .unwrap();
        drop(tx);
        assert_eq!(a.try_next(&m).unwrap(), Some(1));
        let e = a.wait_for(&m, &[0]).await.unwrap_err();
        assert!(e.to_string().contains("1 file(s) still to arrive"), "{e}");
        assert!(e.to_string().contains("\"a\""), "{e}");
    }
}
