//! GPU data on the NCCL backend against a bare NCCL broadcast of the same
//! bytes (`kt-bench-nccl`, `make bench-nccl`; needs a CUDA GPU and NCCL).
//!
//! Two ranks, each a child process of the bench (CUDA IPC and NCCL want
//! one process per rank; on a machine with one GPU both share it, claiming
//! different hosts through `NCCL_HOSTID` as the GPU tests do), connect once
//! through [`kt_tensor::cuda::CudaBackend`] and time, taking turns:
//!
//! - `packed`: rank 0 sends a state dict of `tensors` device tensors
//!   (the layout of [`crate::tensors::plan_layout`]) to rank 1's
//!   pre-allocated tensors through the transfer engine the node agent runs
//!   ([`kt_tensor::engine::run`]), packed per dtype into buckets through
//!   two alternating staging buffers;
//! - `unpacked`: the same, one `ncclBroadcast` per tensor;
//! - `nccl`: the ceiling, one bare broadcast of one buffer of the same
//!   size over the same communicator.
//!
//! Rank 1 times each run from a two-way barrier (two small broadcasts) to
//! the end of its receive. Every case's destination is zeroed, moved once
//! and compared with the source's contents before the timed runs, so a
//! broken transfer cannot be reported as a fast one.
//!
//! What this leaves out of the agent's path: the control socket, the
//! metadata lookup and the mapping of IPC handles (opened once and cached
//! per handle), all of which happen once per get, not per byte.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use kt_tensor::cuda::{self, CudaBackend, CudaRegion};
use kt_tensor::engine::{self, Lent};
use kt_tensor::{Backend, Comm, Region};
use kt_types::Key;
use kt_types::tensor::{
    BackendKind, Device, Flow, Packing, Rank, TensorDesc, TensorMeta, TransferPlan,
};
use serde::{Deserialize, Serialize};

use crate::tensors::{CaseResult, Dict, PACKED, Results, Spec, UNPACKED, describe, plan_layout};

/// The baseline case: one bare NCCL broadcast of the same bytes.
pub const NCCL: &str = "nccl";
/// Bounds the communicator's set-up and every collective.
const TIMEOUT: Duration = Duration::from_secs(600);
const KEY: &str = "bench/nccl";
/// Where a child finds its part (the parent sets them).
pub const RANK_ENV: &str = kt_types::env::BENCH_NCCL_RANK;
const ID_ENV: &str = kt_types::env::BENCH_NCCL_ID;
const DEVICE_ENV: &str = kt_types::env::BENCH_NCCL_DEVICE;

/// The benchmark's state dict: 4 GiB (256 MiB with `--quick`).
pub const FULL_SIZE: u64 = 4 << 30;
pub const QUICK_SIZE: u64 = 256 << 20;

fn note(msg: impl AsRef<str>) {
    eprintln!("[kt-bench-nccl] {}", msg.as_ref());
}

/// What rank 1 reports to the parent: seconds per case, and collectives.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    packed: Vec<f64>,
    unpacked: Vec<f64>,
    nccl: Vec<f64>,
    packed_collectives: u64,
}

/// Runs the benchmark: spawns the two ranks (this executable again, with
/// [`RANK_ENV`] set, so its `main` must call [`child`] first) and gathers
/// rank 1's timings. Err with the reason where there is no GPU or NCCL.
pub fn run(opts: &Dict) -> anyhow::Result<Results> {
    cuda::probe().map_err(|e| anyhow!("needs a CUDA GPU and NCCL 2.14+: {e}"))?;
    let specs = plan_layout(opts.size, opts.tensors, opts.seed)?;
    note(format!(
        "{} tensors, {}: {}",
        specs.len(),
        crate::size::human(opts.size),
        describe(&specs)
    ));
    let backend = CudaBackend::new().context("the NCCL backend")?;
    let id = backend
        .rendezvous(&plan(&specs, Packing::default()))
        .context("NCCL unique id")?
        .ok_or_else(|| anyhow!("the NCCL backend gave no rendezvous"))?;
    let gpus = cuda::device_count().unwrap_or(1);
    note(if gpus >= 2 {
        "two ranks on cuda:0 and cuda:1".to_owned()
    } else {
        "two ranks sharing cuda:0 (NCCL_HOSTID per rank)".to_owned()
    });
    let options = serde_json::to_string(opts)?;
    let mut children = (0..2u32)
        .map(|rank| spawn(rank, gpus, &id, &options))
        .collect::<anyhow::Result<Vec<Child>>>()?;
    let report = read_report(&mut children[1]);
    let mut failed = Vec::new();
    for (rank, c) in children.iter_mut().enumerate() {
        let status = c.wait().context("waiting for a rank")?;
        if !status.success() {
            failed.push(format!("rank {rank}: {status}"));
        }
    }
    ensure!(failed.is_empty(), "{}", failed.join("; "));
    let report = report?;
    let packed_what = format!(
        "engine, {} collectives (dtype buckets of {}, staged)",
        report.packed_collectives,
        crate::size::human(opts.bucket_bytes)
    );
    let cases = vec![
        CaseResult {
            name: PACKED,
            what: packed_what,
            secs: report.packed,
        },
        CaseResult {
            name: UNPACKED,
            what: format!("engine, {} collectives (one per tensor)", specs.len()),
            secs: report.unpacked,
        },
        CaseResult {
            name: NCCL,
            what: "one bare ncclBroadcast of one buffer".to_owned(),
            secs: report.nccl,
        },
    ];
    Ok(Results {
        bytes: opts.size,
        tensors: specs.len(),
        baseline: NCCL,
        cases,
    })
}

fn spawn(rank: u32, gpus: u32, id: &str, options: &str) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("this executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg(options)
        .env(RANK_ENV, rank.to_string())
        .env(ID_ENV, id)
        .stdin(Stdio::null())
        .stdout(if rank == 1 {
            Stdio::piped()
        } else {
            Stdio::null()
        });
    if gpus >= 2 {
        cmd.env(DEVICE_ENV, rank.to_string());
    } else {
        // NCCL refuses two ranks of one communicator on one GPU unless they
        // claim different hosts; they then talk over the network transport.
        cmd.env(DEVICE_ENV, "0")
            .env("NCCL_HOSTID", format!("kt-bench-nccl-host-{rank}"))
            .env("NCCL_NVLS_ENABLE", "0")
            .env("NCCL_MNNVL_ENABLE", "0");
    }
    cmd.spawn().with_context(|| format!("starting rank {rank}"))
}

/// Rank 1's report: the last line of its standard output.
fn read_report(child: &mut Child) -> anyhow::Result<Report> {
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("rank 1 has no output"))?;
    let mut last = None;
    for line in BufReader::new(out).lines() {
        last = Some(line.context("reading rank 1's report")?);
    }
    let last = last.ok_or_else(|| anyhow!("rank 1 reported nothing (see its errors above)"))?;
    serde_json::from_str(&last).with_context(|| format!("rank 1's report: {last}"))
}

/// In a child process (the parent set [`RANK_ENV`]): runs that rank, with
/// the options the parent passed as the first argument. `None` elsewhere.
pub fn child() -> Option<anyhow::Result<()>> {
    let rank: u32 = std::env::var(RANK_ENV).ok()?.parse().ok()?;
    Some((|| {
        let options = std::env::args()
            .nth(1)
            .ok_or_else(|| anyhow!("no options"))?;
        let opts: Dict = serde_json::from_str(&options).context("options")?;
        let id = std::env::var(ID_ENV).context(ID_ENV)?;
        let dev: u32 = std::env::var(DEVICE_ENV)
            .context(DEVICE_ENV)?
            .parse()
            .context(DEVICE_ENV)?;
        let report = rank_main(rank, dev, &id, &opts)?;
        if let Some(report) = report {
            println!("{}", serde_json::to_string(&report)?);
        }
        Ok(())
    })())
}

/// The plan both ranks run: rank 0 sends the state dict to rank 1.
fn plan(specs: &[Spec], packing: Packing) -> TransferPlan {
    TransferPlan {
        id: "kt-bench-nccl".into(),
        backend: BackendKind::Nccl,
        ranks: (0..2)
            .map(|r| Rank {
                rank: r,
                agent: format!("bench-{r}"),
                member: String::new(),
                node: String::new(),
                ip: "127.0.0.1".into(),
                endpoint: "127.0.0.1".into(),
            })
            .collect(),
        flows: vec![Flow {
            key: Key::parse(KEY).expect("a valid key"),
            version: "v1".into(),
            root: 0,
            receivers: vec![1],
            tensors: specs
                .iter()
                .map(|s| TensorDesc {
                    name: s.name.clone(),
                    meta: TensorMeta::new(s.dtype, s.shape.clone()),
                })
                .collect(),
        }],
        packing,
        fanout: 2,
    }
}

/// Deterministic contents of tensor `i`: 8-byte words of a mix of (seed,
/// i, word).
fn contents(seed: u64, i: usize, len: u64) -> Vec<u8> {
    let base = crate::tensors::mix(seed ^ ((i as u64) << 32));
    let mut out = Vec::with_capacity(len as usize);
    let mut w = 0u64;
    while (out.len() as u64) < len {
        let word = crate::tensors::mix(base ^ w).to_le_bytes();
        let take = (len as usize - out.len()).min(8);
        out.extend_from_slice(&word[..take]);
        w += 1;
    }
    out
}

/// One rank's memory and communicator.
struct RankState {
    rank: u32,
    backend: CudaBackend,
    comm: Box<dyn Comm>,
    plans: [TransferPlan; 2],
    lent: Lent,
    /// The bare case's buffer: the same bytes end to end.
    bare: CudaRegion,
    /// The barrier's word.
    flag: CudaRegion,
    /// Zeros, as large as the largest tensor (and at least 1 MiB).
    zeros: CudaRegion,
    /// Where rank 1 copies a tensor to read it back.
    scratch: CudaRegion,
    size: u64,
}

/// The cases, in [`RankState::once`]'s numbering.
const CASES: [&str; 3] = [PACKED, UNPACKED, NCCL];

impl RankState {
    /// One run of `case` after a barrier: seconds and collectives.
    fn once(&mut self, case: usize) -> anyhow::Result<(f64, u64)> {
        // Both ranks reach this point before either goes on: rank 1
        // broadcasts to rank 0, then rank 0 to rank 1.
        self.comm.broadcast(1, &[0, 1], &mut self.flag, 0, 4)?;
        self.comm.broadcast(0, &[0, 1], &mut self.flag, 0, 4)?;
        let t = Instant::now();
        let collectives = match case {
            0 | 1 => {
                engine::run(
                    &self.backend,
                    &mut *self.comm,
                    &self.plans[case],
                    &mut self.lent,
                )?
                .collectives
            }
            _ => {
                self.comm
                    .broadcast(0, &[0, 1], &mut self.bare, 0, self.size)?;
                1
            }
        };
        Ok((t.elapsed().as_secs_f64(), collectives))
    }

    /// Zeroes every destination (rank 1, before a checked run).
    fn zero(&mut self) -> anyhow::Result<()> {
        let RankState {
            backend,
            lent,
            bare,
            zeros,
            size,
            ..
        } = self;
        for r in lent.keys.values_mut().flatten() {
            let len = r.len();
            backend.copy(r.as_mut(), 0, zeros, 0, len)?;
        }
        let mut at = 0;
        while at < *size {
            let n = (*size - at).min(zeros.len());
            backend.copy(bare, at, zeros, 0, n)?;
            at += n;
        }
        Ok(())
    }

    /// Rank 1's destination of `case` holds the source's contents.
    fn check(&mut self, case: usize, specs: &[Spec], seed: u64) -> anyhow::Result<()> {
        let RankState {
            backend,
            lent,
            bare,
            scratch,
            ..
        } = self;
        let tensors = lent
            .keys
            .values()
            .next()
            .ok_or_else(|| anyhow!("no tensors lent"))?;
        let mut at = 0;
        for (i, (s, r)) in specs.iter().zip(tensors).enumerate() {
            let len = s.nbytes();
            let got = if CASES[case] == NCCL {
                bare.read(at, len)?
            } else {
                backend.copy(scratch, 0, r.as_ref(), 0, len)?;
                scratch.read(0, len)?
            };
            let want = contents(seed, i, len);
            if got != want {
                let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                bail!("tensor {i} ({}) differs at byte {first}", s.name);
            }
            at += len;
        }
        Ok(())
    }
}

/// One rank: allocates, connects, checks each case once, then times them
/// in turns. Rank 1 returns its report.
fn rank_main(rank: u32, dev: u32, id: &str, opts: &Dict) -> anyhow::Result<Option<Report>> {
    let specs = plan_layout(opts.size, opts.tensors, opts.seed)?;
    let backend = CudaBackend::new()?.with_comm_device(dev);
    let device = Device::Cuda(dev);
    let packing = |pack| Packing {
        pack,
        bucket_bytes: opts.bucket_bytes,
    };
    let plans = [plan(&specs, packing(true)), plan(&specs, packing(false))];
    // The state dict: the source's contents on rank 0, zeros on rank 1.
    let mut regions: Vec<Box<dyn Region>> = Vec::with_capacity(specs.len());
    let mut bare = backend.alloc_device(dev, opts.size)?;
    let mut at = 0;
    for (i, s) in specs.iter().enumerate() {
        let mut r = backend.alloc_device(dev, s.nbytes())?;
        if rank == 0 {
            let bytes = contents(opts.seed, i, s.nbytes());
            r.write(0, &bytes)?;
            bare.write(at, &bytes)?;
        }
        at += s.nbytes();
        regions.push(Box::new(r));
    }
    let mut lent = Lent::new(device);
    lent.keys.insert(Key::parse(KEY)?, regions);
    let largest = specs
        .iter()
        .map(Spec::nbytes)
        .max()
        .unwrap_or(0)
        .max(1 << 20);
    let mut zeros = backend.alloc_device(dev, largest)?;
    zeros.write(0, &vec![0; largest as usize])?;
    let ep = backend.endpoint(&plans[0].id, "127.0.0.1")?;
    let started = Instant::now();
    let comm = backend.connect(&plans[0], rank, ep, Some(id), device, TIMEOUT)?;
    if rank == 1 {
        note(format!(
            "connected in {:.2}s",
            started.elapsed().as_secs_f64()
        ));
    }
    let mut st = RankState {
        rank,
        flag: backend.alloc_device(dev, 4)?,
        scratch: backend.alloc_device(dev, largest)?,
        backend,
        comm,
        plans,
        lent,
        bare,
        zeros,
        size: opts.size,
    };

    // Each case once, checked on rank 1 against the source's contents.
    let mut packed_collectives = 0;
    for (case, name) in CASES.iter().enumerate() {
        if st.rank == 1 {
            st.zero()?;
        }
        let (took, collectives) = st.once(case)?;
        if case == 0 {
            packed_collectives = collectives;
        }
        if st.rank == 1 {
            st.check(case, &specs, opts.seed)
                .with_context(|| format!("{name} moved the wrong bytes"))?;
            note(format!("{name}: checked ({took:.3}s)"));
        }
    }
    // Then in turns: warm-up rounds, measured rounds.
    let mut secs = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..opts.warmup + opts.runs {
        for k in 0..CASES.len() {
            let case = (round + k) % CASES.len();
            let (took, _) = st.once(case)?;
            if round >= opts.warmup {
                secs[case].push(took);
            }
        }
    }
    let [packed, unpacked, nccl] = secs;
    Ok((rank == 1).then_some(Report {
        packed,
        unpacked,
        nccl,
        packed_collectives,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_is_valid_and_moves_every_tensor_to_rank_1() {
        let specs = plan_layout(64 << 20, 50, 3).unwrap();
        for pack in [true, false] {
            let p = plan(
                &specs,
                Packing {
                    pack,
                    bucket_bytes: 16 << 20,
                },
            );
            p.validate().unwrap();
            assert_eq!(p.ranks.len(), 2);
            assert_eq!((p.flows[0].root, &p.flows[0].receivers[..]), (0, &[1][..]));
            let bytes: u64 = (p.flows[0].tensors.iter())
                .map(|t| t.meta.nbytes().unwrap())
                .sum();
            assert_eq!(bytes, 64 << 20);
        }
    }

    #[test]
    fn contents_are_deterministic_and_differ_per_tensor() {
        assert_eq!(contents(1, 0, 13), contents(1, 0, 13));
        assert_eq!(contents(1, 0, 13).len(), 13);
        assert_eq!(&contents(1, 0, 32)[..13], &contents(1, 0, 13)[..]);
        assert_ne!(contents(1, 0, 64), contents(1, 1, 64));
        assert_ne!(contents(1, 0, 64), contents(2, 0, 64));
    }

    #[test]
    fn without_a_gpu_the_bench_says_why() {
        if cuda::probe().is_ok() {
            eprintln!("skipping: this machine has a GPU");
            return;
        }
        let e = run(&Dict {
            size: 1 << 20,
            tensors: 4,
            runs: 1,
            warmup: 0,
            seed: 1,
            bucket_bytes: 1 << 20,
        })
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("needs a CUDA GPU and NCCL 2.14+: "), "{e}");
    }
}
