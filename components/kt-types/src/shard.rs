//! Rank-aware shard assignment: which of the files below a prefix each of
//! `world` training ranks reads, and in what order.
//!
//! The assignment is a pure function of the set of `(path, size)` pairs and
//! `world`: the input's order does not matter, so every rank that lists the
//! same dataset computes the same split without talking to the others, and a
//! dataset read again (the next epoch, a restarted job) splits the same way —
//! a rank re-reads the files it already holds. Files go, largest first, to
//! the rank with the fewest bytes so far (ties: the lower rank), which keeps
//! every rank's byte total within the largest file's size of every other's
//! (balanced by bytes, not by count).
//!
//! The epoch only changes the order in which a rank reads its share, and only
//! when `shuffle` is set: a seeded Fisher–Yates shuffle per (epoch, rank), so
//! a run that resumes from a position (an index into the ordered share, which
//! a checkpoint can store) sees the same order again.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

/// The most ranks a dataset is split across: far above any training job,
/// and low enough that a ticket or a flag cannot make a reader allocate
/// per-rank state without bound.
pub const MAX_WORLD: u32 = 65_536;

/// One rank of `world`, as `kt get PREFIX/ --shard RANK/WORLD` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shard {
    /// This rank, `0..world`.
    pub rank: u32,
    /// How many ranks share the dataset.
    pub world: u32,
}

/// Why a shard spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// Not `RANK/WORLD`.
    #[error("shard {0:?} is not RANK/WORLD (e.g. 2/8)")]
    Syntax(String),
    /// `world` was 0.
    #[error("shard world must be at least 1")]
    EmptyWorld,
    /// `world` above [`MAX_WORLD`].
    #[error("shard world {0} is above the limit of {MAX_WORLD} ranks")]
    WorldTooLarge(u32),
    /// `rank >= world`.
    #[error("shard rank {rank} is not below the world size {world}")]
    RankOutOfRange {
        /// The rank given.
        rank: u32,
        /// The world size given.
        world: u32,
    },
}

impl Shard {
    /// A checked shard: `world >= 1` and `rank < world`.
    pub fn new(rank: u32, world: u32) -> Result<Self, ShardError> {
        if world == 0 {
            return Err(ShardError::EmptyWorld);
        }
        if world > MAX_WORLD {
            return Err(ShardError::WorldTooLarge(world));
        }
        if rank >= world {
            return Err(ShardError::RankOutOfRange { rank, world });
        }
        Ok(Self { rank, world })
    }

    /// Checks a shard that arrived over the wire.
    pub fn validate(self) -> Result<Self, ShardError> {
        Self::new(self.rank, self.world)
    }
}

impl std::str::FromStr for Shard {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = || ShardError::Syntax(s.to_string());
        let (rank, world) = s.trim().split_once('/').ok_or_else(syntax)?;
        let rank = rank.trim().parse().map_err(|_| syntax())?;
        let world = world.trim().parse().map_err(|_| syntax())?;
        Self::new(rank, world)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.rank, self.world)
    }
}

/// Which share to read and in what order: a shard plus the epoch's shuffle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareSpec {
    /// This rank of the world.
    #[serde(flatten)]
    pub shard: Shard,
    /// Seeds the order when `shuffle` is set.
    #[serde(default)]
    pub epoch: u64,
    /// Read the share in a per-(epoch, rank) shuffled order instead of by path.
    #[serde(default)]
    pub shuffle: bool,
}

/// The longest [`ShareTicket`] accepted, in bytes.
pub const MAX_TICKET_BYTES: usize = 4096;

/// An Arrow Flight ticket naming one rank's share of the dataset below a
/// prefix: what a `pyarrow.flight` client sends to a node agent's `DoGet`.
/// JSON, `epoch` and `shuffle` optional:
/// `{"prefix":"svc/train","rank":2,"world":4,"epoch":0,"shuffle":false}`.
/// Unknown fields are refused (a misspelt `"ranks"` is no silent rank 0).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareTicket {
    /// The dataset: every file of every key below it (a key prefix; a
    /// trailing `/` is allowed).
    pub prefix: String,
    /// This rank, `0..world`.
    pub rank: u32,
    /// How many ranks share the dataset.
    pub world: u32,
    /// Seeds the order when `shuffle` is set.
    #[serde(default)]
    pub epoch: u64,
    /// Read the share in a per-(epoch, rank) shuffled order.
    #[serde(default)]
    pub shuffle: bool,
}

/// Why a ticket was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    /// Longer than [`MAX_TICKET_BYTES`].
    #[error("the ticket is {0} bytes; the limit is {MAX_TICKET_BYTES}")]
    TooLong(usize),
    /// Not the JSON of a [`ShareTicket`].
    #[error(
        "the ticket is not JSON {{\"prefix\":\"svc/data\",\"rank\":R,\"world\":W,\"epoch\":E,\"shuffle\":false}}: {0}"
    )]
    Json(String),
    /// The prefix breaks the key grammar.
    #[error("the ticket's prefix: {0}")]
    Prefix(#[from] crate::KeyError),
    /// The prefix is empty: the whole namespace is no dataset.
    #[error("the ticket's prefix is empty: name the prefix the dataset lies below")]
    RootPrefix,
    /// The rank or world is out of range.
    #[error("the ticket's shard: {0}")]
    Shard(#[from] ShardError),
}

impl ShareTicket {
    /// The ticket for `spec` of the dataset below `prefix`.
    pub fn new(prefix: &crate::KeyPrefix, spec: &ShareSpec) -> Self {
        ShareTicket {
            prefix: prefix.as_str().to_owned(),
            rank: spec.shard.rank,
            world: spec.shard.world,
            epoch: spec.epoch,
            shuffle: spec.shuffle,
        }
    }

    /// A ticket as it came over the wire, checked ([`ShareTicket::validate`]).
    pub fn parse(bytes: &[u8]) -> Result<(crate::KeyPrefix, ShareSpec), TicketError> {
        if bytes.len() > MAX_TICKET_BYTES {
            return Err(TicketError::TooLong(bytes.len()));
        }
        let t: ShareTicket =
            serde_json::from_slice(bytes).map_err(|e| TicketError::Json(e.to_string()))?;
        t.validate()
    }

    /// The prefix (normalised, never the root) and the share it names.
    pub fn validate(&self) -> Result<(crate::KeyPrefix, ShareSpec), TicketError> {
        let prefix = crate::KeyPrefix::parse(&self.prefix)?;
        if prefix.as_str().is_empty() {
            return Err(TicketError::RootPrefix);
        }
        let shard = Shard::new(self.rank, self.world)?;
        Ok((
            prefix,
            ShareSpec {
                shard,
                epoch: self.epoch,
                shuffle: self.shuffle,
            },
        ))
    }

    /// The ticket's bytes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Splits files across `world` ranks by bytes: returns, per rank, the indices
/// into `files` it reads (each index exactly once across all ranks), in path
/// order. `files` holds `(path, size)`; paths should be unique (a listing
/// below one prefix is) — equal paths are told apart by their size and then
/// by their position in `files`, which is the one case where input order
/// matters.
pub fn assign<P: AsRef<str>>(files: &[(P, u64)], world: u32) -> Vec<Vec<usize>> {
    let world = world.max(1) as usize;
    let mut order: Vec<usize> = (0..files.len()).collect();
    // Largest first; equal sizes by path so the split is the same whatever
    // order the listing came in.
    order.sort_by(|&a, &b| {
        let (pa, sa) = (&files[a].0, files[a].1);
        let (pb, sb) = (&files[b].0, files[b].1);
        sb.cmp(&sa)
            .then_with(|| pa.as_ref().cmp(pb.as_ref()))
            .then(a.cmp(&b))
    });
    let mut ranks: Vec<Vec<usize>> = vec![Vec::new(); world];
    // The lightest rank, ties to the lower one, from a heap. Only the first
    // `files.len()` ranks can ever be the lightest (before k files are
    // placed, one of ranks 0..=k still holds nothing), so the heap holds at
    // most that many whatever `world` says.
    let mut lightest: BinaryHeap<Reverse<(u64, usize)>> = (0..world.min(files.len().max(1)))
        .map(|r| Reverse((0, r)))
        .collect();
    for i in order {
        let Reverse((load, rank)) = lightest.pop().expect("at least one rank");
        ranks[rank].push(i);
        lightest.push(Reverse((load.saturating_add(files[i].1), rank)));
    }
    for share in &mut ranks {
        share.sort_by(|&a, &b| files[a].0.as_ref().cmp(files[b].0.as_ref()).then(a.cmp(&b)));
    }
    ranks
}

/// The indices into `files` that `spec.shard` reads, in its reading order:
/// by path, or shuffled by `(epoch, rank)` when `spec.shuffle` is set.
pub fn share<P: AsRef<str>>(files: &[(P, u64)], spec: &ShareSpec) -> Vec<usize> {
    let mut ranks = assign(files, spec.shard.world);
    let rank = (spec.shard.rank as usize).min(ranks.len() - 1);
    let mut mine = std::mem::take(&mut ranks[rank]);
    if spec.shuffle {
        shuffle(&mut mine, seed(spec.epoch, spec.shard.rank));
    }
    mine
}

/// The bytes each rank of an assignment reads.
pub fn loads<P: AsRef<str>>(files: &[(P, u64)], ranks: &[Vec<usize>]) -> Vec<u64> {
    ranks
        .iter()
        .map(|share| share.iter().map(|&i| files[i].1).sum())
        .collect()
}

fn seed(epoch: u64, rank: u32) -> u64 {
    // Distinct streams per (epoch, rank); the constant keeps epoch 0 rank 0
    // from seeding with zero.
    epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17)
        ^ u64::from(rank).wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ 0x6A09_E667_F3BC_C908
}

/// SplitMix64: a small, well-mixed generator, enough to shuffle a reading
/// order reproducibly (not for anything secret).
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn shuffle<T>(items: &mut [T], mut state: u64) {
    for i in (1..items.len()).rev() {
        // Lemire's multiply-shift: unbiased enough for an order.
        let j = ((u128::from(next(&mut state)) * (i as u128 + 1)) >> 64) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dataset(state: &mut u64, n: usize) -> Vec<(String, u64)> {
        (0..n)
            .map(|i| {
                let size = match next(state) % 4 {
                    0 => 0,
                    1 => next(state) % 100,
                    2 => next(state) % 10_000,
                    _ => next(state) % 5_000_000,
                };
                (format!("shard-{i:05}.parquet"), size)
            })
            .collect()
    }

    #[test]
    fn parses_and_refuses_shard_specs() {
        assert_eq!("2/8".parse::<Shard>(), Ok(Shard { rank: 2, world: 8 }));
        assert_eq!(" 0 / 1 ".parse::<Shard>(), Ok(Shard { rank: 0, world: 1 }));
        assert_eq!(
            "8/8".parse::<Shard>(),
            Err(ShardError::RankOutOfRange { rank: 8, world: 8 })
        );
        assert_eq!("0/0".parse::<Shard>(), Err(ShardError::EmptyWorld));
        assert_eq!(
            "0/4294967295".parse::<Shard>(),
            Err(ShardError::WorldTooLarge(u32::MAX))
        );
        assert!("65535/65536".parse::<Shard>().is_ok());
        for bad in ["", "2", "2/", "/8", "a/b", "-1/4", "1/4/2"] {
            assert!(
                matches!(bad.parse::<Shard>(), Err(ShardError::Syntax(_))),
                "{bad:?}"
            );
        }
        assert_eq!(Shard::new(3, 4).unwrap().to_string(), "3/4");
    }

    #[test]
    fn every_file_exactly_once_and_bytes_balanced_within_the_largest_file() {
        let mut state = 7;
        for case in 0..300 {
            let n = (next(&mut state) % 200) as usize;
            let world = 1 + (next(&mut state) % 17) as u32;
            let files = dataset(&mut state, n);
            let ranks = assign(&files, world);
            assert_eq!(ranks.len(), world as usize);
            let mut seen = vec![0u32; n];
            for share in &ranks {
                for &i in share {
                    seen[i] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "case {case}: {seen:?}");
            let loads = loads(&files, &ranks);
            let largest = files.iter().map(|f| f.1).max().unwrap_or(0);
            let (max, min) = (loads.iter().max().unwrap(), loads.iter().min().unwrap());
            assert!(
                max - min <= largest,
                "case {case}: loads {loads:?}, largest file {largest}"
            );
        }
    }

    #[test]
    fn the_split_does_not_depend_on_the_listing_order() {
        let mut state = 11;
        for _ in 0..50 {
            let files = dataset(&mut state, 64);
            let mut reversed = files.clone();
            reversed.reverse();
            let mut shuffled = files.clone();
            shuffle(&mut shuffled, next(&mut state));
            let names = |files: &[(String, u64)]| -> Vec<Vec<String>> {
                assign(files, 5)
                    .into_iter()
                    .map(|share| share.into_iter().map(|i| files[i].0.clone()).collect())
                    .collect()
            };
            assert_eq!(names(&files), names(&reversed));
            assert_eq!(names(&files), names(&shuffled));
        }
    }

    #[test]
    fn equal_sizes_split_by_count_and_shares_read_in_path_order() {
        let files: Vec<(String, u64)> = (0..64).map(|i| (format!("{i:02}"), 1024)).collect();
        let ranks = assign(&files, 8);
        for share in &ranks {
            assert_eq!(share.len(), 8);
            assert!(share.windows(2).all(|w| files[w[0]].0 < files[w[1]].0));
        }
    }

    #[test]
    fn the_heap_places_files_as_a_scan_for_the_lightest_rank_would() {
        // The plain definition: each file, largest first, to the rank with
        // the fewest bytes, ties to the lower rank.
        fn by_scan(files: &[(String, u64)], world: usize) -> Vec<Vec<usize>> {
            let mut order: Vec<usize> = (0..files.len()).collect();
            order.sort_by(|&a, &b| (files[b].1, &files[a].0, a).cmp(&(files[a].1, &files[b].0, b)));
            let mut loads = vec![0u64; world];
            let mut ranks = vec![Vec::new(); world];
            for i in order {
                let r = (0..world).min_by_key(|&r| (loads[r], r)).unwrap();
                loads[r] += files[i].1;
                ranks[r].push(i);
            }
            for share in &mut ranks {
                share.sort_by(|&a, &b| files[a].0.cmp(&files[b].0).then(a.cmp(&b)));
            }
            ranks
        }
        let mut state = 5;
        for _ in 0..200 {
            let n = (next(&mut state) % 60) as usize;
            let world = 1 + (next(&mut state) % 90) as u32;
            let mut files = dataset(&mut state, n);
            // Zero-byte files and equal sizes exercise the ties.
            for f in files.iter_mut().step_by(3) {
                f.1 = 0;
            }
            assert_eq!(assign(&files, world), by_scan(&files, world as usize));
        }
    }

    #[test]
    fn the_largest_world_costs_what_its_files_cost() {
        let files: Vec<(String, u64)> = (0..10).map(|i| (format!("{i}"), 7)).collect();
        let ranks = assign(&files, MAX_WORLD);
        assert_eq!(ranks.len(), MAX_WORLD as usize);
        assert_eq!(ranks.iter().filter(|s| !s.is_empty()).count(), 10);
    }

    #[test]
    fn more_ranks_than_files_leaves_some_ranks_empty() {
        let files = vec![("a", 5u64), ("b", 3)];
        let ranks = assign(&files, 4);
        assert_eq!(ranks.iter().filter(|s| s.is_empty()).count(), 2);
        assert!(assign::<&str>(&[], 3).iter().all(Vec::is_empty));
    }

    #[test]
    fn shuffling_permutes_the_same_share_per_epoch_reproducibly() {
        let files: Vec<(String, u64)> = (0..200).map(|i| (format!("{i:03}"), 10)).collect();
        let spec = |epoch, shuffle| ShareSpec {
            shard: Shard { rank: 1, world: 4 },
            epoch,
            shuffle,
        };
        let plain = share(&files, &spec(0, false));
        let e0 = share(&files, &spec(0, true));
        let e1 = share(&files, &spec(1, true));
        assert_ne!(plain, e0);
        assert_ne!(e0, e1);
        assert_eq!(e0, share(&files, &spec(0, true)));
        for order in [&e0, &e1] {
            let mut sorted = order.clone();
            sorted.sort();
            let mut want = plain.clone();
            want.sort();
            assert_eq!(sorted, want);
        }
        // Without shuffle the epoch changes nothing.
        assert_eq!(plain, share(&files, &spec(9, false)));
    }

    #[test]
    fn tickets_round_trip_and_take_defaults() {
        let (prefix, spec) =
            ShareTicket::parse(br#"{"prefix":"svc/train/","rank":2,"world":4}"#).unwrap();
        assert_eq!(prefix.as_str(), "svc/train");
        assert_eq!(spec.shard, Shard { rank: 2, world: 4 });
        assert_eq!((spec.epoch, spec.shuffle), (0, false));
        let spec = ShareSpec {
            shard: Shard { rank: 1, world: 3 },
            epoch: 7,
            shuffle: true,
        };
        let t = ShareTicket::new(&prefix, &spec);
        assert_eq!(ShareTicket::parse(&t.to_bytes()), Ok((prefix, spec)));
    }

    #[test]
    fn tickets_are_refused_with_what_is_wrong() {
        let refused = |t: &[u8]| ShareTicket::parse(t).unwrap_err();
        assert!(matches!(refused(b"rank 2 of 4"), TicketError::Json(_)));
        assert!(
            matches!(refused(br#"{"prefix":"a","rank":2}"#), TicketError::Json(m) if m.contains("world"))
        );
        assert!(matches!(
            refused(br#"{"prefix":"a","ranks":2,"rank":1,"world":4}"#),
            TicketError::Json(m) if m.contains("ranks")
        ));
        assert!(matches!(
            refused(br#"{"prefix":"a","rank":-1,"world":4}"#),
            TicketError::Json(_)
        ));
        assert_eq!(
            refused(br#"{"prefix":"a","rank":4,"world":4}"#),
            TicketError::Shard(ShardError::RankOutOfRange { rank: 4, world: 4 })
        );
        assert_eq!(
            refused(br#"{"prefix":"a","rank":0,"world":0}"#),
            TicketError::Shard(ShardError::EmptyWorld)
        );
        assert_eq!(
            refused(br#"{"prefix":"/","rank":0,"world":1}"#),
            TicketError::RootPrefix
        );
        assert!(matches!(
            refused(br#"{"prefix":"a/../b","rank":0,"world":1}"#),
            TicketError::Prefix(crate::KeyError::DotSegment { .. })
        ));
        assert!(matches!(
            refused(br#"{"prefix":"a b","rank":0,"world":1}"#),
            TicketError::Prefix(crate::KeyError::BadChar { .. })
        ));
        let long = format!(r#"{{"prefix":"{}","rank":0,"world":1}}"#, "a".repeat(5000));
        assert_eq!(refused(long.as_bytes()), TicketError::TooLong(long.len()));
        // The messages say what a ticket looks like.
        assert!(
            refused(b"{}")
                .to_string()
                .contains(r#""prefix":"svc/data""#)
        );
    }

    #[test]
    fn share_spec_reads_from_json_with_defaults() {
        let spec: ShareSpec = serde_json::from_str(r#"{"rank":2,"world":4}"#).unwrap();
        assert_eq!(spec.shard, Shard { rank: 2, world: 4 });
        assert_eq!((spec.epoch, spec.shuffle), (0, false));
    }
}
