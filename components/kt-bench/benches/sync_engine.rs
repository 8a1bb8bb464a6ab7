//! Criterion benches of the sync engine: scanning (cold and with a warm scan
//! cache), hashing a large file, manifest diffs, and composing a chunked file's
//! root hash. Data comes from a seeded RNG into a temporary directory.
//!
//! `cargo bench -p kt-bench` (samples are few and short on purpose).

use std::fs;
use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kt_sync::chunk::ChunkAssembly;
use kt_sync::scan::hash_file;
use kt_sync::{ScanCache, diff, scan};
use kt_types::{Entry, EntryKind, Hash, Manifest};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

const SEED: u64 = 42;
const TREE_FILES: usize = 2_000;
const TREE_DIRS: usize = 20;
const TREE_FILE_SIZE: usize = 4 << 10;
const HASH_FILE_SIZE: usize = 64 << 20;
const MANIFEST_ENTRIES: usize = 10_000;
const CHUNK_SIZE: u64 = 8 << 20;

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
}

fn write_tree(root: &Path, rng: &mut SmallRng) {
    let mut buf = vec![0u8; TREE_FILE_SIZE];
    for d in 0..TREE_DIRS {
        fs::create_dir_all(root.join(format!("d{d:02}"))).unwrap();
    }
    for i in 0..TREE_FILES {
        rng.fill_bytes(&mut buf);
        fs::write(
            root.join(format!("d{:02}/f{i:05}.bin", i % TREE_DIRS)),
            &buf,
        )
        .unwrap();
    }
}

fn bench_scan(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SmallRng::seed_from_u64(SEED);
    write_tree(dir.path(), &mut rng);
    let mut g = c.benchmark_group("scan_2000_files");
    g.throughput(Throughput::Elements(TREE_FILES as u64));
    g.bench_function("cold", |b| {
        b.iter(|| {
            let mut cache = ScanCache::default();
            let m = scan(dir.path(), &mut cache).unwrap();
            assert_eq!(cache.hashed, TREE_FILES as u64);
            black_box(m)
        })
    });
    let mut cache = ScanCache::default();
    scan(dir.path(), &mut cache).unwrap();
    g.bench_function("warm_cache", |b| {
        b.iter(|| {
            let m = scan(dir.path(), &mut cache).unwrap();
            assert_eq!(cache.hashed, 0, "a warm scan must not re-hash");
            black_box(m)
        })
    });
    g.finish();
}

fn bench_hash_file(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.bin");
    let mut rng = SmallRng::seed_from_u64(SEED);
    let mut f = fs::File::create(&path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..HASH_FILE_SIZE / buf.len() {
        rng.fill_bytes(&mut buf);
        f.write_all(&buf).unwrap();
    }
    drop(f);
    let mut g = c.benchmark_group("hash_file");
    g.throughput(Throughput::Bytes(HASH_FILE_SIZE as u64));
    g.bench_function("64MiB", |b| {
        b.iter(|| black_box(hash_file(&path, HASH_FILE_SIZE as u64).unwrap()))
    });
    g.finish();
}

fn random_hash(rng: &mut SmallRng) -> Hash {
    let mut h = [0u8; 32];
    rng.fill_bytes(&mut h);
    Hash(h)
}

/// A sorted manifest of `n` files in 100 directories.
fn manifest(n: usize, rng: &mut SmallRng) -> Manifest {
    let mut entries = Vec::with_capacity(n + 100);
    for d in 0..100 {
        entries.push(Entry {
            path: format!("d{d:03}"),
            kind: EntryKind::Dir,
            size: 0,
            mode: 0o755,
            mtime: 1_700_000_000,
            mtime_nsec: 0,
            hash: None,
            target: None,
        });
    }
    for i in 0..n {
        entries.push(Entry {
            path: format!("d{:03}/f{i:06}.bin", i % 100),
            kind: EntryKind::File,
            size: 4096,
            mode: 0o644,
            mtime: 1_700_000_000 + i as i64,
            mtime_nsec: rng.random_range(0..1_000_000_000),
            hash: Some(random_hash(rng)),
            target: None,
        });
    }
    let mut m = Manifest {
        entries,
        ..Default::default()
    };
    m.sort();
    m
}

fn bench_diff(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(SEED);
    let have = manifest(MANIFEST_ENTRIES, &mut rng);
    // The same tree with 1% of its files changed.
    let mut want = have.clone();
    let files: Vec<usize> = (0..want.entries.len())
        .filter(|&i| want.entries[i].kind == EntryKind::File)
        .collect();
    for &i in rand::seq::index::sample(&mut rng, files.len(), MANIFEST_ENTRIES / 100)
        .iter()
        .map(|k| &files[k])
    {
        want.entries[i].hash = Some(random_hash(&mut rng));
    }
    let mut g = c.benchmark_group("diff_10000_entries");
    g.throughput(Throughput::Elements(MANIFEST_ENTRIES as u64));
    g.bench_function("changed_files", |b| {
        b.iter(|| {
            let d = diff::changed_files(black_box(&want), black_box(&have));
            assert_eq!(d.len(), MANIFEST_ENTRIES / 100);
            d
        })
    });
    g.bench_function("against_base", |b| {
        b.iter(|| {
            let d = diff::against_base(black_box(&want), Some(black_box(&have)));
            assert_eq!(d.needed.len(), MANIFEST_ENTRIES / 100);
            d.needed.len()
        })
    });
    g.finish();
}

fn bench_chunk_root(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(SEED);
    let mut g = c.benchmark_group("chunk_root");
    // 1 GiB and 64 GiB files in 8 MiB chunks; chaining values stand in for data.
    for chunks in [128u64, 8192] {
        let size = chunks * CHUNK_SIZE;
        let cvs: Vec<[u8; 32]> = (0..chunks)
            .map(|_| {
                let mut cv = [0u8; 32];
                rng.fill_bytes(&mut cv);
                cv
            })
            .collect();
        g.throughput(Throughput::Elements(chunks));
        g.bench_function(format!("{chunks}_chunks"), |b| {
            b.iter_batched(
                || ChunkAssembly::new(size, CHUNK_SIZE),
                |mut asm| {
                    // Out of order, as chunks arrive over parallel streams.
                    for n in (0..chunks).rev() {
                        asm.add_cv(n, cvs[n as usize]);
                    }
                    black_box(asm.root().unwrap())
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_scan, bench_hash_file, bench_diff, bench_chunk_root
}
criterion_main!(benches);
