//! GPU data on the host backend against a plain TCP copy of the same bytes.
//!
//! One run moves one state dict (`tensors` tensors, `size` bytes in all,
//! mixed f32/bf16/f16, a few large and many small) from agent A to agent B,
//! both in this process with a metadata server, and times three cases:
//!
//! - `packed`: B's client gets the state dict into a pre-allocated
//!   destination, tensors packed per dtype into buckets of
//!   [`DEFAULT_BUCKET_BYTES`] (or [`Options::bucket_bytes`]);
//! - `unpacked`: the same with one collective per tensor;
//! - `tcp`: the ceiling, a plain TCP copy of the same bytes over loopback
//!   (two threads, the sender gathering the source tensors' bytes into large
//!   vectored writes, the receiver reading into one buffer of the same size,
//!   then a one-byte ack back, as the host backend's broadcast ends).
//!
//! The agent cases are timed as the application sees them: the client's
//! `get_state_dict` call, from request to answer (lookup, session, mapping
//! both sides' memory, the transfer). The TCP case is timed from connect to
//! ack. Each case's destination is checked against the source once, before
//! the timed runs, so a broken transfer cannot be reported as a fast one.
//! Within a run the cases take turns going first.

use std::fmt::Write as _;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use kt_client::tensor::{HostTensor, StateDict, TensorClient, TensorOptions, layout};
use kt_service::Token;
use kt_types::Key;
use kt_types::tensor::{DEFAULT_BUCKET_BYTES, DType, Packing, TensorStats};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::report::median;
use crate::scratch::ScratchDir;
use crate::size::human;

const TOKEN: &str = "bench";
const KEY: &str = "bench/tensors";
/// Largest single write or read of the TCP copy.
const PIECE: usize = 4 << 20;
/// Bounds each agent transfer, and each socket operation of the TCP copy.
const TIMEOUT: Duration = Duration::from_secs(300);

/// What to measure, and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// Parent of the work directory, whose `shm/` holds the tensors and is
    /// both agents' shared-memory directory (tmpfs: `/dev/shm`).
    pub dir: PathBuf,
    /// Bytes of the state dict (a multiple of 4).
    pub size: u64,
    pub tensors: usize,
    /// Measured runs per case; the median is reported.
    pub runs: usize,
    /// Untimed runs per case before the measured ones.
    pub warmup: usize,
    /// Seed of the layout and of the contents.
    pub seed: u64,
    /// Largest bucket of the packed case.
    pub bucket_bytes: u64,
}

impl Options {
    /// The state dict `d`, its work directory under `dir`.
    pub fn of(dir: impl Into<PathBuf>, d: Dict) -> Self {
        Options {
            dir: dir.into(),
            size: d.size,
            tensors: d.tensors,
            runs: d.runs,
            warmup: d.warmup,
            seed: d.seed,
            bucket_bytes: d.bucket_bytes,
        }
    }

    /// The benchmark: 1 GiB in 500 tensors, 3 runs after 1 warm-up.
    pub fn full(dir: impl Into<PathBuf>) -> Self {
        Options {
            dir: dir.into(),
            size: 1 << 30,
            tensors: 500,
            runs: 3,
            warmup: 1,
            seed: 1,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }

    /// A smoke test: 64 MiB in 100 tensors, one run, no warm-up.
    pub fn quick(dir: impl Into<PathBuf>) -> Self {
        Options {
            size: 64 << 20,
            tensors: 100,
            runs: 1,
            warmup: 0,
            ..Options::full(dir)
        }
    }
}

/// The flags both state-dict benchmarks take (`kt-bench-tensors`,
/// `kt-bench-nccl`); each has its own defaults.
#[derive(Debug, Clone, clap::Args)]
pub struct DictArgs {
    /// Total bytes of the state dict, a multiple of 4 (K, M, G, T suffixes
    /// are binary) [default: the benchmark's; smaller with --quick].
    #[arg(long, value_parser = crate::size::parse_size)]
    pub size: Option<u64>,
    /// Tensors in the state dict [default: 500; 100 with --quick].
    #[arg(long)]
    pub tensors: Option<usize>,
    /// Measured runs per case; the median is reported [default: 3; 1 with
    /// --quick].
    #[arg(long)]
    pub runs: Option<usize>,
    /// Untimed warm-up runs per case [default: 1; 0 with --quick].
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Seed of the layout and the contents.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Largest bucket of the packed case (a tensor larger goes alone).
    #[arg(long, default_value = "256MiB", value_parser = crate::size::parse_size)]
    pub bucket: u64,
    /// A smoke test: smaller defaults (fewer bytes, 100 tensors, 1 run, no
    /// warm-up); flags given still win.
    #[arg(long)]
    pub quick: bool,
}

/// A state dict benchmark's size and runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Dict {
    pub size: u64,
    pub tensors: usize,
    pub runs: usize,
    pub warmup: usize,
    pub seed: u64,
    pub bucket_bytes: u64,
}

impl DictArgs {
    /// The flags given, else the benchmark's `full` or (with `--quick`)
    /// `quick` sizes: 500 tensors, 3 runs after 1 warm-up, or 100
    /// tensors, 1 run, no warm-up.
    pub fn resolve(&self, full: u64, quick: u64) -> Dict {
        let (size, tensors, runs, warmup) = if self.quick {
            (quick, 100, 1, 0)
        } else {
            (full, 500, 3, 1)
        };
        Dict {
            size: self.size.unwrap_or(size),
            tensors: self.tensors.unwrap_or(tensors),
            runs: self.runs.unwrap_or(runs),
            warmup: self.warmup.unwrap_or(warmup),
            seed: self.seed,
            bucket_bytes: self.bucket,
        }
    }
}

/// Progress notes go to stderr; results are returned.
fn note(msg: impl AsRef<str>) {
    eprintln!("[kt-bench] {}", msg.as_ref());
}

// ---- the layout -----------------------------------------------------------

/// One tensor of the benchmark's state dict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl Spec {
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) for (seed, i, what).
fn draw(seed: u64, i: usize, what: u64) -> f64 {
    let z = mix(mix(seed ^ 0x7465_6e73_6f72_7321) ^ mix(((i as u64) << 8) | what));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Column counts tried, largest first, for a 2-D shape.
const COLS: [u64; 10] = [4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8];

/// `[rows, cols]` with the widest of [`COLS`] that divides `elements`
/// (at least two rows), else `[elements]`.
fn shape_of(elements: u64) -> Vec<u64> {
    COLS.iter()
        .find(|c| elements.is_multiple_of(**c) && elements / **c >= 2)
        .map(|c| vec![elements / c, *c])
        .unwrap_or_else(|| vec![elements])
}

/// A deterministic state dict of `tensors` tensors totalling exactly `size`
/// bytes, like a model's: sizes log-uniform over five decades (so a few
/// large tensors hold most of the bytes and many are small), dtypes mixed
/// (half bf16, 30% f32, 20% f16).
pub fn plan_layout(size: u64, tensors: usize, seed: u64) -> anyhow::Result<Vec<Spec>> {
    ensure!(tensors >= 1, "at least one tensor");
    ensure!(
        size.is_multiple_of(4),
        "the size ({size} bytes) must be a multiple of 4 (every dtype's element must fit)"
    );
    let n = tensors as u64;
    ensure!(
        size >= 4 * n,
        "{} is too small for {tensors} tensors (at least 4 bytes each)",
        human(size)
    );
    // Sizes move in units of up to 256 bytes (64 f32 elements), so most
    // tensors get 2-D shapes; every tensor has at least one unit.
    let unit = [256u64, 128, 64, 32, 16, 8, 4]
        .into_iter()
        .find(|u| size.is_multiple_of(*u) && size / u >= n)
        .expect("4 divides size and size >= 4n");
    let spare = size / unit - n;
    let weights: Vec<f64> = (0..tensors)
        .map(|i| 10f64.powf(5.0 * draw(seed, i, 0)))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut units: Vec<u64> = weights
        .iter()
        .map(|w| 1 + (spare as f64 * w / total).floor() as u64)
        .collect();
    // What rounding left (or, by float error, overshot) goes to the largest.
    let largest = (0..tensors)
        .max_by(|a, b| weights[*a].total_cmp(&weights[*b]))
        .expect("at least one");
    let assigned: u64 = units.iter().sum();
    let want = size / unit;
    if assigned <= want {
        units[largest] += want - assigned;
    } else {
        let over = assigned - want;
        ensure!(
            units[largest] > over,
            "layout rounding went wrong ({over} units over)"
        );
        units[largest] -= over;
    }
    let specs: Vec<Spec> = units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let d = draw(seed, i, 1);
            let dtype = if d < 0.5 {
                DType::Bf16
            } else if d < 0.8 {
                DType::F32
            } else {
                DType::F16
            };
            let elements = u * unit / dtype.size();
            Spec {
                name: format!("layers.{i}.{dtype}"),
                dtype,
                shape: shape_of(elements),
            }
        })
        .collect();
    let sum: u64 = specs.iter().map(Spec::nbytes).sum();
    ensure!(sum == size, "layout of {sum} bytes, wanted {size}");
    Ok(specs)
}

/// One line about a layout: dtypes, largest and smallest tensors.
pub fn describe(specs: &[Spec]) -> String {
    let mut out = String::new();
    for d in [DType::F32, DType::Bf16, DType::F16] {
        let of: Vec<&Spec> = specs.iter().filter(|s| s.dtype == d).collect();
        if !of.is_empty() {
            let bytes: u64 = of.iter().map(|s| s.nbytes()).sum();
            let _ = write!(out, "{d}: {} tensors ({}); ", of.len(), human(bytes));
        }
    }
    let mut sizes: Vec<u64> = specs.iter().map(Spec::nbytes).collect();
    sizes.sort_unstable();
    let big = sizes.iter().rev().take(10).sum::<u64>();
    let total: u64 = sizes.iter().sum();
    let under_1m = sizes.iter().filter(|s| **s < 1 << 20).count();
    let _ = write!(
        out,
        "largest {}, smallest {}, the 10 largest hold {:.0}%, {under_1m} under 1 MiB",
        human(*sizes.last().unwrap_or(&0)),
        human(*sizes.first().unwrap_or(&0)),
        100.0 * big as f64 / total.max(1) as f64
    );
    out
}

// ---- results --------------------------------------------------------------

/// The timings of one case, in seconds, one per measured run.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    pub name: &'static str,
    /// How it moved, for the table.
    pub what: String,
    pub secs: Vec<f64>,
}

impl CaseResult {
    pub fn median(&self) -> f64 {
        median(&self.secs)
    }
}

/// Every case of one benchmark run, on the same bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Results {
    pub bytes: u64,
    pub tensors: usize,
    /// The case the others are compared with (the peer run on the same
    /// bytes): [`TCP`] here, [`crate::nccl::NCCL`] on a GPU.
    pub baseline: &'static str,
    pub cases: Vec<CaseResult>,
}

pub const PACKED: &str = "packed";
pub const UNPACKED: &str = "unpacked";
pub const TCP: &str = "tcp";

fn runs(xs: &[f64]) -> String {
    xs.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Results {
    pub fn case(&self, name: &str) -> Option<&CaseResult> {
        self.cases.iter().find(|c| c.name == name)
    }

    /// GiB/s of a median of `secs`.
    pub fn gib_per_s(&self, secs: f64) -> f64 {
        self.bytes as f64 / f64::from(1u32 << 30) / secs
    }

    fn median_of(&self, name: &str) -> f64 {
        self.case(name).map_or(f64::NAN, CaseResult::median)
    }

    /// The table: per case, median seconds, GiB/s, every run, what moved.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>10} {:>8}  {:<24} what",
            "case", "median (s)", "GiB/s", "runs (s)"
        );
        for c in &self.cases {
            let m = c.median();
            let _ = writeln!(
                out,
                "{:<10} {:>10.3} {:>8.2}  {:<24} {}",
                c.name,
                m,
                self.gib_per_s(m),
                runs(&c.secs),
                c.what
            );
        }
        out
    }

    /// `ratio packed_vs_B=R unpacked_vs_B=R packed_vs_unpacked=R
    /// per_tensor_overhead_us=X` for the baseline B: throughput ratios (the
    /// first case's throughput over the second's), and (unpacked - packed) /
    /// tensors.
    pub fn ratio_line(&self) -> String {
        let (p, u, t) = (
            self.median_of(PACKED),
            self.median_of(UNPACKED),
            self.median_of(self.baseline),
        );
        let per_tensor_us = (u - p) / self.tensors as f64 * 1e6;
        let b = self.baseline;
        format!(
            "ratio packed_vs_{b}={:.2} unpacked_vs_{b}={:.2} packed_vs_unpacked={:.2} per_tensor_overhead_us={:.1}",
            t / p,
            t / u,
            u / p,
            per_tensor_us
        )
    }
}

// ---- the servers ----------------------------------------------------------

/// A metadata server and two node agents (A holds, B gets), in this
/// process; told to stop when dropped.
#[derive(Debug)]
struct Servers {
    metadata_url: String,
    sockets: [PathBuf; 2],
    shutdown: CancellationToken,
    _stop_on_drop: DropGuard,
    metadata: JoinHandle<Result<(), kt_metadata::MetadataError>>,
    agents: Vec<JoinHandle<Result<(), kt_agent::AgentError>>>,
}

impl Servers {
    async fn start(work: &Path, shm: &Path) -> anyhow::Result<Self> {
        let token = Token::new(TOKEN)?;
        let shutdown = CancellationToken::new();
        let stop_on_drop = shutdown.clone().drop_guard();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the metadata server")?;
        let metadata_url = format!("http://{}", listener.local_addr()?);
        let metadata = tokio::spawn(kt_metadata::run(
            listener,
            kt_metadata::Config::new(work.join("metadata"), token.clone()),
            shutdown.clone(),
        ));
        let mut agents = Vec::new();
        let mut sockets = Vec::new();
        for id in ["agent-a", "agent-b"] {
            let socket = work.join(id).join("agent.sock");
            let mut cfg =
                kt_agent::Config::new(id, metadata_url.clone(), token.clone(), socket.clone());
            cfg.shm_dir = shm.to_owned();
            cfg.tensor_timeout = TIMEOUT;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .with_context(|| format!("binding {id}"))?;
            let handle = kt_agent::start(listener, cfg, shutdown.clone())
                .with_context(|| format!("starting {id}"))?;
            agents.push(handle.task);
            sockets.push(socket);
        }
        let sockets: [PathBuf; 2] = sockets.try_into().expect("two agents");
        Ok(Servers {
            metadata_url,
            sockets,
            shutdown,
            _stop_on_drop: stop_on_drop,
            metadata,
            agents,
        })
    }

    async fn client(&self, agent: usize) -> anyhow::Result<TensorClient> {
        let socket = &self.sockets[agent];
        TensorClient::connect(socket, &self.metadata_url, TOKEN)
            .await
            .with_context(|| format!("connecting to the agent at {}", socket.display()))
    }

    /// Stops every server and reports their errors.
    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let mut errors = Vec::new();
        for a in self.agents {
            match a.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => errors.push(format!("agent: {e}")),
                Err(e) => errors.push(format!("agent task: {e}")),
            }
        }
        match self.metadata.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(format!("metadata server: {e}")),
            Err(e) => errors.push(format!("metadata server task: {e}")),
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }
}

// ---- the cases ------------------------------------------------------------

fn state_dict(
    shm: &Path,
    specs: &[Spec],
    seed: Option<u64>,
) -> anyhow::Result<StateDict<HostTensor>> {
    let mut sd = StateDict::new();
    for s in specs {
        let mut t = HostTensor::zeros_in(shm, s.dtype, &s.shape)
            .with_context(|| format!("allocating {} in {}", s.name, shm.display()))?;
        if let Some(seed) = seed {
            layout::fill(seed, &s.name, t.bytes_mut());
        }
        sd.push(s.name.clone(), t);
    }
    Ok(sd)
}

/// The first tensor of `got` whose bytes differ from `want`'s.
fn check_same(
    case: &str,
    want: &StateDict<HostTensor>,
    got: &[(&str, &[u8])],
) -> anyhow::Result<()> {
    ensure!(
        want.len() == got.len(),
        "{case}: {} tensors received, {} sent",
        got.len(),
        want.len()
    );
    for ((name, w), (got_name, g)) in want.iter().zip(got) {
        ensure!(name == *got_name, "{case}: got {got_name} where {name} was");
        if let Some(at) = w.bytes().iter().zip(g.iter()).position(|(a, b)| a != b) {
            bail!("{case}: tensor {name} differs from the source at byte {at}");
        }
        ensure!(
            w.bytes().len() == g.len(),
            "{case}: tensor {name} has {} bytes, the source {}",
            g.len(),
            w.bytes().len()
        );
    }
    Ok(())
}

fn packing(pack: bool, bucket_bytes: u64) -> TensorOptions {
    TensorOptions {
        packing: Some(Packing { pack, bucket_bytes }),
        ..TensorOptions::default()
    }
}

/// One get of the state dict into `dest`: its wall time and the agent's stats.
async fn get(
    consumer: &mut TensorClient,
    key: &Key,
    dest: &mut StateDict<HostTensor>,
    pack: bool,
    bucket_bytes: u64,
) -> anyhow::Result<(f64, TensorStats)> {
    let opts = packing(pack, bucket_bytes);
    let started = Instant::now();
    let stats = consumer
        .get_state_dict(key, dest, &opts)
        .await
        .with_context(|| format!("get_state_dict {key} (pack: {pack})"))?;
    Ok((started.elapsed().as_secs_f64(), stats))
}

/// Sends `src` (in order) over one loopback connection into `dest`, then
/// waits for the receiver's ack; the seconds from connect to ack.
fn tcp_copy(src: &[&[u8]], dest: &mut [u8]) -> anyhow::Result<f64> {
    let total: usize = src.iter().map(|s| s.len()).sum();
    ensure!(
        total == dest.len(),
        "TCP copy of {total} bytes into {}",
        dest.len()
    );
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the TCP copy's listener")?;
    let addr = listener.local_addr()?;
    std::thread::scope(|s| {
        let receiver = s.spawn(move || receive(&listener, dest));
        let started = Instant::now();
        let sent = send(addr, src);
        let took = started.elapsed().as_secs_f64();
        if sent.is_err() {
            // Wake the receiver if it still waits in accept().
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
        let received = receiver
            .join()
            .map_err(|_| anyhow!("the TCP receiver panicked"))?;
        sent.context("TCP copy: sending")?;
        received.context("TCP copy: receiving")?;
        Ok(took)
    })
}

fn send(addr: SocketAddr, src: &[&[u8]]) -> std::io::Result<()> {
    let mut conn = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    // Every tensor in pieces of at most PIECE bytes, gathered into writes of
    // many pieces (the kernel takes what its socket buffer holds).
    let mut pieces: Vec<IoSlice<'_>> = src
        .iter()
        .flat_map(|t| t.chunks(PIECE))
        .map(IoSlice::new)
        .collect();
    let mut bufs = &mut pieces[..];
    while !bufs.is_empty() {
        let batch = bufs.len().min(512);
        let n = conn.write_vectored(&bufs[..batch])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    let mut ack = [0u8; 1];
    conn.read_exact(&mut ack)?;
    if ack[0] != 0xac {
        return Err(std::io::Error::other("the receiver answered garbage"));
    }
    Ok(())
}

fn receive(listener: &TcpListener, dest: &mut [u8]) -> std::io::Result<()> {
    let (mut conn, _) = listener.accept()?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    for piece in dest.chunks_mut(PIECE) {
        conn.read_exact(piece)?;
    }
    conn.write_all(&[0xac])
}

/// Touches every page of `buf` (a fresh allocation maps zero pages lazily).
fn touch(buf: &mut [u8]) {
    for page in buf.chunks_mut(4096) {
        page[0] = 1;
    }
}

/// Generates the state dict, starts the servers, measures every case and
/// cleans up (the work directory and the servers go away on error too).
/// Needs a multi-threaded tokio runtime (the TCP copy blocks in place).
pub async fn run(opts: &Options) -> anyhow::Result<Results> {
    ensure!(opts.runs >= 1, "--runs must be at least 1");
    Packing {
        pack: true,
        bucket_bytes: opts.bucket_bytes,
    }
    .validate()
    .map_err(|e| anyhow!("--bucket: {e}"))?;
    let specs = plan_layout(opts.size, opts.tensors, opts.seed)?;
    note(format!(
        "{} tensors, {}: {}",
        specs.len(),
        human(opts.size),
        describe(&specs)
    ));
    note(format!(
        "{} warm-up and {} measured runs per case",
        opts.warmup, opts.runs
    ));
    let scratch = ScratchDir::create(&opts.dir)?;
    let shm = scratch.subdir("shm")?;
    let work = scratch.subdir("servers")?;
    note(format!("work directory {}", scratch.path().display()));

    let started = Instant::now();
    let source = state_dict(&shm, &specs, Some(opts.seed))?;
    let mut dest = state_dict(&shm, &specs, None)?;
    let mut plain = vec![0u8; usize::try_from(opts.size)?];
    touch(&mut plain);
    note(format!(
        "source filled, destinations allocated in {:.1}s",
        started.elapsed().as_secs_f64()
    ));

    let servers = Servers::start(&work, &shm).await?;
    let outcome = measure(opts, &servers, &specs, &source, &mut dest, &mut plain).await;
    let stopped = servers.stop().await;
    drop((source, dest, plain));
    drop(scratch);
    let results = outcome?;
    stopped?;
    Ok(results)
}

async fn measure(
    opts: &Options,
    servers: &Servers,
    specs: &[Spec],
    source: &StateDict<HostTensor>,
    dest: &mut StateDict<HostTensor>,
    plain: &mut [u8],
) -> anyhow::Result<Results> {
    let key = Key::parse(KEY)?;
    let mut producer = servers.client(0).await?;
    let mut consumer = servers.client(1).await?;
    let put = producer
        .put_state_dict(&key, source, &TensorOptions::default())
        .await
        .context("put_state_dict")?;
    note(format!(
        "registered {KEY} with {} (version {})",
        producer.agent(),
        put.version
    ));
    let src_bytes: Vec<&[u8]> = source.iter().map(|(_, t)| t.bytes()).collect();

    // Once per case, untimed: a transfer into a zeroed destination, checked
    // against the source.
    let mut whats = Vec::new();
    for pack in [true, false] {
        let case = if pack { PACKED } else { UNPACKED };
        for (_, t) in dest.iter_mut() {
            t.bytes_mut().fill(0);
        }
        let (secs, stats) = get(&mut consumer, &key, dest, pack, opts.bucket_bytes).await?;
        ensure!(
            stats.tensors == specs.len() as u64 && stats.bytes == opts.size,
            "{case}: the agent moved {} tensors of {} bytes, expected {} of {}",
            stats.tensors,
            stats.bytes,
            specs.len(),
            opts.size
        );
        let got: Vec<(&str, &[u8])> = dest.iter().map(|(n, t)| (n, t.bytes())).collect();
        check_same(case, source, &got)?;
        note(format!(
            "{case}: checked ({:.3}s, {} collectives)",
            secs, stats.collectives
        ));
        whats.push(if pack {
            format!(
                "agent to agent, {} collectives (dtype buckets of {})",
                stats.collectives,
                human(opts.bucket_bytes)
            )
        } else {
            format!(
                "agent to agent, {} collectives (one per tensor)",
                stats.collectives
            )
        });
    }
    plain.fill(0);
    let took = tokio::task::block_in_place(|| tcp_copy(&src_bytes, plain))?;
    let mut at = 0;
    let got: Vec<(&str, &[u8])> = source
        .iter()
        .map(|(n, t)| {
            let len = t.bytes().len();
            at += len;
            (n, &plain[at - len..at])
        })
        .collect();
    check_same(TCP, source, &got)?;
    note(format!("{TCP}: checked ({took:.3}s)"));
    whats.push("one loopback stream, std TcpStream, two threads".to_owned());

    let mut secs: [Vec<f64>; 3] = Default::default();
    for run in 0..opts.warmup + opts.runs {
        let measured = run >= opts.warmup;
        let mut line = format!(
            "{} {}:",
            if measured { "run" } else { "warm-up" },
            if measured {
                run - opts.warmup + 1
            } else {
                run + 1
            }
        );
        // The cases take turns going first.
        for i in 0..3 {
            let case = (run + i) % 3;
            let took = match case {
                0 => {
                    get(&mut consumer, &key, dest, true, opts.bucket_bytes)
                        .await?
                        .0
                }
                1 => {
                    get(&mut consumer, &key, dest, false, opts.bucket_bytes)
                        .await?
                        .0
                }
                _ => tokio::task::block_in_place(|| tcp_copy(&src_bytes, plain))?,
            };
            let _ = write!(line, " {}={took:.3}s", [PACKED, UNPACKED, TCP][case]);
            if measured {
                secs[case].push(took);
            }
        }
        note(line);
    }
    producer.drop_tensors(&key).await.context("drop_tensors")?;
    let cases = [PACKED, UNPACKED, TCP]
        .into_iter()
        .zip(whats)
        .zip(secs)
        .map(|((name, what), secs)| CaseResult { name, what, secs })
        .collect();
    Ok(Results {
        bytes: opts.size,
        tensors: specs.len(),
        baseline: TCP,
        cases,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_exact_mixed_and_deterministic() {
        for (size, n) in [
            (1u64 << 30, 500),
            (64 << 20, 100),
            (4 << 20, 20),
            (4000, 1000),
        ] {
            let l = plan_layout(size, n, 1).unwrap();
            assert_eq!(l.len(), n);
            assert_eq!(l.iter().map(Spec::nbytes).sum::<u64>(), size, "{size}/{n}");
            assert!(l.iter().all(|s| s.nbytes() > 0));
            assert_eq!(l, plan_layout(size, n, 1).unwrap());
        }
        let l = plan_layout(1 << 30, 500, 1).unwrap();
        for d in [DType::F32, DType::Bf16, DType::F16] {
            assert!(l.iter().any(|s| s.dtype == d), "{d} missing");
        }
        // A few large, many small.
        let mut sizes: Vec<u64> = l.iter().map(Spec::nbytes).collect();
        sizes.sort_unstable();
        assert!(sizes[sizes.len() - 1] > 100 * sizes[sizes.len() / 2]);
        assert!(l.iter().filter(|s| s.shape.len() == 2).count() > 400);
        assert_ne!(l, plan_layout(1 << 30, 500, 2).unwrap());
        assert!(plan_layout(1002, 1, 1).is_err());
        assert!(plan_layout(16, 5, 1).is_err());
        assert!(plan_layout(16, 0, 1).is_err());
    }

    #[test]
    fn the_ratio_line_is_throughput_ratios() {
        let r = Results {
            bytes: 1 << 30,
            tensors: 500,
            baseline: TCP,
            cases: vec![
                CaseResult {
                    name: PACKED,
                    what: String::new(),
                    secs: vec![1.0, 0.5, 2.0],
                },
                CaseResult {
                    name: UNPACKED,
                    what: String::new(),
                    secs: vec![2.0],
                },
                CaseResult {
                    name: TCP,
                    what: String::new(),
                    secs: vec![0.4],
                },
            ],
        };
        assert_eq!(
            r.ratio_line(),
            "ratio packed_vs_tcp=0.40 unpacked_vs_tcp=0.20 packed_vs_unpacked=2.00 per_tensor_overhead_us=2000.0"
        );
        let t = r.table();
        assert_eq!(t.lines().count(), 4, "{t}");
        assert!(t.contains("2.50"), "{t}");
    }
}
