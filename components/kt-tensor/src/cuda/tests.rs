//! Tests of the NCCL backend.
//!
//! The first group runs everywhere. The GPU tests call
//! [`CudaBackend::new`] and print `skipping: <reason>` when it fails. Ranks
//! run in child processes (this test binary, re-run on [`gpu_child`]):
//! CUDA IPC handles cannot be opened by the process that exported them,
//! and NCCL refuses two ranks of one communicator on one GPU unless they
//! claim different hosts (`NCCL_HOSTID`, process-wide). With a GPU per
//! rank the children use their own; with fewer, they share cuda:0 as
//! "different hosts" (NCCL's network transport over this machine's
//! interfaces).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kt_types::env::{
    CT_DEVICE, CT_HANDLE, CT_ID, CT_LEN, CT_RANK, CT_TIMEOUT_MS, CT_UUID, CT_WORLD,
};
use kt_types::tensor::{BackendKind, Packing, Rank};

use super::*;

// ---- everywhere -----------------------------------------------------------

#[test]
fn hex_round_trips_and_rejects_garbage() {
    let bytes: [u8; IPC_HANDLE_BYTES] = std::array::from_fn(|i| (i * 37 + 5) as u8);
    let hex = encode_ipc_handle(&bytes);
    assert_eq!(hex.len(), 128);
    assert!(
        hex.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    assert_eq!(decode_ipc_handle(&hex).unwrap(), bytes);
    assert_eq!(decode_ipc_handle(&hex.to_uppercase()).unwrap(), bytes);
    assert_eq!(to_hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");

    let e = decode_ipc_handle(&hex[..126]).unwrap_err().to_string();
    assert!(
        e.contains("expected 128 hex digits") && e.contains("126"),
        "{e}"
    );
    let mut bad = hex.clone();
    bad.replace_range(10..12, "zz");
    let e = decode_ipc_handle(&bad).unwrap_err().to_string();
    assert!(e.contains("\"zz\" at 10 is not hex"), "{e}");
    assert!(matches!(
        from_hex::<UNIQUE_ID_BYTES>("00", "NCCL unique id"),
        Err(TransportError::Invalid(m)) if m.starts_with("NCCL unique id")
    ));
}

#[test]
fn uuids_format_and_compare_like_nvidia_smi() {
    let b: [u8; 16] = std::array::from_fn(|i| (0x10 + i) as u8);
    let u = format_uuid(&b);
    assert_eq!(u, "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f");
    assert_eq!(normalize_uuid(&u), "101112131415161718191a1b1c1d1e1f");
    assert_eq!(
        normalize_uuid(" GPU-10111213-1415-1617-1819-1A1B1C1D1E1F "),
        normalize_uuid("MIG-101112131415161718191a1b1c1d1e1f")
    );
}

#[test]
fn handles_of_other_kinds_are_refused() {
    let shm = MemHandle::Shm {
        path: "/dev/shm/kt-x".into(),
        offset: 0,
        len: 8,
    };
    let e = ipc_parts(&shm).unwrap_err();
    assert!(
        matches!(&e, TransportError::Invalid(m) if m.contains("/dev/shm/kt-x") && m.contains("host backend")),
        "{e}"
    );
    let ipc = MemHandle::CudaIpc {
        handle: "ab".repeat(64),
        offset: 256,
        len: 1024,
        device_uuid: Some("GPU-1".into()),
    };
    let (bytes, offset, len, uuid) = ipc_parts(&ipc).unwrap();
    assert_eq!(
        (bytes, offset, len, uuid),
        ([0xab; 64], 256, 1024, Some("GPU-1"))
    );
    let short = MemHandle::CudaIpc {
        handle: "ab".into(),
        offset: 0,
        len: 1,
        device_uuid: None,
    };
    assert!(matches!(ipc_parts(&short), Err(TransportError::Invalid(_))));
    assert!(matches!(
        cuda_index(Device::Cpu, "a staging buffer"),
        Err(TransportError::Invalid(m)) if m.contains("a staging buffer is on cpu")
    ));
    assert_eq!(cuda_index(Device::Cuda(3), "x").unwrap(), 3);
}

#[test]
fn comm_device_parses_indices() {
    assert_eq!(parse_comm_device("2").unwrap(), 2);
    assert_eq!(parse_comm_device(" cuda:1 ").unwrap(), 1);
    let e = parse_comm_device("gpu zero").unwrap_err().to_string();
    assert!(
        e.contains(kt_types::env::CUDA_DEVICE) && e.contains("UUID"),
        "{e}"
    );
}

#[test]
fn broadcast_parts_per_rank() {
    use nccl::{Part, part};
    // Every rank: one ncclBroadcast, whatever the order of the group.
    assert_eq!(part(1, 3, 2, &[2, 0, 1]).unwrap(), Part::Broadcast);
    // A subset: a chain from the root through the members in rank order;
    // the others do nothing.
    assert_eq!(
        part(0, 4, 0, &[0, 1, 3]).unwrap(),
        Part::Chain(vec![0, 1, 3])
    );
    assert_eq!(
        part(3, 4, 1, &[3, 0, 1]).unwrap(),
        Part::Chain(vec![1, 0, 3])
    );
    assert_eq!(part(2, 4, 0, &[0, 1, 3]).unwrap(), Part::Skip);
    assert_eq!(part(2, 4, 2, &[2, 2, 0]).unwrap(), Part::Chain(vec![2, 0]));
    assert!(
        matches!(part(0, 2, 0, &[0, 2]), Err(TransportError::Invalid(m)) if m.contains("rank 2"))
    );
    assert!(matches!(
        part(0, 3, 1, &[0, 2]),
        Err(TransportError::Invalid(_))
    ));
}

#[test]
fn nccl_config_is_the_2_14_layout() {
    let c = nccl::ConfigV21400::non_blocking();
    // size_t size; unsigned magic, version; int blocking: NCCL reads `size`
    // bytes and defaults the rest.
    assert_eq!(
        std::mem::size_of::<nccl::ConfigV21400>(),
        if cfg!(target_pointer_width = "64") {
            24
        } else {
            16
        }
    );
    let _ = c;
    assert_eq!(nccl::version_string(22105), "2.21.5");
    assert_eq!(nccl::version_string(21400), "2.14.0");
    assert_eq!(nccl::version_string(2804), "2.8.4");
    let id: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|i| (255 - i) as u8);
    assert_eq!(nccl::UniqueId::from_bytes(&id).to_bytes(), id);
}

#[test]
fn nccl_load_errors_say_what_was_tried() {
    let e = nccl::load_from(&["/nonexistent/kt/libnccl.so.2".into()]).unwrap_err();
    assert!(
        e.starts_with("NCCL (libnccl.so.2) could not be loaded")
            && e.contains("/nonexistent/kt/libnccl.so.2")
            && e.contains(NCCL_LIBRARY_ENV),
        "{e}"
    );
    // A library that is not NCCL: the missing entry point is named.
    let e = nccl::load_from(&["libc.so.6".into()]).unwrap_err();
    assert!(
        e.contains("libc.so.6 is not a usable NCCL: missing ncclGetVersion"),
        "{e}"
    );
}

#[test]
fn without_cuda_the_backend_says_why_and_does_not_panic() {
    let first = CudaBackend::new();
    let again = CudaBackend::new();
    match (&first, &again) {
        (Ok(b), Ok(_)) => {
            assert_eq!(b.kind(), BackendKind::Nccl);
            eprintln!("CUDA and NCCL are usable here: {b:?}");
            probe().unwrap();
        }
        (Err(TransportError::Unsupported(m)), Err(TransportError::Unsupported(m2))) => {
            assert_eq!(m, m2, "the probe is memoized");
            assert!(
                m.contains("libcuda") || m.contains("CUDA driver") || m.contains("libnccl"),
                "{m}"
            );
            assert_eq!(probe().unwrap_err(), *m);
            if probe_driver().is_err() {
                assert!(
                    m.starts_with("no CUDA driver (libcuda.so) could be loaded")
                        || m.contains("cuInit")
                        || m.contains("no GPU"),
                    "{m}"
                );
                // The client helpers fail the same way.
                let e = CudaTensorMem::new(0, 16).unwrap_err();
                assert!(matches!(e, TransportError::Unsupported(_)), "{e}");
                assert!(matches!(
                    device_count(),
                    Err(TransportError::Unsupported(_))
                ));
            }
        }
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn endpoints_carry_the_address() {
    let e: Box<dyn Endpoint> = Box::new(CudaEndpoint::new("10.1.2.3"));
    assert_eq!(e.address(), "10.1.2.3");
    let back = e.into_any().downcast::<CudaEndpoint>().unwrap();
    assert_eq!(*back, CudaEndpoint::new("10.1.2.3"));
}

// ---- with a GPU -----------------------------------------------------------

/// How the tests' backends start their unique-id helper: this test binary
/// again, on [`gpu_child`].
fn with_helper(b: CudaBackend) -> CudaBackend {
    b.with_root_helper(std::env::current_exe().expect("test binary"), CHILD_ARGS)
}

/// The backend, or `None` after printing why the test is skipped; with
/// `KT_REQUIRE_GPU` on (`make test-gpu`, the gpu workflow) the test fails
/// instead, saying why.
fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(with_helper(b)),
        Err(e) if gpu_required() => {
            panic!(
                "a GPU is required here ({} is on): {e}",
                kt_types::env::REQUIRE_GPU
            )
        }
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// Whether the GPU tests must run (`KT_REQUIRE_GPU`, a boolean).
fn gpu_required() -> bool {
    let var = kt_types::env::REQUIRE_GPU;
    let on = |v: String| kt_types::env::boolish(var, &v).unwrap_or_else(|e| panic!("{e}"));
    std::env::var(var).is_ok_and(on)
}

/// Bytes `len` long, different for each seed.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(u32::from(seed) % 32) as u8
                ^ seed
        })
        .collect()
}

fn plan(world: u32) -> TransferPlan {
    TransferPlan {
        id: "kt-cuda-test".into(),
        backend: BackendKind::Nccl,
        ranks: (0..world)
            .map(|r| Rank {
                rank: r,
                agent: format!("a{r}"),
                member: String::new(),
                node: String::new(),
                ip: "127.0.0.1".into(),
                endpoint: "127.0.0.1".into(),
            })
            .collect(),
        flows: vec![],
        packing: Packing::default(),
        fanout: 2,
    }
}

const CHILD: &str = kt_types::env::CUDA_TEST_CHILD;
/// This test binary's arguments that run [`gpu_child`] alone.
const CHILD_ARGS: [&str; 5] = [
    "--exact",
    "cuda::tests::gpu_child",
    "--ignored",
    "--nocapture",
    "--test-threads=1",
];

/// Re-runs this test binary on [`gpu_child`] with `role` and `env`.
fn spawn(role: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(CHILD_ARGS)
        .env(CHILD, role)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .spawn()
        .expect("spawning a test child")
}

/// Waits for every child, killing them all at `limit`: a hang fails the
/// test instead of hanging it.
fn join(mut children: Vec<Child>, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut failed = Vec::new();
    for (i, c) in children.iter_mut().enumerate() {
        loop {
            match c.try_wait().expect("waiting for a child") {
                Some(status) => {
                    if !status.success() {
                        failed.push(format!("child {i}: {status}"));
                    }
                    break;
                }
                None if Instant::now() >= deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    failed.push(format!("child {i}: still running after {limit:?}, killed"));
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("; "));
}

/// The environment of rank `rank` of `world` child ranks: its GPU, and
/// the host-id trick when they must share one.
fn rank_env(rank: u32, world: u32, id: &str) -> Vec<(&'static str, String)> {
    let gpus = device_count().unwrap_or(0);
    let mut env = vec![
        (CT_RANK, rank.to_string()),
        (CT_WORLD, world.to_string()),
        (CT_ID, id.to_owned()),
    ];
    if gpus >= world {
        env.push((CT_DEVICE, rank.to_string()));
    } else {
        env.push((CT_DEVICE, "0".into()));
        env.push(("NCCL_HOSTID", format!("kt-cuda-test-host-{rank}")));
        env.push(("NCCL_NVLS_ENABLE", "0".into()));
        env.push(("NCCL_MNNVL_ENABLE", "0".into()));
        env.push(("NCCL_IB_DISABLE", "1".into()));
    }
    env
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} unset"))
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number"))
}

#[test]
fn staging_memory_copies_and_reads_back() {
    let Some(b) = gpu() else { return };
    let n = 3 << 20;
    let mut a = b.alloc_device(0, n).unwrap();
    let mut c = b.alloc_device(0, n).unwrap();
    let data = pattern(3, n as usize);
    a.write(0, &data).unwrap();
    c.write(0, &vec![0; n as usize]).unwrap();
    b.copy(&mut c, 4096, &a, 8192, 1 << 20).unwrap();
    let got = c.read(0, n).unwrap();
    assert!(got[..4096].iter().all(|x| *x == 0));
    assert_eq!(&got[4096..4096 + (1 << 20)], &data[8192..8192 + (1 << 20)]);
    assert!(got[4096 + (1 << 20)..].iter().all(|x| *x == 0));
    // Out of range, and host memory, are refused.
    assert!(matches!(
        b.copy(&mut c, n - 1, &a, 0, 2),
        Err(TransportError::Invalid(_))
    ));
    let mut host = crate::shm::HostBuf(vec![0; 16]);
    assert!(matches!(
        b.copy(&mut host, 0, &a, 0, 16),
        Err(TransportError::Invalid(_))
    ));
    assert!(matches!(
        b.alloc(Device::Cpu, 16),
        Err(TransportError::Invalid(_))
    ));
    // Zero-length staging is fine.
    assert_eq!(b.alloc(Device::Cuda(0), 0).unwrap().len(), 0);

    // Client memory: handle, sub-range handles, round trip.
    let mut m = CudaTensorMem::new(0, 1 << 20).unwrap();
    m.write(0, &data[..1 << 20]).unwrap();
    assert_eq!(m.to_vec().unwrap(), &data[..1 << 20]);
    let MemHandle::CudaIpc {
        handle,
        offset,
        len,
        device_uuid: uuid,
    } = m.mem_handle()
    else {
        panic!("not an IPC handle")
    };
    assert_eq!((handle.len(), offset, len), (128, 0, 1 << 20));
    assert_eq!(uuid.as_deref(), Some(device_uuid(0).unwrap().as_str()));
    assert_eq!(ordinal_of_uuid(uuid.as_deref().unwrap()).unwrap(), 0);
    let MemHandle::CudaIpc { offset, len, .. } = m.mem_handle_at(4096, 100).unwrap() else {
        panic!()
    };
    assert_eq!((offset, len), (4096, 100));
    assert!(m.mem_handle_at(1 << 20, 1).is_err());
    assert!(CudaTensorMem::new(0, 0).is_err());
    assert!(
        b.map(
            &MemHandle::Shm {
                path: "x".into(),
                offset: 0,
                len: 1
            },
            Device::Cuda(0)
        )
        .is_err()
    );
}

/// The application's current device is its own business: making a handle
/// leaves it as it was (here: no context at all).
#[test]
fn making_an_ipc_handle_keeps_the_current_context() {
    let Some(_b) = gpu() else { return };
    let mem = CudaTensorMem::new(0, 4096).unwrap();
    driver::KeepCurrent::unbind().unwrap();
    mem.mem_handle_at(0, 4096).unwrap();
    assert_eq!(
        driver::KeepCurrent::new().saved(),
        Some(std::ptr::null_mut())
    );
}

#[test]
fn ipc_handles_open_once_in_another_process() {
    let Some(_b) = gpu() else { return };
    let n = 4 << 20;
    let mut m = CudaTensorMem::new(0, n).unwrap();
    m.write(0, &pattern(7, n as usize)).unwrap();
    let MemHandle::CudaIpc {
        handle,
        device_uuid,
        ..
    } = m.mem_handle()
    else {
        panic!()
    };
    let child = spawn(
        "ipc",
        &[
            (CT_HANDLE, handle),
            (CT_UUID, device_uuid.unwrap_or_default()),
            (CT_LEN, n.to_string()),
        ],
    );
    join(vec![child], Duration::from_secs(120));
    // The child wrote pattern 8 over bytes 4096.. of our memory.
    let got = m.to_vec().unwrap();
    let want8 = pattern(8, (n - 4096) as usize);
    assert_eq!(&got[..4096], &pattern(7, 4096)[..]);
    assert!(got[4096..] == want8[..], "the child's write is not visible");
}

fn child_ipc() {
    let b = CudaBackend::new().unwrap();
    let handle = std::env::var(CT_HANDLE).unwrap();
    let uuid = std::env::var(CT_UUID).ok().filter(|u| !u.is_empty());
    let n = env_u64(CT_LEN);
    let whole = MemHandle::CudaIpc {
        handle: handle.clone(),
        offset: 0,
        len: n,
        device_uuid: uuid.clone(),
    };
    let tail = MemHandle::CudaIpc {
        handle: handle.clone(),
        offset: 4096,
        len: n - 4096,
        device_uuid: uuid.clone(),
    };
    // Index 0 is what the UUID overrides (it must still name the GPU).
    let r1 = b.map_ipc(&whole, Device::Cuda(0)).unwrap();
    let mut r2 = b.map_ipc(&tail, Device::Cuda(0)).unwrap();
    assert_eq!(b.cached_handles(), 1, "one allocation, opened once");
    assert_eq!(r2.device_ptr().unwrap(), r1.device_ptr().unwrap() + 4096);
    assert_eq!(r1.read(0, n).unwrap(), pattern(7, n as usize));
    // Copy through a staging buffer, as pack does.
    let mut staging = b.alloc(r1.device(), n).unwrap();
    b.copy(&mut *staging, 0, &r1, 0, n).unwrap();
    let mut check = b.alloc_device(r1.ordinal(), n).unwrap();
    b.copy(&mut check, 0, &*staging, 0, n).unwrap();
    assert_eq!(check.read(0, n).unwrap(), pattern(7, n as usize));
    // Overrunning the allocation is refused.
    let over = MemHandle::CudaIpc {
        handle: handle.clone(),
        offset: 8,
        len: n,
        device_uuid: uuid.clone(),
    };
    assert!(matches!(
        b.map_ipc(&over, Device::Cuda(0)),
        Err(TransportError::Invalid(_))
    ));
    // Write into the owner's memory.
    r2.write(0, &pattern(8, (n - 4096) as usize)).unwrap();
    // Forgetting drops the cache; live regions keep the mapping open.
    assert_eq!(b.forget(&whole), 1);
    assert_eq!(b.cached_handles(), 0);
    assert_eq!(r1.read(0, 16).unwrap(), pattern(7, 16));
    drop((r1, r2));
}

#[test]
fn nccl_broadcast_64_mib_between_two_ranks() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(2)).unwrap().unwrap();
    assert_eq!(id.len(), 2 * UNIQUE_ID_BYTES);
    let children = (0..2)
        .map(|r| spawn("bcast", &rank_env(r, 2, &id)))
        .collect();
    join(children, Duration::from_secs(300));
}

#[test]
fn nccl_subset_broadcasts_among_four_ranks() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(4)).unwrap().unwrap();
    let children = (0..4)
        .map(|r| spawn("bcast", &rank_env(r, 4, &id)))
        .collect();
    join(children, Duration::from_secs(300));
}

/// One rank of the broadcast tests: everything checked here, in every
/// rank, in the same order.
fn child_bcast() {
    let rank = env_u64(CT_RANK) as u32;
    let world = env_u64(CT_WORLD) as u32;
    let dev = env_u64(CT_DEVICE) as u32;
    let id = std::env::var(CT_ID).unwrap();
    let b = with_helper(CudaBackend::new().unwrap()).with_comm_device(dev);
    let p = plan(world);
    let ep = b.endpoint(&p.id, "127.0.0.1").unwrap();
    assert_eq!(ep.address(), "127.0.0.1");
    let mut comm = b
        .connect(
            &p,
            rank,
            ep,
            Some(&id),
            Device::Cuda(dev),
            Duration::from_secs(120),
        )
        .unwrap();
    assert_eq!((comm.rank(), comm.world()), (rank, world));
    let all: Vec<u32> = (0..world).collect();

    // 64 MiB from rank 0 to every rank: ncclBroadcast, in place.
    let n: u64 = 64 << 20;
    let mut buf = b.alloc_device(dev, n).unwrap();
    let mine = if rank == 0 {
        pattern(1, n as usize)
    } else {
        vec![0; n as usize]
    };
    buf.write(0, &mine).unwrap();
    let t = Instant::now();
    comm.broadcast(0, &all, &mut buf, 0, n).unwrap();
    eprintln!("rank {rank}: 64 MiB broadcast in {:?}", t.elapsed());
    assert!(
        buf.read(0, n).unwrap() == pattern(1, n as usize),
        "rank {rank}: wrong bytes"
    );

    // Part of the buffer, from the last rank.
    let last = world - 1;
    let (off, len) = (4096u64, 1u64 << 20);
    if rank == last {
        buf.write(off, &pattern(2, len as usize)).unwrap();
    }
    comm.broadcast(last, &all, &mut buf, off, len).unwrap();
    let got = buf.read(0, n).unwrap();
    let base = pattern(1, n as usize);
    assert_eq!(&got[..off as usize], &base[..off as usize]);
    assert_eq!(
        &got[off as usize..(off + len) as usize],
        &pattern(2, len as usize)[..]
    );
    assert!(got[(off + len) as usize..] == base[(off + len) as usize..]);

    if world >= 3 {
        // Subsets: every rank but 1. A large payload goes down the chain
        // 0 -> 2 (-> 3), in pieces that do not divide it; a small one, from
        // the last rank, straight to the others. Rank 1 is never written to.
        let group: Vec<u32> = (0..world).filter(|r| *r != 1).collect();
        for (root, m, seed) in [(0, (20u64 << 20) + 12_345, 3u8), (last, 100 << 10, 4)] {
            let mut sub = b.alloc_device(dev, m).unwrap();
            sub.write(0, &vec![0xee; m as usize]).unwrap();
            if rank == root {
                sub.write(0, &pattern(seed, m as usize)).unwrap();
            }
            let t = Instant::now();
            comm.broadcast(root, &group, &mut sub, 0, m).unwrap();
            eprintln!(
                "rank {rank}: {m} bytes from rank {root} within {group:?} in {:?}",
                t.elapsed()
            );
            let got = sub.read(0, m).unwrap();
            if group.contains(&rank) {
                assert!(
                    got == pattern(seed, m as usize),
                    "rank {rank}: subset bytes"
                );
            } else {
                assert!(got.iter().all(|x| *x == 0xee), "rank {rank} was written to");
            }
        }
        // Then the whole group again: the communicator is still in step.
        let mut sub = b.alloc_device(dev, 1 << 20).unwrap();
        comm.broadcast(0, &all, &mut sub, 0, 1 << 20).unwrap();
    }

    // A buffer on another GPU than the communicator's is refused.
    if device_count().unwrap() > 1 {
        let other = (dev + 1) % device_count().unwrap();
        let mut wrong = b.alloc_device(other, 16).unwrap();
        let e = comm.broadcast(0, &all, &mut wrong, 0, 16).unwrap_err();
        assert!(matches!(e, TransportError::Invalid(_)), "{e}");
    }
    drop(comm);
}

/// A failed transfer leaves nothing behind (#19, bug 2): NCCL's bootstrap
/// root lives in a helper process, which ends once rank 0 gave up.
#[test]
fn nccl_a_failed_rank_0_ends_its_bootstrap_root() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(2)).unwrap().unwrap();
    let pid = {
        let mut roots = b.roots.lock().unwrap();
        assert_eq!(roots.len(), 1);
        let h = roots.get_mut(&id).unwrap();
        assert!(h.running());
        h.pid()
    };
    let ep = b.endpoint("t", "127.0.0.1").unwrap();
    let e = b
        .connect(
            &plan(2),
            0,
            ep,
            Some(&id),
            Device::Cuda(0),
            Duration::from_secs(2),
        )
        .err()
        .expect("connected without rank 1");
    eprintln!("rank 0 alone: {e}");
    assert!(b.roots.lock().unwrap().is_empty());
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(Instant::now() < deadline, "the helper {pid} still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn nccl_connect_times_out_when_a_rank_never_comes() {
    let Some(b) = gpu() else { return };
    // The bootstrap root lives in a helper process of this one, waiting
    // for rank 0, which never connects.
    let id = b.rendezvous(&plan(2)).unwrap().unwrap();
    let mut env = rank_env(1, 2, &id);
    env.push((CT_TIMEOUT_MS, "3000".into()));
    let child = spawn("timeout", &env);
    join(vec![child], Duration::from_secs(90));
}

fn child_timeout() {
    let dev = env_u64(CT_DEVICE) as u32;
    let timeout = Duration::from_millis(env_u64(CT_TIMEOUT_MS));
    let id = std::env::var(CT_ID).unwrap();
    let b = with_helper(CudaBackend::new().unwrap()).with_comm_device(dev);
    let p = plan(2);
    let ep = b.endpoint(&p.id, "127.0.0.1").unwrap();
    let t = Instant::now();
    let e = b
        .connect(&p, 1, ep, Some(&id), Device::Cuda(dev), timeout)
        .err()
        .expect("connected without rank 0");
    let took = t.elapsed();
    eprintln!("rank 1 gave up after {took:?}: {e}");
    assert!(
        matches!(&e, TransportError::Timeout(m) if m.contains("aborted")),
        "{e}"
    );
    assert!(took >= timeout, "{took:?}");
    assert!(
        took < timeout + Duration::from_secs(30),
        "abort took {took:?}"
    );
    // The backend still works: a fresh allocation, a copy.
    let mut a = b.alloc_device(dev, 64).unwrap();
    a.write(0, &[7; 64]).unwrap();
    assert_eq!(a.read(0, 64).unwrap(), vec![7; 64]);
}

/// Flows in turn (#19, bug 1): a rank of a later flow waits for the
/// members still busy with an earlier one, longer than the collective
/// timeout, and nobody aborts.
#[test]
fn nccl_a_later_flow_waits_for_an_earlier_one() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(3)).unwrap().unwrap();
    let children = (0..3)
        .map(|r| spawn("flows", &rank_env(r, 3, &id)))
        .collect();
    join(children, Duration::from_secs(120));
}

/// Flow A is {0, 1}, flow B {0, 2}, both rooted at 0, every collective
/// bounded by 6 s. Rank 1 comes to flow A 12 s late, so rank 0 is busy with
/// A for 12 s, and rank 2, only in B, waits that long for rank 0.
fn child_flows() {
    let rank = env_u64(CT_RANK) as u32;
    let dev = env_u64(CT_DEVICE) as u32;
    let id = std::env::var(CT_ID).unwrap();
    let b = with_helper(CudaBackend::new().unwrap()).with_comm_device(dev);
    let p = plan(3);
    let ep = b.endpoint(&p.id, "127.0.0.1").unwrap();
    // Bounds the connection too: generous for three ranks on one machine.
    let timeout = Duration::from_secs(6);
    let mut comm = b
        .connect(&p, rank, ep, Some(&id), Device::Cuda(dev), timeout)
        .unwrap();
    let n: u64 = 1 << 20;
    let mut buf = b.alloc_device(dev, n).unwrap();
    buf.write(0, &vec![0; n as usize]).unwrap();
    let t = Instant::now();
    if rank == 0 {
        for (seed, group) in [(5u8, [0u32, 1]), (6, [0, 2])] {
            buf.write(0, &pattern(seed, n as usize)).unwrap();
            comm.begin_flow(0, &group).unwrap();
            comm.broadcast(0, &group, &mut buf, 0, n).unwrap();
        }
    } else {
        let (seed, group) = if rank == 1 {
            (5u8, [0u32, 1])
        } else {
            (6, [0, 2])
        };
        if rank == 1 {
            std::thread::sleep(2 * timeout);
        }
        comm.begin_flow(0, &group).unwrap();
        comm.broadcast(0, &group, &mut buf, 0, n).unwrap();
        assert!(
            buf.read(0, n).unwrap() == pattern(seed, n as usize),
            "rank {rank}: wrong bytes"
        );
    }
    eprintln!("rank {rank}: flows done in {:?}", t.elapsed());
    if rank == 2 {
        assert!(
            t.elapsed() >= 2 * timeout,
            "rank 2 did not wait: {:?}",
            t.elapsed()
        );
    }
    drop(comm);
}

/// 256 MiB from rank 0 to three others, straight from the root (what
/// subsets did before) and down the pipelined chain in pieces of 1, 4 and
/// 16 MiB, against NCCL's own broadcast: every copy checked, the times
/// printed.
#[test]
fn nccl_a_chain_against_sends_from_the_root() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(4)).unwrap().unwrap();
    let children = (0..4)
        .map(|r| spawn("chain", &rank_env(r, 4, &id)))
        .collect();
    join(children, Duration::from_secs(240));
}

fn child_chain() {
    let rank = env_u64(CT_RANK) as u32;
    let dev = env_u64(CT_DEVICE) as u32;
    let id = UniqueId::from_bytes(&from_hex(&std::env::var(CT_ID).unwrap(), "id").unwrap());
    let b = with_helper(CudaBackend::new().unwrap()).with_comm_device(dev);
    let timeout = Duration::from_secs(120);
    let mut comm = nccl::NcclComm::init("chain", dev, 4, rank, &id, timeout).unwrap();
    let n: u64 = 256 << 20;
    let want = pattern(9, n as usize);
    let mut buf = b.alloc_device(dev, n).unwrap();
    let mut tick = b.alloc_device(dev, 1).unwrap();
    let all = [0u32, 1, 2, 3];
    let mut line = Vec::new();
    let shapes = [
        "star",
        "chain 1 MiB",
        "chain 4 MiB",
        "chain 16 MiB",
        "ncclBroadcast",
    ];
    for shape in shapes.iter().chain(&shapes) {
        if rank == 0 {
            buf.write(0, &want).unwrap();
        } else {
            buf.write(0, &vec![0; n as usize]).unwrap();
        }
        // Everyone starts together.
        comm.broadcast(0, &all, &mut tick, 0, 1).unwrap();
        let t = Instant::now();
        let at = buf.device_ptr().unwrap();
        match *shape {
            "star" => comm
                .subset_with(&all, at, n, chain::PIECE, u64::MAX)
                .unwrap(),
            "chain 1 MiB" => comm.subset_with(&all, at, n, 1 << 20, 0).unwrap(),
            "chain 4 MiB" => comm.subset_with(&all, at, n, 4 << 20, 0).unwrap(),
            "chain 16 MiB" => comm.subset_with(&all, at, n, 16 << 20, 0).unwrap(),
            _ => comm.broadcast(0, &all, &mut buf, 0, n).unwrap(),
        }
        let took = t.elapsed();
        assert!(
            buf.read(0, n).unwrap() == want,
            "rank {rank}: {shape} bytes"
        );
        line.push(format!("{shape} {:.1} ms", took.as_secs_f64() * 1e3));
    }
    eprintln!("rank {rank}: 256 MiB to 3 ranks: {}", line.join(", "));
}

/// Rounds of one group on a kept communicator: the first connects, the
/// next ones reuse it (new plans, packed and unpacked), and it is given
/// back after each.
#[test]
fn nccl_a_kept_communicator_runs_the_next_rounds() {
    let Some(b) = gpu() else { return };
    let id = b.rendezvous(&plan(3)).unwrap().unwrap();
    let children = (0..3)
        .map(|r| spawn("rounds", &rank_env(r, 3, &id)))
        .collect();
    join(children, Duration::from_secs(180));
}

fn child_rounds() {
    use crate::engine::{Lent, Link, run, transfer_on};
    use kt_types::Key;
    use kt_types::tensor::{DType, Flow, TensorDesc, TensorMeta};

    let rank = env_u64(CT_RANK) as u32;
    let dev = env_u64(CT_DEVICE) as u32;
    let id = std::env::var(CT_ID).unwrap();
    let b = with_helper(CudaBackend::new().unwrap()).with_comm_device(dev);
    let key = Key::parse("rl/weights").unwrap();
    // 40 tensors, 12 MiB in all; rank 0 sends to 1 and 2.
    let descs: Vec<TensorDesc> = (0..40u64)
        .map(|i| TensorDesc {
            name: format!("l{i}"),
            meta: TensorMeta::new(DType::F32, [(i + 1) * 2048]),
        })
        .collect();
    let plan_of = |round: u32, pack: bool| {
        let mut p = plan(3);
        p.id = format!("round-{round}");
        p.flows = vec![Flow {
            key: key.clone(),
            version: round.to_string(),
            root: 0,
            receivers: vec![1, 2],
            tensors: descs.clone(),
        }];
        p.packing = Packing {
            pack,
            bucket_bytes: 4 << 20,
        };
        p
    };
    let lent = |seed: u8| {
        let mut l = Lent::new(Device::Cuda(dev));
        let regions = descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let n = d.meta.nbytes().unwrap();
                let mut r = b.alloc_device(dev, n).unwrap();
                let bytes = if rank == 0 {
                    pattern(seed.wrapping_add(i as u8), n as usize)
                } else {
                    vec![0; n as usize]
                };
                r.write(0, &bytes).unwrap();
                Box::new(r) as Box<dyn Region>
            })
            .collect();
        l.keys.insert(key.clone(), regions);
        l
    };
    let check = |l: &Lent, seed: u8| {
        for (i, (d, r)) in descs.iter().zip(&l.keys[&key]).enumerate() {
            let n = d.meta.nbytes().unwrap();
            let mut got = vec![0; n as usize];
            driver::dtoh(
                &driver::context(dev).unwrap(),
                &mut got,
                r.device_ptr().unwrap(),
            )
            .unwrap();
            assert!(
                got == pattern(seed.wrapping_add(i as u8), n as usize),
                "rank {rank}: tensor {i}"
            );
        }
    };
    let timeout = Duration::from_secs(60);
    let t = Instant::now();
    let ep = b.endpoint("round-0", "127.0.0.1").unwrap();
    let mut comm = b
        .connect(
            &plan_of(0, false),
            rank,
            ep,
            Some(&id),
            Device::Cuda(dev),
            timeout,
        )
        .unwrap();
    let connect = t.elapsed();
    for (round, pack) in [(0u32, false), (1, true), (2, false)] {
        let p = plan_of(round, pack);
        let mut l = lent(round as u8 * 10);
        let t = Instant::now();
        comm.rename(&p.id);
        run(&b, &mut *comm, &p, &mut l).unwrap();
        eprintln!(
            "rank {rank}: round {round} (pack {pack}) in {:?}",
            t.elapsed()
        );
        check(&l, round as u8 * 10);
        assert!(
            comm.reusable(),
            "rank {rank}: round {round} left it unusable"
        );
    }
    // Through the engine: given back, and marked reused.
    let (res, back) = transfer_on(
        &b,
        &plan_of(3, true),
        rank,
        Link::Reuse(comm),
        lent(30),
        timeout,
    );
    assert!(res.unwrap().reused);
    let comm = back.expect("a healthy communicator is given back");
    eprintln!("rank {rank}: connecting took {connect:?}; rounds 1-3 ran on the kept communicator");
    drop(comm);
}

/// The body of a child process (see [`spawn`]); does nothing when run by
/// itself.
#[test]
#[ignore = "run by the GPU tests in a child process"]
fn gpu_child() {
    if let Some(r) = serve_root_helper() {
        return r.unwrap();
    }
    match std::env::var(CHILD).as_deref() {
        Ok("ipc") => child_ipc(),
        Ok("bcast") => child_bcast(),
        Ok("timeout") => child_timeout(),
        Ok("flows") => child_flows(),
        Ok("rounds") => child_rounds(),
        Ok("chain") => child_chain(),
        _ => eprintln!("nothing to do: {CHILD} unset"),
    }
}
