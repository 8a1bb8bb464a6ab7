//! GPU data on the host backend, with real servers in-process: tensors and
//! state dicts registered with one agent and fetched through another, point
//! to point (packed and not); mismatched destinations; registrations that
//! die with their process and survive their agent's restart.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kt_client::ClientError;
use kt_client::tensor::{HostTensor, Lend, StateDict, TensorClient, TensorOptions, layout};
use kt_tests::{Agent, Cluster, TOKEN, wait_until};
use kt_types::tensor::{DType, Packing};
use kt_types::{ErrorCode, Key};

const WAIT: Duration = Duration::from_secs(20);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

async fn client(c: &Cluster, a: &Agent) -> TensorClient {
    TensorClient::connect(a.socket(), &c.metadata_url(), TOKEN)
        .await
        .expect("agent")
}

/// `n` tensors of mixed dtypes and sizes, filled from `seed` (or zero).
fn state_dict(shm: &Path, n: usize, seed: Option<u64>) -> StateDict<HostTensor> {
    let mut sd = StateDict::new();
    for i in 0..n {
        let (dtype, shape): (DType, Vec<u64>) = match i % 3 {
            0 => (DType::F32, vec![64, 64 + i as u64]),
            1 => (DType::Bf16, vec![128]),
            _ => (DType::I64, vec![3, 5, 7]),
        };
        let mut t = HostTensor::zeros_in(shm, dtype, &shape).unwrap();
        let name = format!("layers.{i}.{dtype}");
        if let Some(s) = seed {
            layout::fill(s, &name, t.bytes_mut());
        }
        sd.push(name, t);
    }
    sd
}

fn assert_seeded(sd: &StateDict<HostTensor>, seed: u64) {
    for (name, t) in sd.iter() {
        assert_eq!(
            layout::first_difference(seed, name, t.bytes()),
            None,
            "tensor {name}"
        );
    }
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    e.code()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_dicts_move_point_to_point_packed_or_not() {
    let c = Cluster::start().await;
    let (a, b) = (c.start_agent("trainer").await, c.start_agent("infer").await);
    let shm = c.shm_dir();
    let k = key("m/weights");
    let sd = state_dict(&shm, 60, Some(11));
    let mut producer = client(&c, &a).await;
    let put = producer
        .put_state_dict(&k, &sd, &TensorOptions::default())
        .await
        .unwrap();
    let rec = put.record.expect("registered");
    assert_eq!(rec.holder, "trainer");
    assert_eq!(rec.tensors.as_ref().map(|t| t.tensors), Some(60));
    assert_eq!(
        rec.size,
        sd.iter().map(|(_, t)| t.handle().len()).sum::<u64>()
    );

    let mut consumer = client(&c, &b).await;
    let mut packed = state_dict(&shm, 60, None);
    let s = consumer
        .get_state_dict(&k, &mut packed, &TensorOptions::default())
        .await
        .unwrap();
    assert_seeded(&packed, 11);
    assert_eq!(s.tensors, 60);
    // Three dtypes, each in one bucket.
    assert_eq!(s.collectives, 3);

    let mut unpacked = state_dict(&shm, 60, None);
    let opts = TensorOptions {
        packing: Some(Packing {
            pack: false,
            ..Packing::default()
        }),
        ..TensorOptions::default()
    };
    let s = consumer
        .get_state_dict(&k, &mut unpacked, &opts)
        .await
        .unwrap();
    assert_seeded(&unpacked, 11);
    assert_eq!(s.collectives, 60);

    // A single tensor; and a getter on the producer's own pod copies locally.
    let one = key("m/one");
    let mut t = HostTensor::zeros_in(&shm, DType::F16, &[1000, 3]).unwrap();
    layout::fill(5, "", t.bytes_mut());
    producer
        .put_tensor(&one, &t, &TensorOptions::default())
        .await
        .unwrap();
    let mut here = HostTensor::zeros_in(&shm, DType::F16, &[1000, 3]).unwrap();
    let s = producer
        .get_tensor(&one, &mut here, &TensorOptions::default())
        .await
        .unwrap();
    assert_eq!(s.collectives, 0);
    assert_eq!(here.bytes(), t.bytes());
    let mut there = HostTensor::zeros_in(&shm, DType::F16, &[1000, 3]).unwrap();
    consumer
        .get_tensor(&one, &mut there, &TensorOptions::default())
        .await
        .unwrap();
    assert_eq!(there.bytes(), t.bytes());
    drop((a, b));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mismatched_destination_is_refused_naming_both_sides() {
    let c = Cluster::start().await;
    let (a, b) = (c.start_agent("p").await, c.start_agent("q").await);
    let shm = c.shm_dir();
    let k = key("m/w");
    let t = HostTensor::zeros_in(&shm, DType::F32, &[10, 10]).unwrap();
    client(&c, &a)
        .await
        .put_tensor(&k, &t, &TensorOptions::default())
        .await
        .unwrap();
    let mut consumer = client(&c, &b).await;
    let mut wrong = HostTensor::zeros_in(&shm, DType::F32, &[10, 11]).unwrap();
    let e = consumer
        .get_tensor(&k, &mut wrong, &TensorOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("f32[10, 10]") && msg.contains("f32[10, 11]"),
        "{msg}"
    );
    let mut dtype = HostTensor::zeros_in(&shm, DType::Bf16, &[10, 10]).unwrap();
    let e = consumer
        .get_tensor(&k, &mut dtype, &TensorOptions::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("bf16[10, 10]"), "{e}");
    // Unknown keys and file keys are clear errors too.
    let mut any = HostTensor::zeros_in(&shm, DType::F32, &[10, 10]).unwrap();
    let e = consumer
        .get_tensor(&key("m/nope"), &mut any, &TensorOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");
    // A file get of a tensor key says what to use instead.
    let files = tempfile::tempdir().unwrap();
    let e = c
        .client()
        .get(&k, files.path(), kt_client::Progress::none())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains("holds tensors"), "{e}");
    // Memory outside the agent's shared-memory directory is refused.
    let elsewhere = tempfile::tempdir().unwrap();
    let outside = HostTensor::zeros_in(elsewhere.path(), DType::F32, &[4]).unwrap();
    let e = consumer
        .put_tensor(&key("m/outside"), &outside, &TensorOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains(kt_types::env::SHM_DIR), "{e}");
    drop((a, b));
    c.stop().await;
}

/// A pod that registers a tensor key with its own listener as the source
/// (`may_advertise` lets it: the listener is on its IP) collects what
/// getters' agents show that source. They show a capability for that key
/// at that "holder", minted for the getter, never the agent's bearer token
/// (with which the listener would be the getter everywhere). A real holder
/// still serves a getter whose agent shows only capabilities.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_getters_agent_shows_a_holder_a_capability_never_its_token() {
    use std::sync::{Arc, Mutex};

    use kt_service::Token;
    use kt_types::auth::{Principal, Role};
    const GETTER: &str = "agent-token-getter-0123";
    const HOLDER: &str = "agent-token-holder-0123";
    let agent = |name: &str| Principal {
        role: Role::Agent,
        name: Some(name.into()),
        services: None,
        reads: None,
        ip: None,
        scope: None,
    };
    let auth = kt_service::Auth::none()
        .with_grant(Token::new(GETTER).unwrap(), agent("getter"))
        .with_grant(Token::new(HOLDER).unwrap(), agent("holder"));
    let c = Cluster::start_authed(Some(auth), |_| {}).await;
    let token = |t: &'static str| {
        move |cfg: &mut kt_agent::Config| cfg.server.token = Token::new(t).unwrap()
    };
    let getter = c.start_agent_with("getter", token(GETTER)).await;
    let holder = c.start_agent_with("holder", token(HOLDER)).await;

    // The rogue source: keeps the Authorization header of every session
    // asked of it, and refuses it.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let kept = seen.clone();
    let app = axum::Router::new().route(
        "/api/v1/tensors/sessions",
        axum::routing::post(move |headers: http::HeaderMap| async move {
            let auth = headers.get(http::header::AUTHORIZATION);
            let shown = auth.and_then(|v| v.to_str().ok()).unwrap_or_default();
            kept.lock().unwrap().push(shown.to_owned());
            let body = kt_types::ErrorBody::new(ErrorCode::Forbidden, "a rogue source");
            (http::StatusCode::FORBIDDEN, axum::Json(body))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rogue = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let summary = kt_types::tensor::TensorSummary {
        tensors: 1,
        device: kt_types::tensor::Device::Cpu,
        dtypes: vec![DType::F32],
    };
    let registration = serde_json::json!({
        "locale": "local", "source": rogue, "holder": "evil-0", "version": "v9",
        "is_dir": false, "size": 400, "files": 1, "tensors": summary,
    });
    let http = kt_api::client();
    let meta = c.metadata_url();
    http.put(format!("{meta}/api/v1/keys/m/rogue"))
        .bearer_auth(TOKEN)
        .json(&registration)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap();
    let shm = c.shm_dir();
    let mut dest = HostTensor::zeros_in(&shm, DType::F32, &[10, 10]).unwrap();
    let e = client(&c, &getter)
        .await
        .get_tensor(&key("m/rogue"), &mut dest, &TensorOptions::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("a rogue source"), "{e}");
    let shown = seen.lock().unwrap().clone();
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_ne!(shown[0], format!("Bearer {GETTER}"));
    assert!(!shown[0].contains(GETTER), "{shown:?}");
    // What it got is worth that key at that "holder" alone.
    let capability = shown[0].strip_prefix("Bearer ").unwrap();
    let beat = kt_types::api::AgentHeartbeat {
        id: "evil-0".into(),
        url: rogue.clone(),
        service: None,
        serves: Vec::new(),
    };
    let reply: kt_types::api::HeartbeatReply = http
        .post(format!("{meta}/api/v1/agents"))
        .bearer_auth(TOKEN)
        .json(&beat)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let verifier = kt_service::capability::Verifier::new("evil-0");
    verifier.set_keys(&reply.capability_keys);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let cap = verifier.verify(capability, now).expect("a capability");
    assert_eq!(cap.scope.key, key("m/rogue"));
    assert_eq!(cap.scope.version, "v9");
    assert_eq!(cap.getter, "getter");

    // A real holder serves the getter, which shows it capabilities only.
    let k = key("m/real");
    let sd = state_dict(&shm, 3, Some(4));
    client(&c, &holder)
        .await
        .put_state_dict(&k, &sd, &TensorOptions::default())
        .await
        .unwrap();
    let mut got = state_dict(&shm, 3, None);
    client(&c, &getter)
        .await
        .get_state_dict(&k, &mut got, &TensorOptions::default())
        .await
        .unwrap();
    assert_seeded(&got, 4);
    drop((getter, holder));
    c.stop().await;
}

/// A producer in its own process, holding `key` until killed.
struct Holder(Child);

impl Holder {
    fn start(a: &Agent, shm: &Path, key: &str, seed: u64) -> Holder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kt-test-node"))
            .args(["tensor-hold"])
            .arg(a.socket())
            .arg(shm)
            .args([key, &seed.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("kt-test-node");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("holder output");
        assert_eq!(line.trim(), "holding", "the holder failed to register");
        Holder(child)
    }

    fn kill(&mut self) {
        self.0.kill().expect("kill");
        self.0.wait().expect("reap");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn held(shm: &Path) -> StateDict<HostTensor> {
    (0..4)
        .map(|i| {
            (
                format!("w.{i}"),
                HostTensor::zeros_in(shm, DType::F32, &[256, 256]).unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registrations_die_with_their_process_and_belong_to_it() {
    let c = Cluster::start().await;
    let (a, b) = (c.start_agent("p").await, c.start_agent("q").await);
    let shm = c.shm_dir();
    let mut holder = Holder::start(&a, &shm, "m/held", 3);
    let mut consumer = client(&c, &b).await;
    let mut dest = held(&shm);
    consumer
        .get_state_dict(&key("m/held"), &mut dest, &TensorOptions::default())
        .await
        .unwrap();
    assert_seeded(&dest, 3);

    // Another live process may not take the key over.
    let t = HostTensor::zeros_in(&shm, DType::F32, &[256, 256]).unwrap();
    let e = client(&c, &a)
        .await
        .put_tensor(&key("m/held"), &t, &TensorOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::Conflict), "{e}");

    holder.kill();
    let md = c.client();
    wait_until(
        "the dead producer's key to be unregistered",
        WAIT,
        || async { md.stat(&key("m/held")).await.is_err() },
    )
    .await;
    let e = consumer
        .get_state_dict(&key("m/held"), &mut dest, &TensorOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");
    drop((a, b));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_serves_the_registrations_of_live_processes() {
    let c = Cluster::start().await;
    let (mut a, b) = (c.start_agent("p").await, c.start_agent("q").await);
    let shm = c.shm_dir();
    let _holder = Holder::start(&a, &shm, "m/kept", 9);
    a.restart().await;
    let mut dest = held(&shm);
    client(&c, &b)
        .await
        .get_state_dict(&key("m/kept"), &mut dest, &TensorOptions::default())
        .await
        .unwrap();
    assert_seeded(&dest, 9);
    drop((a, b));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_unregisters_what_processes_dead_meanwhile_left() {
    let c = Cluster::start().await;
    let mut a = c.start_agent("p").await;
    let shm = c.shm_dir();
    let mut holder = Holder::start(&a, &shm, "m/orphan", 5);
    let md = c.client();
    assert!(md.stat(&key("m/orphan")).await.is_ok());
    // The holder dies while its agent is down: no reaper saw it go.
    a.restart_after(async { holder.kill() }).await;
    wait_until(
        "the dead producer's key to be unregistered after the restart",
        WAIT,
        || async { md.stat(&key("m/orphan")).await.is_err() },
    )
    .await;
    drop(a);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn empty_tensors_move_and_multi_key_broadcasts_need_a_group() {
    let c = Cluster::start().await;
    let (a, b) = (c.start_agent("p").await, c.start_agent("q").await);
    let shm = c.shm_dir();
    let mut src = StateDict::new();
    src.push(
        "empty",
        HostTensor::zeros_in(&shm, DType::F32, &[0, 8]).unwrap(),
    );
    let mut full = HostTensor::zeros_in(&shm, DType::F32, &[16]).unwrap();
    layout::fill(4, "full", full.bytes_mut());
    src.push("full", full);
    let mut producer = client(&c, &a).await;
    producer
        .put_state_dict(&key("m/sparse"), &src, &TensorOptions::default())
        .await
        .unwrap();
    let mut dest = StateDict::new();
    dest.push(
        "empty",
        HostTensor::zeros_in(&shm, DType::F32, &[0, 8]).unwrap(),
    );
    dest.push(
        "full",
        HostTensor::zeros_in(&shm, DType::F32, &[16]).unwrap(),
    );
    let mut consumer = client(&c, &b).await;
    let s = consumer
        .get_state_dict(&key("m/sparse"), &mut dest, &TensorOptions::default())
        .await
        .unwrap();
    assert_eq!((s.tensors, s.bytes), (2, 64));
    assert_eq!(
        layout::first_difference(4, "full", dest.get("full").unwrap().bytes()),
        None
    );

    // Putters join their own key's group when they name none: a getter of
    // two keys could never meet both, so it must name one.
    let w = kt_types::BroadcastWindow {
        world_size: Some(3),
        ..kt_types::BroadcastWindow::default()
    };
    let e = consumer
        .get_many(
            &mut [(key("m/one"), &mut dest), (key("m/two"), &mut src)],
            &TensorOptions {
                broadcast: Some(w),
                ..TensorOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains("needs a group id"), "{e}");
    drop((a, b));
    c.stop().await;
}

fn window(group: &str, world: u32, pack: bool) -> kt_types::BroadcastWindow {
    kt_types::BroadcastWindow {
        group_id: Some(group.into()),
        world_size: Some(world),
        timeout_secs: Some(30.0),
        fanout: 2,
        pack,
        bucket_bytes: Some(1 << 20),
        ..kt_types::BroadcastWindow::default()
    }
}

/// One putter and `getters` getters of one quorum, each in its own pod.
async fn broadcast(pack: bool) {
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let putter = c.start_agent("trainer").await;
    let mut getters = Vec::new();
    for i in 0..4 {
        getters.push(c.start_agent(&format!("infer-{i}")).await);
    }
    let k = key("rl/weights");
    let group = format!("step-{pack}");
    let w = window(&group, 5, pack);
    let opts = TensorOptions {
        broadcast: Some(w),
        ..TensorOptions::default()
    };
    let src = state_dict(&shm, 30, Some(21));
    let mut producer = client(&c, &putter).await;
    let mut consumers = Vec::new();
    for g in &getters {
        consumers.push((client(&c, g).await, state_dict(&shm, 30, None)));
    }
    let put = producer.put_state_dict(&k, &src, &opts);
    let gets = futures::future::join_all(
        consumers
            .iter_mut()
            .map(|(cl, dest)| cl.get_state_dict(&k, dest, &opts)),
    );
    let (put, gets) = tokio::join!(put, gets);
    let put = put.unwrap();
    let ps = put.stats.expect("a broadcast put reports its transfer");
    assert_eq!((ps.rank, ps.world), (Some(0), Some(5)));
    let mut ranks = Vec::new();
    for g in gets {
        let s = g.unwrap();
        ranks.push(s.rank.unwrap());
        assert_eq!(s.tensors, 30);
        if pack {
            // Three dtypes, one bucket each.
            assert_eq!(s.collectives, 3);
        } else {
            assert_eq!(s.collectives, 30);
        }
    }
    ranks.sort();
    assert_eq!(ranks, [1, 2, 3, 4]);
    for (_, dest) in &consumers {
        assert_seeded(dest, 21);
    }
    drop((putter, getters));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_broadcast_reaches_every_getter() {
    broadcast(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_packed_quorum_broadcast_reaches_every_getter() {
    broadcast(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_putters_many_getters_in_one_quorum() {
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let mut agents = Vec::new();
    for id in ["p0", "p1", "g0", "g1", "g2"] {
        agents.push(c.start_agent(id).await);
    }
    let (ka, kb) = (key("m2m/a"), key("m2m/b"));
    let opts = TensorOptions {
        broadcast: Some(window("m2m", 5, true)),
        ..TensorOptions::default()
    };
    let (sa, sb) = (state_dict(&shm, 9, Some(1)), state_dict(&shm, 9, Some(2)));
    let mut p0 = client(&c, &agents[0]).await;
    let mut p1 = client(&c, &agents[1]).await;
    let mut gs = Vec::new();
    for a in &agents[2..] {
        gs.push((
            client(&c, a).await,
            state_dict(&shm, 9, None),
            state_dict(&shm, 9, None),
        ));
    }
    let puts = async {
        tokio::join!(
            p0.put_state_dict(&ka, &sa, &opts),
            p1.put_state_dict(&kb, &sb, &opts)
        )
    };
    let gets = futures::future::join_all(gs.iter_mut().map(|(cl, da, db)| {
        let (ka, kb, opts) = (ka.clone(), kb.clone(), opts.clone());
        async move {
            let mut both = [(ka, da), (kb, db)];
            cl.get_many(&mut both, &opts).await
        }
    }));
    let ((a, b), gets) = tokio::join!(puts, gets);
    a.unwrap();
    b.unwrap();
    for g in gets {
        assert_eq!(g.unwrap().tensors, 18);
    }
    for (_, da, db) in &gs {
        assert_seeded(da, 1);
        assert_seeded(db, 2);
    }
    drop(agents);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_closes_on_its_timeout_and_a_mismatched_getter_gets_its_error() {
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let (p, g, bad) = (
        c.start_agent("p").await,
        c.start_agent("g").await,
        c.start_agent("bad").await,
    );
    let k = key("q/w");
    // world_size 10 never comes: the window (2 s) closes it.
    let mut w = window("short", 10, false);
    w.timeout_secs = Some(2.0);
    let opts = TensorOptions {
        broadcast: Some(w),
        ..TensorOptions::default()
    };
    let src = state_dict(&shm, 3, Some(4));
    let mut dest = state_dict(&shm, 3, None);
    let mut wrong = state_dict(&shm, 4, None);
    let (mut pc, mut gc, mut bc) = (
        client(&c, &p).await,
        client(&c, &g).await,
        client(&c, &bad).await,
    );
    let (put, got, refused) = tokio::join!(
        pc.put_state_dict(&k, &src, &opts),
        gc.get_state_dict(&k, &mut dest, &opts),
        bc.get_state_dict(&k, &mut wrong, &opts),
    );
    assert_eq!(put.unwrap().stats.unwrap().world, Some(2));
    assert_eq!(got.unwrap().world, Some(2));
    assert_seeded(&dest, 4);
    let e = refused.unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains("holds 3 tensors"), "{e}");
    drop((p, g, bad));
    c.stop().await;
}

/// The members of `group`'s open round (none when it has none).
async fn quorum_members(c: &Cluster, group: &str) -> Vec<String> {
    let meta = kt_api::Api::new(kt_api::client(), &c.metadata_url(), TOKEN);
    let info: Result<kt_types::tensor::QuorumInfo, _> =
        meta.get(&kt_types::paths::quorum(group)).fetch().await;
    match info {
        Ok(i) => i.open.map(|r| r.members).unwrap_or_default(),
        Err(e) if e.code() == ErrorCode::NotFound => Vec::new(),
        Err(e) => panic!("quorum {group}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_wait_whose_client_went_away_leaves_the_round_at_once() {
    // A getter interrupted while its quorum is open (Ctrl-C) closes its
    // connection: its agent withdraws the join then, rather than keeping
    // the member in the round for the window (two minutes), so the same
    // process may join the group again at once.
    let c = Cluster::start().await;
    let shm = c.shm_dir();
    let (p, g) = (c.start_agent("p").await, c.start_agent("g").await);
    let k = key("q/interrupted");
    let mut w = window("interrupted", 2, false);
    w.timeout_secs = Some(120.0);
    let opts = TensorOptions {
        broadcast: Some(w),
        ..TensorOptions::default()
    };
    let mut first = client(&c, &g).await;
    let (k1, o1, s1) = (k.clone(), opts.clone(), shm.clone());
    let waiting = tokio::spawn(async move {
        let mut dest = state_dict(&s1, 3, None);
        first.get_state_dict(&k1, &mut dest, &o1).await.map(|_| ())
    });
    wait_until("the getter's join", WAIT, || async {
        quorum_members(&c, "interrupted").await.len() == 1
    })
    .await;
    // Its connection closes with the task (the client is gone).
    waiting.abort();
    assert!(waiting.await.expect_err("aborted").is_cancelled());
    wait_until("the abandoned join to leave the round", WAIT, || async {
        quorum_members(&c, "interrupted").await.is_empty()
    })
    .await;
    // The same process joins again and a putter comes: the round holds
    // these two alone.
    let src = state_dict(&shm, 3, Some(8));
    let mut dest = state_dict(&shm, 3, None);
    let (mut pc, mut gc) = (client(&c, &p).await, client(&c, &g).await);
    let (put, got) = tokio::join!(
        pc.put_state_dict(&k, &src, &opts),
        gc.get_state_dict(&k, &mut dest, &opts),
    );
    assert_eq!(put.unwrap().stats.unwrap().world, Some(2));
    assert_eq!(got.unwrap().world, Some(2));
    assert_seeded(&dest, 8);
    drop((p, g));
    c.stop().await;
}
