//! `kt tensor put|get|ls`: GPU data from the command line, with
//! generated contents (a layout and a seed), for trying kt out, scenarios
//! and benchmarks. Applications use [`kt_client::tensor`] instead.

use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use kt_client::tensor::{HostTensor, Lend, StateDict, TensorClient, TensorOptions, layout};
use kt_types::api::PutOptions;
use kt_types::model::BroadcastWindow;
use kt_types::tensor::{
    self as tensor, DEFAULT_BUCKET_BYTES, DEFAULT_GPU_FANOUT, Device, Packing, ReduceOp, TensorMeta,
};
use kt_types::{Key, Lifespan};
use serde_json::json;

use crate::cli::SummaryFormat;

#[derive(Debug, clap::Args)]
pub struct LayoutArgs {
    /// Tensors: `name=dtype[d0,d1];...`, or one unnamed `dtype[d0,...]`
    /// (dtypes f64 f32 f16 bf16 f8e4m3 f8e5m2 i64 i32 i16 i8 u8 bool).
    #[arg(long)]
    layout: String,
    /// Copies of the layout, names suffixed .0, .1, ... (a state dict).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// cpu (shared memory, host backend) or cuda:N (NCCL backend).
    #[arg(long, default_value = "cpu")]
    device: Device,
}

#[derive(Debug, clap::Args)]
pub struct WindowArgs {
    /// Join a quorum: every putter and getter of the group moves in one
    /// coordinated transfer once it closes.
    #[arg(long)]
    broadcast: bool,
    /// Quorum group id (default: one per key).
    #[arg(long, requires = "broadcast")]
    group: Option<String>,
    /// Close the quorum when this many members (processes putting or
    /// getting) joined.
    #[arg(long, requires = "broadcast")]
    world_size: Option<u32>,
    /// Close the quorum this long after its first join, e.g. 30s.
    #[arg(long, requires = "broadcast", value_parser = humantime::parse_duration)]
    window: Option<Duration>,
    /// Close the quorum when pods of all these IPs joined.
    #[arg(long, requires = "broadcast", value_delimiter = ',')]
    ips: Vec<String>,
    /// Children per node of the host backend's tree.
    #[arg(long, requires = "broadcast")]
    fanout: Option<u32>,
    /// Send all tensors of one dtype as one buffer (in buckets).
    #[arg(long, requires = "broadcast")]
    pack: bool,
}

impl WindowArgs {
    fn window(&self, bucket: Option<u64>) -> Option<BroadcastWindow> {
        self.broadcast.then(|| BroadcastWindow {
            group_id: self.group.clone(),
            world_size: self.world_size,
            timeout_secs: self.window.map(|d| d.as_secs_f64()),
            ips: self.ips.clone(),
            fanout: self.fanout.unwrap_or(DEFAULT_GPU_FANOUT),
            pack: self.pack,
            bucket_bytes: bucket,
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum TensorCmd {
    /// Register generated tensors under KEY with this pod's agent.
    Put {
        key: String,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Contents are generated from this seed and each tensor's name.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// cluster or resource; absent: the metadata server's rule (GPU data
        /// is zero-copy: resource).
        #[arg(long)]
        lifespan: Option<Lifespan>,
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        #[arg(long)]
        service: Option<String>,
        #[command(flatten)]
        window: WindowArgs,
        /// Pack bucket size in bytes (suffixes KiB, MiB, GiB).
        #[arg(long, value_parser = kt_client::size::parse)]
        bucket: Option<u64>,
        /// Keep the tensors (and so the key) alive until SIGTERM or SIGINT.
        #[arg(long)]
        hold: bool,
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
    },
    /// Receive KEYs into tensors of LAYOUT (one set per key) and verify them.
    Get {
        #[arg(required = true)]
        keys: Vec<String>,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Verify against the contents `put --seed S` generated: one seed for
        /// every key, or one per key in order.
        #[arg(long)]
        seed: Vec<u64>,
        #[command(flatten)]
        window: WindowArgs,
        /// Point to point: one transfer per tensor instead of packed buckets.
        #[arg(long)]
        no_pack: bool,
        /// A key several putters put in the quorum: receive every putter's
        /// tensors, N sets of LAYOUT in putter-rank order (`--seed`: one,
        /// or one per putter in rank order). One KEY only.
        #[arg(
            long,
            value_name = "N",
            requires = "broadcast",
            conflicts_with = "reduce"
        )]
        all: Option<u32>,
        /// A key several putters put in the quorum: receive their `sum` or
        /// `mean` (floats; a sum of integers wraps around; bool refused).
        /// One KEY only; nothing to verify against a seed.
        #[arg(
            long,
            value_name = "OP",
            requires = "broadcast",
            conflicts_with = "seed"
        )]
        reduce: Option<ReduceOp>,
        /// Pack bucket size in bytes (suffixes KiB, MiB, GiB).
        #[arg(long, value_parser = kt_client::size::parse)]
        bucket: Option<u64>,
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
    },
    /// The tensors this pod's agent holds.
    Ls {
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
    },
}

/// A generated tensor on the host or a GPU.
#[derive(Debug)]
enum AnyTensor {
    Host(HostTensor),
    #[cfg(feature = "cuda")]
    Cuda(kt_client::tensor::CudaTensor),
}

impl Lend for AnyTensor {
    fn meta(&self) -> &TensorMeta {
        match self {
            AnyTensor::Host(t) => t.meta(),
            #[cfg(feature = "cuda")]
            AnyTensor::Cuda(t) => t.meta(),
        }
    }
    fn device(&self) -> Device {
        match self {
            AnyTensor::Host(t) => t.device(),
            #[cfg(feature = "cuda")]
            AnyTensor::Cuda(t) => t.device(),
        }
    }
    fn handle(&self) -> kt_types::tensor::MemHandle {
        match self {
            AnyTensor::Host(t) => t.handle(),
            #[cfg(feature = "cuda")]
            AnyTensor::Cuda(t) => t.handle(),
        }
    }
}

impl AnyTensor {
    fn new(device: Device, meta: &TensorMeta) -> anyhow::Result<AnyTensor> {
        match device {
            Device::Cpu => Ok(AnyTensor::Host(HostTensor::zeros(meta.dtype, &meta.shape)?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => Ok(AnyTensor::Cuda(kt_client::tensor::CudaTensor::zeros(
                n,
                meta.dtype,
                &meta.shape,
            )?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => anyhow::bail!("this kt was built without the `cuda` feature"),
        }
    }

    fn fill(&mut self, seed: u64, name: &str) -> anyhow::Result<()> {
        match self {
            AnyTensor::Host(t) => layout::fill(seed, name, t.bytes_mut()),
            #[cfg(feature = "cuda")]
            AnyTensor::Cuda(t) => {
                let mut host = vec![0u8; t.meta().nbytes().map_err(anyhow::Error::msg)? as usize];
                layout::fill(seed, name, &mut host);
                t.write(&host)?;
            }
        }
        Ok(())
    }

    /// The tensor's bytes (copied from the GPU for a CUDA tensor).
    fn bytes(&self) -> anyhow::Result<std::borrow::Cow<'_, [u8]>> {
        Ok(match self {
            AnyTensor::Host(t) => std::borrow::Cow::Borrowed(t.bytes()),
            #[cfg(feature = "cuda")]
            AnyTensor::Cuda(t) => std::borrow::Cow::Owned(t.to_vec()?),
        })
    }
}

/// Tensors of `layout` on its device.
fn allocate(l: &LayoutArgs) -> anyhow::Result<StateDict<AnyTensor>> {
    let items = layout::parse(&l.layout, l.repeat).map_err(anyhow::Error::msg)?;
    let mut sd = StateDict::new();
    for (name, meta) in items {
        sd.push(name, AnyTensor::new(l.device, &meta)?);
    }
    Ok(sd)
}

fn bytes_of(sd: &StateDict<AnyTensor>) -> u64 {
    sd.iter().map(|(_, t)| t.handle().len()).sum()
}

pub async fn run(cmd: TensorCmd, metadata_url: &str, token: &str) -> anyhow::Result<()> {
    let mut kt = TensorClient::connect_default(metadata_url, token).await?;
    match cmd {
        TensorCmd::Put {
            key,
            layout,
            seed,
            lifespan,
            ttl,
            service,
            window,
            bucket,
            hold,
            output,
        } => {
            let key = Key::parse(&key)?;
            let mut sd = allocate(&layout)?;
            for (name, t) in sd.iter_mut() {
                t.fill(seed, name)?;
            }
            let opts = TensorOptions {
                put: PutOptions {
                    lifespan,
                    ttl_secs: ttl.map(|d| d.as_secs().max(1)),
                    service,
                },
                broadcast: window.window(bucket),
                packing: None,
                keep_mapped: false,
                member: None,
            };
            let put = if sd.len() == 1 && sd.iter().next().is_some_and(|(n, _)| n.is_empty()) {
                let (_, t) = sd.iter().next().context("one tensor")?;
                kt.put_tensor(&key, t, &opts).await?
            } else {
                kt.put_state_dict(&key, &sd, &opts).await?
            };
            match output {
                SummaryFormat::Text => {
                    let mut line = format!(
                        "put {key}: {} tensors, {} bytes (version {})",
                        sd.len(),
                        bytes_of(&sd),
                        put.version
                    );
                    if let Some(s) = &put.stats {
                        line.push_str(&format!(
                            " broadcast rank {} of {} in {:.2}s",
                            s.rank.unwrap_or(0),
                            s.world.unwrap_or(0),
                            s.seconds
                        ));
                    }
                    println!("{line}");
                }
                SummaryFormat::Json => println!(
                    "{}",
                    json!({
                        "op": "tensor-put",
                        "key": key.to_string(),
                        "version": put.version,
                        "tensors": sd.len(),
                        "bytes": bytes_of(&sd),
                        "stats": put.stats,
                    })
                ),
            }
            if hold {
                println!("holding {key} (pid {})", std::process::id());
                use std::io::Write;
                std::io::stdout().flush()?;
                wait_for_signal().await?;
                // Unregistered now rather than when the agent notices the exit.
                if let Err(e) = kt.drop_tensors(&key).await {
                    eprintln!("kt: dropping {key}: {e}");
                }
                drop(sd);
            }
        }
        TensorCmd::Get {
            keys,
            layout,
            seed,
            window,
            no_pack,
            all,
            reduce,
            bucket,
            output,
        } => {
            let mut keys = keys
                .iter()
                .map(|k| Key::parse(k))
                .collect::<Result<Vec<_>, _>>()?;
            let from_many = all.is_some() || reduce.is_some();
            if from_many && keys.len() != 1 {
                anyhow::bail!("--all and --reduce receive one key, got {}", keys.len());
            }
            if let Some(n) = all {
                // One set per putter, each verified as a key's.
                keys = vec![keys[0].clone(); n as usize];
            }
            if !(seed.is_empty() || seed.len() == 1 || seed.len() == keys.len()) {
                anyhow::bail!(
                    "--seed: give one seed, or one per {} ({})",
                    if all.is_some() { "putter" } else { "key" },
                    keys.len()
                );
            }
            let mut sets = Vec::new();
            for _ in &keys {
                sets.push(allocate(&layout)?);
            }
            let packing = Packing {
                pack: !no_pack,
                bucket_bytes: bucket.unwrap_or(DEFAULT_BUCKET_BYTES),
            };
            let opts = TensorOptions {
                put: PutOptions::default(),
                broadcast: window.window(bucket),
                packing: Some(packing),
                // This process's memory goes away with it.
                keep_mapped: false,
                member: None,
            };
            // The whole request as this process waits for it (the agent's
            // `seconds` count its data movement alone).
            let started = std::time::Instant::now();
            let stats = match (all, reduce) {
                (Some(_), _) => kt.get_all(&keys[0], &mut sets, &opts).await?,
                (_, Some(op)) => kt.get_reduced(&keys[0], &mut sets[0], op, &opts).await?,
                _ => {
                    let mut gets: Vec<(Key, &mut StateDict<AnyTensor>)> =
                        keys.iter().cloned().zip(sets.iter_mut()).collect();
                    kt.get_many(&mut gets, &opts).await?
                }
            };
            let call_seconds = started.elapsed().as_secs_f64();
            let mut hasher = blake3::Hasher::new();
            for (i, (key, sd)) in keys.iter().zip(&sets).enumerate() {
                for (name, t) in sd.iter() {
                    let bytes = t.bytes()?;
                    hasher.update(&bytes);
                    let s = match seed.len() {
                        0 => continue,
                        1 => seed[0],
                        _ => seed[i],
                    };
                    if let Some(at) = layout::first_difference(s, name, &bytes) {
                        anyhow::bail!(
                            "tensor {name:?} of {key} differs from seed {s} at byte {at}"
                        );
                    }
                }
            }
            let digest = hasher.finalize().to_hex().to_string();
            let packed = if window.broadcast {
                window.pack
            } else {
                packing.pack
            };
            let backend = stats.backend.map(|b| b.to_string()).unwrap_or_default();
            let mut names: Vec<String> = keys.iter().map(Key::to_string).collect();
            names.dedup();
            let sources: Vec<String> = stats
                .sources
                .iter()
                .filter(|_| from_many)
                .map(|s| format!("{} ({})", s.rank, tensor::member_label(&s.agent, &s.member)))
                .collect();
            match output {
                SummaryFormat::Text => {
                    let mut line = format!(
                        "got {}: {} tensors, {} bytes, {} collectives ({backend}, {}) digest {digest}",
                        names.join(","),
                        stats.tensors,
                        stats.bytes,
                        stats.collectives,
                        if packed { "packed" } else { "unpacked" },
                    );
                    if let (Some(r), Some(w)) = (stats.rank, stats.world) {
                        line.push_str(&format!(" rank {r} of {w}"));
                    }
                    if stats.reused {
                        line.push_str(" (communicator reused)");
                    }
                    if let Some(op) = reduce {
                        line.push_str(&format!(" {op} of"));
                    }
                    if !sources.is_empty() {
                        line.push_str(&format!(" from ranks {}", sources.join(", ")));
                    }
                    println!("{line}");
                }
                SummaryFormat::Json => println!(
                    "{}",
                    json!({
                        "op": "tensor-get",
                        "keys": names,
                        "tensors": stats.tensors,
                        "bytes": stats.bytes,
                        "collectives": stats.collectives,
                        "backend": backend,
                        "packed": packed,
                        "rank": stats.rank,
                        "world": stats.world,
                        "reused": stats.reused,
                        "reduce": reduce.map(|r| r.as_str()),
                        "sources": stats.sources,
                        "placement": stats.placement,
                        "seconds": stats.seconds,
                        "call_seconds": call_seconds,
                        "digest": digest,
                    })
                ),
            }
        }
        TensorCmd::Ls { output } => {
            let regs = kt.registrations().await?;
            match output {
                SummaryFormat::Json => println!("{}", serde_json::to_string(&regs)?),
                SummaryFormat::Text => {
                    for r in regs {
                        println!(
                            "{}  {} tensors  {} bytes  {}  pid {}  {}",
                            r.key, r.tensors, r.bytes, r.device, r.pid, r.version
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r?,
    }
    Ok(())
}
