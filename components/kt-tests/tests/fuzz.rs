//! Decoders under fire: every decoder that reads bytes from the network or
//! a socket, fed mutations of valid inputs and random bytes. Each case must
//! end (no hang), without a panic, allocating at most [`ALLOC_LIMIT`] bytes
//! whatever a length prefix says.
//!
//! - `make fuzz` runs every target for `KT_FUZZ_SECONDS` seconds (default
//!   30), from `KT_FUZZ_SEED` (default: the clock; printed, so a failure can
//!   be run again), and prints the cases each ran.
//! - `make test` runs a short pass of each (a fixed seed, 1,500 cases), so
//!   the targets stay alive.
//!
//! Mutations are structure-blind (bit flips, random bytes, cuts, inserts,
//! copies of a piece elsewhere) plus length-aware ones: 32- and 64-bit
//! values that lie (0, 1, 2^31, 2^32-1, 2^63, u64::MAX…) written over any
//! offset in both byte orders, which is what a length prefix meets.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kt_types::codec;
use kt_types::manifest::{Entry, EntryKind, Manifest, ManifestLimits, RootKind};
use kt_types::tensor::{self as t, DType, Device, MemHandle, TensorEntry, TensorMeta};

// ---- allocation accounting --------------------------------------------------

/// Most bytes one case may have allocated at once beyond what was live
/// before it.
const ALLOC_LIMIT: usize = 64 << 20;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Whether a case runs (its peak is being measured). Allocations of every
/// thread count while it does, a decoder's helper threads included; the
/// fuzz runs of this binary take turns ([`TURN`]) so that one run's
/// allocations never count against another's case.
static COUNTING: AtomicBool = AtomicBool::new(false);

/// One fuzz run at a time in this process (libtest runs tests on threads).
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        if COUNTING.load(Ordering::Relaxed) {
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        if new > layout.size() {
            let live = LIVE.fetch_add(new - layout.size(), Ordering::Relaxed) + new - layout.size();
            if COUNTING.load(Ordering::Relaxed) {
                PEAK.fetch_max(live, Ordering::Relaxed);
            }
        } else {
            LIVE.fetch_sub(layout.size() - new, Ordering::Relaxed);
        }
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

// ---- inputs -----------------------------------------------------------------

/// xorshift64*: small, seeded, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const LIES: [u64; 10] = [
    0,
    1,
    0x7f,
    0xffff,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    1 << 63,
    u64::MAX,
];

/// One mutation of `seed` (several ops), or random bytes.
fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    if rng.below(16) == 0 {
        let n = rng.below(512);
        return (0..n).map(|_| rng.next() as u8).collect();
    }
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(8) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(at),
            3 => {
                let n = rng.below(64);
                let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, junk);
            }
            4 if !v.is_empty() => {
                let end = (at + rng.below(64)).min(v.len());
                v.drain(at.min(end)..end);
            }
            5 if !v.is_empty() => {
                // A piece copied elsewhere (repeated records).
                let from = rng.below(v.len());
                let end = (from + rng.below(128)).min(v.len());
                let piece = v[from..end].to_vec();
                let at = rng.below(v.len() + 1);
                v.splice(at..at, piece);
            }
            _ => {
                // A lying length: 4 or 8 bytes, either order.
                let lie = LIES[rng.below(LIES.len())];
                let bytes: Vec<u8> = match rng.below(4) {
                    0 => (lie as u32).to_le_bytes().to_vec(),
                    1 => (lie as u32).to_be_bytes().to_vec(),
                    2 => lie.to_le_bytes().to_vec(),
                    _ => lie.to_be_bytes().to_vec(),
                };
                let at = at.min(v.len().saturating_sub(bytes.len()));
                for (i, b) in bytes.into_iter().enumerate() {
                    if at + i < v.len() {
                        v[at + i] = b;
                    } else {
                        v.push(b);
                    }
                }
            }
        }
    }
    v
}

// ---- the harness ------------------------------------------------------------

/// How long a case may run before the watchdog calls it a hang.
const HANG: Duration = Duration::from_secs(10);

struct Target {
    name: &'static str,
    seeds: Vec<Vec<u8>>,
    run: fn(&[u8]),
}

/// Runs `target` for `cases` cases or until `until`: the cases run and the
/// largest allocation peak of one case.
fn fuzz(target: &Target, seed: u64, cases: u64, until: Option<Instant>) -> (u64, usize) {
    // A run that failed (a caught panic) poisons the lock; the next may go.
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let mut rng = Rng(seed | 1);
    let started = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let clock = Instant::now();
    // The watchdog: a case that runs past HANG ends the process, naming it.
    let _watchdog = {
        let (started, stop, name) = (started.clone(), done.clone(), target.name);
        let handle = std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let at = started.load(Ordering::Relaxed);
                let now = clock.elapsed().as_millis() as u64 + 1;
                if at != 0 && now.saturating_sub(at) > HANG.as_millis() as u64 {
                    eprintln!("fuzz {name}: a case ran past {HANG:?} (a hang); seed {seed}");
                    std::process::abort();
                }
            }
        });
        // Stopped and joined however the run ends (a failed case panics).
        Stop(done.clone(), Some(handle))
    };
    let (mut n, mut worst) = (0u64, 0usize);
    while n < cases && until.is_none_or(|u| Instant::now() < u) {
        let base = &target.seeds[rng.below(target.seeds.len())];
        let input = mutate(base, &mut rng);
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        started.store(clock.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        COUNTING.store(true, Ordering::Relaxed);
        let outcome = std::panic::catch_unwind(|| (target.run)(&input));
        COUNTING.store(false, Ordering::Relaxed);
        started.store(0, Ordering::Relaxed);
        let grew = PEAK.load(Ordering::Relaxed).saturating_sub(before);
        worst = worst.max(grew);
        let shown: Vec<u8> = input.iter().take(256).copied().collect();
        assert!(
            outcome.is_ok(),
            "fuzz {}: a panic on case {n} (seed {seed}), input starts {shown:02x?}",
            target.name
        );
        assert!(
            grew <= ALLOC_LIMIT,
            "fuzz {}: case {n} (seed {seed}) allocated {grew} bytes, over {ALLOC_LIMIT}; input starts {shown:02x?}",
            target.name
        );
        n += 1;
    }
    (n, worst)
}

/// Ends the watchdog of a fuzz run when dropped.
struct Stop(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        if let Some(h) = self.1.take() {
            let _ = h.join();
        }
    }
}

// ---- targets ----------------------------------------------------------------

fn sample_manifest() -> Manifest {
    let file = |path: &str, size: u64| Entry {
        path: path.into(),
        kind: EntryKind::File,
        size,
        mode: 0o644,
        mtime: 1_700_000_000,
        mtime_nsec: 5,
        hash: Some(kt_types::Hash([7; 32])),
        target: None,
    };
    Manifest {
        root: RootKind::Dir,
        entries: vec![
            Entry {
                path: "d".into(),
                kind: EntryKind::Dir,
                size: 0,
                mode: 0o755,
                mtime: 1,
                mtime_nsec: 0,
                hash: None,
                target: None,
            },
            file("d/a.bin", 5),
            file("d/b.txt", 3),
            Entry {
                path: "l".into(),
                kind: EntryKind::Symlink,
                size: 0,
                mode: 0o777,
                mtime: 1,
                mtime_nsec: 0,
                hash: None,
                target: Some("d/a.bin".into()),
            },
        ],
    }
}

/// The binary manifest codec, then validation (what every server does with
/// a manifest it receives).
fn manifest_codec(b: &[u8]) {
    if let Ok(m) = codec::decode(b) {
        let _ = m.validate(&ManifestLimits::default());
    }
}

/// Documents: a length-prefixed JSON header, then a manifest.
fn document(b: &[u8]) {
    if let Ok((h, rest)) = codec::split_document::<serde_json::Value>(b) {
        let _ = h;
        manifest_codec(rest);
    }
}

/// The agent's control protocol: a 4-byte length, then a JSON request or
/// reply (both ends parse).
fn control_frame(b: &[u8]) {
    let Some(head) = b.get(..4) else { return };
    let Ok(n) = kt_types::agent::frame_len(head.try_into().unwrap_or_default()) else {
        return;
    };
    let body = &b[4..];
    // A reader grows its buffer as bytes arrive (never `n` up front).
    let body = &body[..n.min(body.len())];
    let _ = serde_json::from_slice::<kt_types::agent::ControlRequest>(body);
    let _ = serde_json::from_slice::<kt_types::agent::ControlReply>(body);
}

/// Quorum, session, tensor and broadcast bodies, each parsed and checked
/// as the server that receives it does.
fn wire_json(b: &[u8]) {
    if let Ok(j) = serde_json::from_slice::<t::QuorumJoin>(b) {
        for c in &j.comms {
            for m in &c.members {
                let _ = kt_types::agent_id_problem(m);
            }
        }
    }
    if let Ok(p) = serde_json::from_slice::<t::TransferPlan>(b) {
        let _ = p.validate();
    }
    if let Ok(s) = serde_json::from_slice::<t::SessionRequest>(b) {
        for k in &s.keys {
            let _ = t::check_destination(&k.key, &k.tensors, &k.tensors);
        }
    }
    if let Ok(p) = serde_json::from_slice::<t::PutTensors>(b) {
        let _ = t::validate_entries(&p.tensors);
    }
    if let Ok(g) = serde_json::from_slice::<t::GetTensors>(b) {
        for x in &g.gets {
            let _ = t::validate_entries(&x.dest);
        }
    }
    let _ = serde_json::from_slice::<t::QuorumDone>(b);
    let _ = serde_json::from_slice::<t::Rendezvous>(b);
    let _ = serde_json::from_slice::<kt_types::broadcast::JoinRequest>(b);
    let _ = serde_json::from_slice::<kt_types::broadcast::GetterMessage>(b);
    let _ = serde_json::from_slice::<kt_types::broadcast::GroupMessage>(b);
    let _ = serde_json::from_slice::<kt_types::api::AgentHeartbeat>(b);
    let _ = serde_json::from_slice::<kt_types::api::RegisterKey>(b);
    let _ = serde_json::from_slice::<kt_types::api::PutRequest>(b);
}

fn json_seeds() -> Vec<Vec<u8>> {
    let entry = TensorEntry {
        name: "w".into(),
        meta: TensorMeta::new(DType::F32, [4, 4]),
        device: Device::Cuda(0),
        mem: MemHandle::CudaIpc {
            handle: "00".repeat(64),
            offset: 0,
            len: 64,
            device_uuid: None,
        },
    };
    let key = kt_types::Key::parse("team/w").unwrap();
    let mut out = vec![
        serde_json::to_vec(&t::GetTensors {
            gets: vec![t::TensorGet {
                key: key.clone(),
                dest: vec![entry.clone()],
                from: None,
                more: Vec::new(),
            }],
            broadcast: None,
            packing: None,
            keep_mapped: true,
            member: None,
        })
        .unwrap(),
        br#"{"agent":"pod-1","ip":"10.0.0.1","endpoint":"10.0.0.1:1","backend":"nccl","role":"get","keys":[{"key":"k","version":"","tensors":[{"name":"w","dtype":"f32","shape":[4,4]}]}],"window":{"world_size":2,"fanout":2},"comms":[{"id":"t1","members":["pod-0","pod-1"]}]}"#.to_vec(),
        br#"{"id":"t","backend":"nccl","ranks":[{"rank":0,"agent":"a","ip":"1.2.3.4","endpoint":"e"},{"rank":1,"agent":"b","ip":"1.2.3.5","endpoint":"e"}],"flows":[{"key":"k","version":"v","root":0,"receivers":[1],"tensors":[{"name":"w","dtype":"f32","shape":[1024,1024,1024,1024]}]}],"packing":{"pack":true,"bucket_bytes":1048576},"fanout":1}"#.to_vec(),
        br#"{"rank":3,"error":"x","stats":{"tensors":1,"bytes":2,"collectives":3,"seconds":0.5,"backend":"nccl","reused":true}}"#.to_vec(),
    ];
    out.push(
        serde_json::to_vec(&kt_types::tensor::Rendezvous {
            blob: "ab".repeat(128),
        })
        .unwrap(),
    );
    out
}

/// A batch frame stream into a tree (what a getter does with a source's
/// answer): only the expected indices, each once, with its size; nothing
/// written outside the destination.
fn batch_stream(b: &[u8]) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let m = sample_manifest();
    let expected: HashMap<u32, kt_sync::batch::Expected> = m
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == EntryKind::File)
        .map(|(i, e)| {
            let mut e = e.clone();
            let content: &[u8] = if e.size == 5 { b"hello" } else { b"abc" };
            e.hash = Some(kt_types::Hash(*blake3::hash(content).as_bytes()));
            (
                i as u32,
                kt_sync::batch::Expected {
                    dest: dir.path().join(e.path.replace('/', "_")),
                    entry: e,
                },
            )
        })
        .collect();
    // Cut into pieces where the bytes say, as a network would.
    let mut pieces = Vec::new();
    let mut rest = b;
    while !rest.is_empty() {
        let n = (usize::from(rest[0]) + 1).min(rest.len());
        pieces.push(Ok::<_, std::io::Error>(Bytes::copy_from_slice(&rest[..n])));
        rest = &rest[n..];
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let _ = rt.block_on(kt_sync::batch::receive_stream(
        futures::stream::iter(pieces),
        Arc::new(expected),
        kt_sync::apply::WriteMode::Direct,
        None,
    ));
    for f in std::fs::read_dir(dir.path()).expect("the temp dir") {
        let name = f.expect("an entry").file_name();
        assert!(
            ["d_a.bin", "d_b.txt"].contains(&name.to_string_lossy().as_ref())
                || name.to_string_lossy().starts_with('.'),
            "the stream wrote {name:?}"
        );
    }
}

fn batch_seed() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&kt_types::frame::encode(1, 5));
    v.extend_from_slice(b"hello");
    v.extend_from_slice(&kt_types::frame::encode(2, 3));
    v.extend_from_slice(b"abc");
    v.extend_from_slice(&kt_types::frame::encode_end());
    v
}

fn targets() -> Vec<Target> {
    let m = sample_manifest();
    let mut single = m.clone();
    single.root = RootKind::File;
    single.entries = vec![m.entries[1].clone()];
    let frame = |req: &kt_types::agent::ControlRequest| kt_types::agent::encode_frame(req).unwrap();
    vec![
        Target {
            name: "manifest_codec",
            seeds: vec![
                codec::to_bytes(&m),
                codec::to_bytes(&single),
                codec::to_bytes(&Manifest::default()),
            ],
            run: manifest_codec,
        },
        Target {
            name: "document",
            seeds: vec![codec::encode_document(
                &serde_json::json!({ "key": "team/x", "version": "v1", "chunk_size": 8388608 }),
                &m,
            )],
            run: document,
        },
        Target {
            name: "control_frame",
            seeds: vec![
                frame(&kt_types::agent::ControlRequest::Hello {
                    version: 2,
                    keepalive: true,
                }),
                kt_types::agent::encode_frame(&serde_json::json!({
                    "op": "export_copy", "key": "team/x", "version": "v", "path": "/data/x",
                    "manifest": { "root": "dir", "entries": [] }
                }))
                .unwrap(),
            ],
            run: control_frame,
        },
        Target {
            name: "wire_json",
            seeds: json_seeds(),
            run: wire_json,
        },
        Target {
            name: "batch_stream",
            seeds: vec![batch_seed()],
            run: batch_stream,
        },
    ]
}

fn seed_from_env() -> u64 {
    std::env::var(kt_types::env::FUZZ_SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
}

/// The harness fails a decoder that trusts a length prefix, or panics.
#[test]
fn the_harness_catches_a_lying_length_and_a_panic() {
    fn trusting(b: &[u8]) {
        let Some(head) = b.get(..4) else { return };
        let n = u32::from_le_bytes(head.try_into().unwrap()) as usize;
        let v: Vec<u8> = Vec::with_capacity(n.min(1 << 30));
        std::hint::black_box(v);
    }
    fn panicking(b: &[u8]) {
        assert!(b.len() != 4, "four bytes");
    }
    let seeds = vec![vec![4, 0, 0, 0, 1, 2, 3, 4]];
    for (name, run, what) in [
        ("trusting", trusting as fn(&[u8]), "allocated"),
        ("panicking", panicking as fn(&[u8]), "a panic"),
    ] {
        let target = Target {
            name,
            seeds: seeds.clone(),
            run,
        };
        let caught = std::panic::catch_unwind(|| fuzz(&target, 7, 100_000, None))
            .expect_err("the harness let it through");
        let msg = caught.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains(what), "{name}: {msg}");
    }
}

/// The short pass of `make test`: every target, a fixed seed.
#[test]
fn every_decoder_survives_a_short_pass() {
    for target in targets() {
        let (n, worst) = fuzz(&target, 0x6b74_2d66_757a_7a31, 1_500, None);
        assert_eq!(n, 1_500);
        eprintln!(
            "{}: {n} cases, largest allocation {worst} bytes",
            target.name
        );
    }
}

/// `make fuzz`: every target for `KT_FUZZ_SECONDS` (default 30) seconds.
#[test]
#[ignore = "make fuzz runs it (time-bounded)"]
fn every_decoder_survives_a_timed_run() {
    let secs: u64 = std::env::var(kt_types::env::FUZZ_SECONDS)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let seed = seed_from_env();
    eprintln!("fuzz: seed {seed} (KT_FUZZ_SEED={seed} repeats the choices), {secs} s per target");
    let mut lines = Vec::new();
    for target in targets() {
        let until = Instant::now() + Duration::from_secs(secs);
        let (n, worst) = fuzz(&target, seed, u64::MAX, Some(until));
        lines.push(format!(
            "{:<15} {n:>9} cases  0 panics  0 hangs  largest allocation {} (limit {})",
            target.name,
            kt_types::size::human(worst as u64),
            kt_types::size::human(ALLOC_LIMIT as u64)
        ));
    }
    println!("fuzz: seed {seed}, {secs} s per target");
    for l in lines {
        println!("{l}");
    }
}
