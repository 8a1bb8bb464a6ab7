//! Quorums with many processes per pod and many putters of one key, on the
//! host backend with real servers in-process: 2 pods × 4 processes form one
//! quorum of 8 putter ranks; getters ask for every putter's tensor (in rank
//! order, or some by rank) or a reduction; a plain getter of a key of
//! several putters, a reduction a dtype does not have, and a process
//! joining twice are refused.
//!
//! The processes of a pod are control connections of this test process:
//! they share one pid, so each names itself with a member label
//! ([`TensorOptions::member`]), as threads driving one GPU each would.

use std::time::Duration;

use kt_client::tensor::{HostTensor, StateDict, TensorClient, TensorOptions};
use kt_tests::{Agent, Cluster, TOKEN};
use kt_types::tensor::{DType, ReduceOp, TensorStats};
use kt_types::{BroadcastWindow, ErrorCode, Key};

const N: u64 = 16;

async fn client(c: &Cluster, a: &Agent) -> TensorClient {
    TensorClient::connect(a.socket(), &c.metadata_url(), TOKEN)
        .await
        .expect("agent")
}

fn opts(group: &str, world: u32, secs: f64, member: Option<String>) -> TensorOptions {
    TensorOptions {
        broadcast: Some(BroadcastWindow {
            group_id: Some(group.into()),
            world_size: Some(world),
            timeout_secs: Some(secs),
            fanout: 2,
            ..BroadcastWindow::default()
        }),
        member,
        ..TensorOptions::default()
    }
}

/// Putter `p`'s tensor: element i is `100 p + i`.
fn value(p: u64, i: u64) -> f32 {
    (100 * p + i) as f32
}

fn f32s(t: &HostTensor) -> Vec<f32> {
    t.bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn one(t: HostTensor) -> StateDict<HostTensor> {
    let mut sd = StateDict::new();
    sd.push("", t);
    sd
}

/// `GET /api/v1/quorums/{group}` as text (empty when it fails).
async fn open_round(c: &Cluster, group: &str) -> String {
    let url = format!("{}/api/v1/quorums/{group}", c.metadata_url());
    let res = kt_api::client().get(url).bearer_auth(TOKEN).send().await;
    match res {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

fn sources(s: &TensorStats) -> Vec<(u32, String)> {
    s.sources
        .iter()
        .map(|x| (x.rank, x.agent.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pods_of_four_processes_put_one_key_and_getters_take_all_or_a_reduction() {
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let pods = [c.start_agent("pod-a").await, c.start_agent("pod-b").await];
    let reader = c.start_agent("reader").await;
    let k = Key::parse("training-sync/gradients").unwrap();
    // 8 putters, and getters: all, by rank, sum, mean, a plain one.
    let world = 8 + 5;
    let group = "training-sync";
    let mut putters = Vec::new();
    for (pi, pod) in pods.iter().enumerate() {
        for j in 0..4u64 {
            // Ranks: putters by key, then pod, then process.
            let p = pi as u64 * 4 + j;
            let mut t = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
            let v: Vec<u8> = (0..N).flat_map(|i| value(p, i).to_le_bytes()).collect();
            t.bytes_mut().copy_from_slice(&v);
            putters.push((
                client(&c, pod).await,
                t,
                opts(group, world, 60.0, Some(j.to_string())),
            ));
        }
    }
    let zeros = || HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let mut getters = Vec::new();
    for label in ["all", "some", "sum", "mean", "plain"] {
        getters.push((
            client(&c, &reader).await,
            opts(group, world, 60.0, Some(label.into())),
        ));
    }
    let mut all: Vec<StateDict<HostTensor>> = (0..8).map(|_| one(zeros())).collect();
    let mut some: Vec<(u32, StateDict<HostTensor>)> = vec![(1, one(zeros())), (6, one(zeros()))];
    let mut sum = one(zeros());
    let mut mean = one(zeros());
    let mut plain = zeros();

    let puts = futures::future::join_all(
        putters
            .iter_mut()
            .map(|(cl, t, o)| cl.put_tensor(&k, &*t, &*o)),
    );
    let [g_all, g_some, g_sum, g_mean, g_plain] = &mut getters[..] else {
        unreachable!()
    };
    let gets = async {
        tokio::join!(
            g_all.0.get_all(&k, &mut all, &g_all.1),
            g_some.0.get_by_rank(&k, &mut some, &g_some.1),
            g_sum.0.get_reduced(&k, &mut sum, ReduceOp::Sum, &g_sum.1),
            g_mean
                .0
                .get_reduced(&k, &mut mean, ReduceOp::Mean, &g_mean.1),
            g_plain.0.get_tensor(&k, &mut plain, &g_plain.1),
        )
    };
    let (puts, (s_all, s_some, s_sum, s_mean, s_plain)) =
        tokio::time::timeout(Duration::from_secs(120), async { tokio::join!(puts, gets) })
            .await
            .expect("the quorum's transfer ends");

    // One quorum of 8 putter ranks and 4 getter ranks (the plain getter
    // is refused at the close and takes none).
    let mut ranks: Vec<u32> = puts
        .into_iter()
        .map(|p| {
            let s = p.expect("put").stats.expect("a broadcast put's stats");
            assert_eq!(s.world, Some(12));
            s.rank.unwrap()
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, (0..8).collect::<Vec<u32>>());

    let s_all = s_all.expect("every putter's");
    assert_eq!(s_all.tensors, 8);
    let from: Vec<(u32, String)> = (0..8)
        .map(|r| (r, if r < 4 { "pod-a" } else { "pod-b" }.to_string()))
        .collect();
    assert_eq!(sources(&s_all), from);
    for (p, sd) in all.iter().enumerate() {
        let got = f32s(sd.get("").unwrap());
        let want: Vec<f32> = (0..N).map(|i| value(p as u64, i)).collect();
        assert_eq!(got, want, "putter {p}");
    }
    let s_some = s_some.expect("some by rank");
    assert_eq!(sources(&s_some), [(1, "pod-a".into()), (6, "pod-b".into())]);
    for (r, sd) in &some {
        let want: Vec<f32> = (0..N).map(|i| value(u64::from(*r), i)).collect();
        assert_eq!(f32s(sd.get("").unwrap()), want, "rank {r}");
    }
    s_sum.expect("the sum");
    let want: Vec<f32> = (0..N).map(|i| (0..8).map(|p| value(p, i)).sum()).collect();
    assert_eq!(f32s(sum.get("").unwrap()), want);
    s_mean.expect("the mean");
    let want: Vec<f32> = want.iter().map(|x| x / 8.0).collect();
    assert_eq!(f32s(mean.get("").unwrap()), want);
    let e = s_plain.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("8 putters") && msg.contains("reduce"), "{msg}");
    assert!(f32s(&plain).iter().all(|x| *x == 0.0));
    drop((pods, reader));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_putters_of_another_layout_reductions_a_dtype_lacks_and_a_process_twice() {
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let (p, g) = (c.start_agent("p").await, c.start_agent("g").await);
    let k = Key::parse("sync/flags").unwrap();

    // A reduction of bool tensors is refused before any quorum is joined.
    let mut flags = one(HostTensor::zeros_in(&shm, DType::Bool, &[4]).unwrap());
    let mut gc = client(&c, &g).await;
    let e = gc
        .get_reduced(&k, &mut flags, ReduceOp::Sum, &opts("flags", 2, 5.0, None))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains("bool"), "{e}");
    // So is an integer mean.
    let mut counts = one(HostTensor::zeros_in(&shm, DType::I32, &[4]).unwrap());
    let e = gc
        .get_reduced(
            &k,
            &mut counts,
            ReduceOp::Mean,
            &opts("flags", 2, 5.0, None),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not an integer"), "{e}");

    // One process joins an open round once: its second join (another
    // connection, no label) is refused at once, naming it.
    let w = opts("twice", 3, 3.0, None);
    let k = Key::parse("sync/w").unwrap();
    let src = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let mut dest = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let mut again = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let mut pc = client(&c, &p).await;
    let mut gc2 = client(&c, &g).await;
    let first = async {
        let put = pc.put_tensor(&k, &src, &w);
        let get = gc.get_tensor(&k, &mut dest, &w);
        tokio::join!(put, get)
    };
    let second = async {
        // After the first getter joined: the metadata server shows it.
        kt_tests::wait_until(
            "the first getter's join",
            Duration::from_secs(20),
            || async {
                let body = open_round(&c, "twice").await;
                body.matches("g/").count() == 1
            },
        )
        .await;
        gc2.get_tensor(&k, &mut again, &w).await
    };
    let ((put, got), twice) = tokio::join!(first, second);
    let e = twice.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");
    assert!(e.to_string().contains("already joined"), "{e}");
    // The round goes on without it, closed by its window.
    assert_eq!(put.unwrap().stats.unwrap().world, Some(2));
    got.unwrap();

    // A putter of another layout than the key's first putter is refused
    // as it joins, naming both sides.
    let w = opts("layouts", 3, 3.0, Some("a".into()));
    let k = Key::parse("sync/l").unwrap();
    let a = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let b = HostTensor::zeros_in(&shm, DType::F32, &[N + 1]).unwrap();
    let mut dest = HostTensor::zeros_in(&shm, DType::F32, &[N]).unwrap();
    let mut pc2 = client(&c, &p).await;
    let wb = TensorOptions {
        member: Some("b".into()),
        ..w.clone()
    };
    let first = async {
        let put = pc.put_tensor(&k, &a, &w);
        let get = gc.get_tensor(&k, &mut dest, &w);
        tokio::join!(put, get)
    };
    let second = async {
        kt_tests::wait_until(
            "the first putter's join",
            Duration::from_secs(20),
            || async {
                let body = open_round(&c, "layouts").await;
                body.contains("p/")
            },
        )
        .await;
        pc2.put_tensor(&k, &b, &wb).await
    };
    let ((put, got), other) = tokio::join!(first, second);
    let e = other.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("f32[16]") && msg.contains("f32[17]"), "{msg}");
    put.unwrap();
    got.unwrap();
    drop((p, g));
    c.stop().await;
}
