//! The metadata server's quorums of GPU broadcasts over HTTP: rounds that
//! close on world size, ips or timeout; plans, refusals, members that go
//! away; rendezvous and completion of the transfer; restarts.
//!
//! The members are fake: they speak the quorum routes and move no data, so
//! the endpoints they announce are never dialled.

use std::path::Path;
use std::time::Duration;

use kt_service::Token;
use kt_tests::{TOKEN, wait_until};
use kt_types::BroadcastWindow;
use kt_types::tensor::{
    BackendKind, DType, QuorumDone, QuorumInfo, QuorumJoin, QuorumKey, QuorumPlan, QuorumRole,
    QuorumStatus, Rendezvous, TensorDesc, TensorMeta,
};
use kt_types::{ErrorBody, ErrorCode, Key};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Longest wait for any answer.
const WAIT: Duration = Duration::from_secs(20);

/// A metadata server alone, restartable on the same address and directory.
#[derive(Debug)]
struct Meta {
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

/// A refused request: its status and error (status 0: no HTTP answer).
#[derive(Debug)]
struct Refused {
    status: u16,
    code: Option<ErrorCode>,
    message: String,
}

type Answer<T> = Result<T, Refused>;

/// An answer as the type expected of it.
macro_rules! typed {
    ($a:expr) => {
        $a.map(|v| serde_json::from_value(v).expect("the answer's type"))
    };
}

impl Meta {
    async fn start(dir: &Path, addr: &str) -> Meta {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(TOKEN).unwrap());
        let shutdown = CancellationToken::new();
        let s = shutdown.clone();
        let task = tokio::spawn(async move {
            kt_metadata::run(listener, cfg, s).await.unwrap();
        });
        Meta {
            addr,
            shutdown,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}/api/v1/quorums/{path}", self.addr)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }

    /// `POST {group}/join` in its own task, on its own connection (aborting
    /// the task closes it).
    fn join(&self, group: &str, j: &QuorumJoin) -> JoinHandle<Answer<QuorumPlan>> {
        let req = kt_api::client()
            .post(self.url(&format!("{group}/join")))
            .json(j);
        tokio::spawn(async move { typed!(call(req).await) })
    }

    async fn info(&self, group: &str) -> Answer<QuorumInfo> {
        typed!(call(kt_api::client().get(self.url(group))).await)
    }

    /// Agents of `group`'s open round (none when it has none).
    async fn members(&self, group: &str) -> Vec<String> {
        match self.info(group).await {
            Ok(i) => i.open.map(|r| r.members).unwrap_or_default(),
            Err(r) if r.code == Some(ErrorCode::NotFound) => Vec::new(),
            Err(r) => panic!("info of {group}: {r:?}"),
        }
    }

    /// Waits until `group`'s open round has exactly these members.
    async fn wait_members(&self, group: &str, want: &[&str]) {
        wait_until(&format!("members {want:?} in {group}"), WAIT, || async {
            self.members(group).await == want
        })
        .await;
    }

    async fn status(&self, group: &str, id: &str, wait_ms: u64) -> Answer<QuorumStatus> {
        let url = self.url(&format!("{group}/{id}?wait_ms={wait_ms}"));
        typed!(call(kt_api::client().get(url)).await)
    }

    async fn done(
        &self,
        group: &str,
        id: &str,
        rank: u32,
        error: Option<&str>,
    ) -> Answer<QuorumStatus> {
        let d = QuorumDone {
            rank,
            error: error.map(str::to_owned),
            stats: Default::default(),
        };
        let url = self.url(&format!("{group}/{id}/done"));
        typed!(call(kt_api::client().post(url).json(&d)).await)
    }

    async fn publish(&self, group: &str, id: &str, blob: &str) -> Answer<Rendezvous> {
        let r = Rendezvous { blob: blob.into() };
        let url = self.url(&format!("{group}/{id}/rendezvous"));
        typed!(call(kt_api::client().put(url).json(&r)).await)
    }

    fn rendezvous(&self, group: &str, id: &str, wait_ms: u64) -> JoinHandle<Answer<Rendezvous>> {
        let url = self.url(&format!("{group}/{id}/rendezvous?wait_ms={wait_ms}"));
        let req = kt_api::client().get(url);
        tokio::spawn(async move { typed!(call(req).await) })
    }
}

/// Sends `req` with the token: the JSON answer, or the refusal.
async fn call(req: reqwest::RequestBuilder) -> Answer<serde_json::Value> {
    let transport = |e: reqwest::Error| Refused {
        status: 0,
        code: None,
        message: e.to_string(),
    };
    let resp = req.bearer_auth(TOKEN).send().await.map_err(transport)?;
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(transport)?;
    if status.is_success() {
        return Ok(serde_json::from_slice(&bytes).expect("a JSON answer"));
    }
    let body: ErrorBody = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "{status}: not an error body ({e}): {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    Err(Refused {
        status: status.as_u16(),
        code: Some(body.error.code),
        message: body.error.message,
    })
}

/// The answer of a spawned request, within [`WAIT`].
async fn answer<T>(h: JoinHandle<Answer<T>>) -> Answer<T> {
    tokio::time::timeout(WAIT, h)
        .await
        .expect("an answer in time")
        .expect("the request's task")
}

/// Asserts a refusal's status and code, and that its message holds `what`.
fn refused<T: std::fmt::Debug>(a: Answer<T>, status: u16, code: ErrorCode, what: &str) -> String {
    let r = a.expect_err("a refusal");
    assert_eq!((r.status, r.code), (status, Some(code)), "{}", r.message);
    assert!(r.message.contains(what), "{what:?} not in {:?}", r.message);
    r.message
}

fn key(k: &str, len: u64) -> QuorumKey {
    QuorumKey {
        from: None,
        key: Key::parse(k).unwrap(),
        version: format!("v-{k}"),
        tensors: vec![TensorDesc {
            name: "w".into(),
            meta: TensorMeta::new(DType::F32, [len]),
        }],
    }
}

fn window(world: Option<u32>, secs: f64) -> BroadcastWindow {
    BroadcastWindow {
        world_size: world,
        timeout_secs: Some(secs),
        fanout: 2,
        ..BroadcastWindow::default()
    }
}

/// Agent `aN` has IP 10.0.0.N.
fn member(agent: &str, role: QuorumRole, w: &BroadcastWindow) -> QuorumJoin {
    let n: u32 = agent[1..].parse().unwrap();
    QuorumJoin {
        member: String::new(),
        node: String::new(),
        agent: agent.into(),
        ip: format!("10.0.0.{n}"),
        endpoint: format!("10.0.0.{n}:8100"),
        backend: BackendKind::Host,
        role,
        window: w.clone(),
        comms: Vec::new(),
    }
}

fn putter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
    member(agent, QuorumRole::Put { keys }, w)
}

fn getter(agent: &str, keys: Vec<QuorumKey>, w: &BroadcastWindow) -> QuorumJoin {
    member(agent, QuorumRole::Get { keys }, w)
}

fn agents(p: &QuorumPlan) -> Vec<&str> {
    p.plan.ranks.iter().map(|r| r.agent.as_str()).collect()
}

/// A closed round of putter a1 and getter a2 on `k`: their plans.
async fn closed_pair(m: &Meta, group: &str) -> (QuorumPlan, QuorumPlan) {
    let w = window(Some(2), 60.0);
    let g = m.join(group, &getter("a2", vec![key("k", 4)], &w));
    let p = m.join(group, &putter("a1", vec![key("k", 4)], &w));
    (answer(p).await.unwrap(), answer(g).await.unwrap())
}

#[tokio::test]
async fn a_round_closes_on_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(3), 60.0);
    let g2 = m.join("ws", &getter("a2", vec![key("k", 4)], &w));
    m.wait_members("ws", &["a2"]).await;
    let g3 = m.join("ws", &getter("a3", vec![key("k", 4)], &w));
    m.wait_members("ws", &["a2", "a3"]).await;
    let info = m.info("ws").await.unwrap();
    let open = info.open.unwrap();
    assert_eq!(open.world_size, Some(3));
    assert!(open.closes_in_ms > 0 && open.closes_in_ms <= 60_000);
    // The putter comes last and still takes rank 0.
    let p = answer(m.join("ws", &putter("a1", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    let (a2, a3) = (answer(g2).await.unwrap(), answer(g3).await.unwrap());
    assert_eq!((p.rank, a2.rank, a3.rank), (0, 1, 2));
    assert_eq!(p.closed_by, "world_size");
    assert_eq!(p.group, "ws");
    assert_eq!(agents(&p), ["a1", "a2", "a3"]);
    assert_eq!((&a2.plan, &a3.plan), (&p.plan, &p.plan));
    let flow = &p.plan.flows[..];
    assert_eq!(flow.len(), 1);
    assert_eq!((flow[0].root, &flow[0].receivers[..]), (0, &[1, 2][..]));
    assert_eq!(flow[0].version, "v-k");
    assert_eq!(p.plan.fanout, 2);
    assert_eq!(p.plan.ranks[1].endpoint, "10.0.0.2:8100");
    let info = m.info("ws").await.unwrap();
    assert!(info.open.is_none());
    assert_eq!(info.transfers.len(), 1);
    assert_eq!(info.transfers[0].transfer, p.plan.id);
    assert_eq!(info.transfers[0].world, 3);
    m.stop().await;
}

#[tokio::test]
async fn a_round_closes_when_every_listed_ip_joined() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let mut w = window(None, 60.0);
    w.ips = vec!["10.0.0.1".into(), "10.0.0.3".into()];
    w.pack = true;
    w.bucket_bytes = Some(4 << 20);
    let g = m.join("ips", &getter("a3", vec![key("k", 4)], &w));
    m.wait_members("ips", &["a3"]).await;
    let p = answer(m.join("ips", &putter("a1", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    assert_eq!(p.closed_by, "ips");
    assert_eq!(agents(&p), ["a1", "a3"]);
    assert!(p.plan.packing.pack);
    assert_eq!(p.plan.packing.bucket_bytes, 4 << 20);
    assert_eq!(answer(g).await.unwrap().rank, 1);
    m.stop().await;
}

#[tokio::test]
async fn a_round_closes_on_timeout_with_whoever_joined() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(10), 0.2);
    let p = m.join("late", &putter("a1", vec![key("k", 4)], &w));
    m.wait_members("late", &["a1"]).await;
    let g = m.join("late", &getter("a2", vec![key("k", 4)], &w));
    let (p, g) = (answer(p).await.unwrap(), answer(g).await.unwrap());
    assert_eq!(
        (p.closed_by.as_str(), g.closed_by.as_str()),
        ("timeout", "timeout")
    );
    assert_eq!(agents(&p), ["a1", "a2"]);
    assert_eq!(g.rank, 1);
    m.stop().await;
}

#[tokio::test]
async fn without_a_putter_every_member_gets_no_source() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(None, 0.2);
    let a = m.join("nobody", &getter("a1", vec![key("k", 4)], &w));
    let b = m.join("nobody", &getter("a2", vec![key("k", 4)], &w));
    for h in [a, b] {
        let msg = refused(answer(h).await, 503, ErrorCode::NoSource, "no putter");
        assert_eq!(msg, "quorum nobody closed by timeout with no putter");
    }
    // Nothing is kept: the group is unknown again.
    refused(m.info("nobody").await, 404, ErrorCode::NotFound, "nobody");
    m.stop().await;
}

#[tokio::test]
async fn a_mismatched_destination_is_refused_and_the_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(3), 60.0);
    let bad = m.join("mm", &getter("a2", vec![key("k", 5)], &w));
    m.wait_members("mm", &["a2"]).await;
    let good = m.join("mm", &getter("a3", vec![key("k", 4)], &w));
    m.wait_members("mm", &["a2", "a3"]).await;
    let p = answer(m.join("mm", &putter("a1", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    let msg = refused(answer(bad).await, 400, ErrorCode::InvalidRequest, "f32[4]");
    assert!(msg.contains("f32[5]"), "{msg}");
    let good = answer(good).await.unwrap();
    assert_eq!(agents(&p), ["a1", "a3"]);
    assert_eq!((good.rank, &good.plan), (1, &p.plan));
    assert_eq!(p.plan.flows[0].receivers, [1]);
    m.stop().await;
}

#[tokio::test]
async fn a_getter_wanting_a_key_nobody_puts_gets_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(3), 60.0);
    let lost = m.join("nf", &getter("a2", vec![key("k", 4), key("gone", 4)], &w));
    m.wait_members("nf", &["a2"]).await;
    let good = m.join("nf", &getter("a3", vec![key("k", 4)], &w));
    m.wait_members("nf", &["a2", "a3"]).await;
    let p = answer(m.join("nf", &putter("a1", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    let msg = refused(answer(lost).await, 404, ErrorCode::NotFound, "gone");
    assert_eq!(msg, "no member of quorum nf puts key gone");
    assert_eq!(answer(good).await.unwrap().plan, p.plan);
    assert_eq!(agents(&p), ["a1", "a3"]);
    m.stop().await;
}

#[tokio::test]
async fn conflicting_joins_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(2), 60.0);
    let first = m.join("cf", &putter("a1", vec![key("k", 4)], &w));
    m.wait_members("cf", &["a1"]).await;
    // The same member (pod and process) again, even as a getter: one rank
    // per process.
    let again = m.join("cf", &getter("a1", vec![key("k", 4)], &w));
    refused(
        answer(again).await,
        409,
        ErrorCode::Conflict,
        "one rank per process",
    );
    // Another putter of the same key, with another layout.
    let twice = m.join("cf", &putter("a2", vec![key("j", 4), key("k", 5)], &w));
    let msg = refused(
        answer(twice).await,
        400,
        ErrorCode::InvalidRequest,
        "a1 already puts it",
    );
    assert!(msg.contains("f32[4]") && msg.contains("f32[5]"), "{msg}");
    // A member on another backend.
    let mut nccl = getter("a3", vec![key("k", 4)], &w);
    nccl.backend = BackendKind::Nccl;
    let msg = refused(
        answer(m.join("cf", &nccl)).await,
        400,
        ErrorCode::InvalidRequest,
        "host",
    );
    assert!(msg.contains("nccl"), "{msg}");
    assert_eq!(m.members("cf").await, ["a1"]);
    // The round still closes with the next good member.
    let g = answer(m.join("cf", &getter("a4", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    assert_eq!(agents(&g), ["a1", "a4"]);
    answer(first).await.unwrap();
    m.stop().await;
}

#[tokio::test]
async fn a_member_that_goes_away_leaves_the_round() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let w = window(Some(3), 60.0);
    let p = m.join("away", &putter("a1", vec![key("k", 4)], &w));
    m.wait_members("away", &["a1"]).await;
    let gone = m.join("away", &getter("a2", vec![key("k", 4)], &w));
    m.wait_members("away", &["a1", "a2"]).await;
    // Its client disconnects: the server drops its join, it leaves.
    gone.abort();
    m.wait_members("away", &["a1"]).await;
    // So the next getter makes two members, not world size 3.
    let g3 = m.join("away", &getter("a3", vec![key("k", 4)], &w));
    m.wait_members("away", &["a1", "a3"]).await;
    assert!(!g3.is_finished());
    let g4 = answer(m.join("away", &getter("a4", vec![key("k", 4)], &w)))
        .await
        .unwrap();
    assert_eq!(agents(&g4), ["a1", "a3", "a4"]);
    assert_eq!(answer(g3).await.unwrap().plan, g4.plan);
    answer(p).await.unwrap();
    // The only member goes away: the round is forgotten.
    let alone = m.join("alone", &putter("a1", vec![key("k", 4)], &w));
    m.wait_members("alone", &["a1"]).await;
    alone.abort();
    wait_until("the round forgotten", WAIT, || async {
        m.info("alone").await.is_err()
    })
    .await;
    m.stop().await;
}

#[tokio::test]
async fn the_rendezvous_is_long_polled() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let (p, _) = closed_pair(&m, "rv").await;
    let id = &p.plan.id;
    let early = answer(m.rendezvous("rv", id, 50)).await;
    let msg = refused(early, 503, ErrorCode::Unavailable, "has not published");
    assert!(msg.contains(id.as_str()), "{msg}");
    // Rank 1 waits; rank 0 publishes; rank 1 gets it.
    let waiting = m.rendezvous("rv", id, 30_000);
    let published = m.publish("rv", id, "nccl-unique-id").await.unwrap();
    assert_eq!(published.blob, "nccl-unique-id");
    assert_eq!(answer(waiting).await.unwrap().blob, "nccl-unique-id");
    // Once: the same blob again is fine, another is a conflict.
    m.publish("rv", id, "nccl-unique-id").await.unwrap();
    refused(
        m.publish("rv", id, "other").await,
        409,
        ErrorCode::Conflict,
        "another rendezvous",
    );
    refused(
        m.publish("rv", id, "").await,
        400,
        ErrorCode::InvalidRequest,
        "blob",
    );
    refused(
        answer(m.rendezvous("rv", "nope", 10)).await,
        404,
        ErrorCode::NotFound,
        "nope",
    );
    refused(
        answer(m.rendezvous("nope", id, 10)).await,
        404,
        ErrorCode::NotFound,
        "nope",
    );
    m.stop().await;
}

#[tokio::test]
async fn reports_complete_the_transfer() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let (p, _) = closed_pair(&m, "dn").await;
    let id = p.plan.id.clone();
    let waiting = {
        let url = m.url(&format!("dn/{id}?wait_ms=30000"));
        let req = kt_api::client().get(url);
        tokio::spawn(async move {
            let s: Answer<QuorumStatus> = typed!(call(req).await);
            s
        })
    };
    let s = m.done("dn", &id, 0, None).await.unwrap();
    assert_eq!((s.done.as_slice(), s.complete), (&[0][..], false));
    refused(
        m.done("dn", &id, 0, None).await,
        409,
        ErrorCode::Conflict,
        "already reported",
    );
    refused(
        m.done("dn", &id, 2, None).await,
        400,
        ErrorCode::InvalidRequest,
        "rank 2",
    );
    refused(
        m.done("dn", "nope", 1, None).await,
        404,
        ErrorCode::NotFound,
        "nope",
    );
    let s = m.done("dn", &id, 1, Some("nccl timeout")).await.unwrap();
    assert!(s.complete);
    let s = answer(waiting).await.unwrap();
    assert!(s.complete);
    assert_eq!(
        (s.group.as_str(), s.transfer.as_str(), s.world),
        ("dn", id.as_str(), 2)
    );
    assert_eq!(s.done, [0]);
    assert_eq!(s.failed, [(1, "nccl timeout".to_owned())]);
    assert_eq!(m.status("dn", &id, 0).await.unwrap(), s);
    // The transfer's duration (close to last report) is a metric.
    let text = kt_api::client()
        .get(format!("http://{}/metrics", m.addr))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let count = r#"kt_transfer_duration_seconds_count{kind="quorum"} 1"#;
    assert!(text.contains(count), "{text}");
    refused(
        m.status("dn", "nope", 0).await,
        404,
        ErrorCode::NotFound,
        "nope",
    );
    refused(
        m.status("nope", &id, 0).await,
        404,
        ErrorCode::NotFound,
        "nope",
    );
    m.stop().await;
}

#[tokio::test]
async fn status_without_every_report_answers_after_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let (p, _) = closed_pair(&m, "st").await;
    let id = &p.plan.id;
    let s = m.status("st", id, 0).await.unwrap();
    assert!(!s.complete && s.done.is_empty() && s.failed.is_empty());
    m.done("st", id, 1, None).await.unwrap();
    let s = m.status("st", id, 50).await.unwrap();
    assert_eq!((s.done.as_slice(), s.complete), (&[1][..], false));
    m.stop().await;
}

#[tokio::test]
async fn a_join_after_the_close_opens_a_new_round() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let (first, _) = closed_pair(&m, "again").await;
    let (second, g) = closed_pair(&m, "again").await;
    assert_ne!(first.plan.id, second.plan.id);
    assert_eq!(g.plan.id, second.plan.id);
    // The first transfer is still there.
    m.done("again", &first.plan.id, 0, None).await.unwrap();
    let info = m.info("again").await.unwrap();
    let ids: Vec<&str> = info.transfers.iter().map(|t| t.transfer.as_str()).collect();
    assert_eq!(ids, [first.plan.id.as_str(), second.plan.id.as_str()]);
    m.stop().await;
}

#[tokio::test]
async fn bad_joins_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let ok = putter("a1", vec![key("k", 4)], &window(Some(2), 5.0));
    let bad_window = |world, secs| putter("a1", vec![key("k", 4)], &window(world, secs));
    let mut bad_ip = ok.clone();
    bad_ip.ip = "pod-1".into();
    let mut small_bucket = ok.clone();
    small_bucket.window.bucket_bytes = Some(1024);
    let mut no_keys = ok.clone();
    no_keys.role = QuorumRole::Put { keys: vec![] };
    let long_group = "g".repeat(200);
    let cases: Vec<(&str, QuorumJoin, &str)> = vec![
        ("bad~group", ok.clone(), "group id"),
        (&long_group, ok.clone(), "group id"),
        ("join", ok.clone(), "reserved"),
        (
            "g",
            bad_window(Some(1), 5.0),
            "world_size must be 2 or more",
        ),
        ("g", bad_window(None, -1.0), "timeout_secs"),
        ("g", bad_window(None, 0.0), "timeout_secs"),
        ("g", bad_window(None, 7200.0), "timeout_secs"),
        ("g", bad_ip, "not an IP address"),
        ("g", small_bucket, "minimum"),
        ("g", no_keys, "keys"),
    ];
    for (group, j, what) in cases {
        refused(
            answer(m.join(group, &j)).await,
            400,
            ErrorCode::InvalidRequest,
            what,
        );
    }
    // Not JSON of a join.
    let req = kt_api::client()
        .post(m.url("g/join"))
        .header("content-type", "application/json")
        .body(r#"{"agent":"a1"}"#);
    refused(call(req).await, 400, ErrorCode::InvalidRequest, "");
    // Nothing was opened.
    refused(m.info("g").await, 404, ErrorCode::NotFound, "g");
    // Without the token.
    let resp = kt_api::client()
        .post(m.url("g/join"))
        .json(&ok)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    m.stop().await;
}

#[tokio::test]
async fn a_restart_fails_open_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let (p, _) = closed_pair(&m, "rs").await;
    let w = window(Some(2), 60.0);
    let open = m.join("rs", &putter("a1", vec![key("k", 4)], &w));
    m.wait_members("rs", &["a1"]).await;
    let addr = m.addr.to_string();
    m.stop().await;
    // The member learns that the quorum is abandoned (or its connection breaks).
    let r = answer(open)
        .await
        .expect_err("no plan from a stopped server");
    assert!(
        r.status == 0 || (r.status, r.code) == (503, Some(ErrorCode::Unavailable)),
        "{r:?}"
    );
    let m = Meta::start(dir.path(), &addr).await;
    // Neither the round nor the transfer survived.
    refused(m.info("rs").await, 404, ErrorCode::NotFound, "rs");
    refused(
        m.done("rs", &p.plan.id, 0, None).await,
        404,
        ErrorCode::NotFound,
        "rs",
    );
    m.stop().await;
}

/// A join body over the limit is refused from its length alone, before a
/// byte of it is read (so it holds none of the server's body budget).
#[tokio::test]
async fn an_oversize_join_is_refused_before_it_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let m = Meta::start(dir.path(), "127.0.0.1:0").await;
    let mut s = tokio::net::TcpStream::connect(m.addr).await.unwrap();
    let head = format!(
        "POST /api/v1/quorums/g/join HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        m.addr,
        kt_metadata::quorum::MAX_JOIN_BODY + 1
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // No body follows: only a refusal from the length answers.
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut answer))
        .await
        .expect("an answer before any body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
    refused(m.info("g").await, 404, ErrorCode::NotFound, "g");
    m.stop().await;
}
