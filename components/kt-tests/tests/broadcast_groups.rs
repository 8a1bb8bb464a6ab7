//! Broadcast groups of the metadata server over its WebSocket: ranks,
//! parents, replacements, releases, refusals and restarts.
//!
//! The getters are fake: they speak the group protocol and move no data, so
//! every URL they announce is never dialled.

use std::path::Path;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use kt_service::Token;
use kt_tests::TOKEN;
use kt_types::api::{PutOptions, RegisterKey};
use kt_types::broadcast::{
    GetterMessage, GroupInfo, GroupMessage, JoinRequest, MemberState, Parent, Rejoin,
};
use kt_types::{ErrorBody, ErrorCode, Key, Locale};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

/// Longest wait for one message.
const WAIT: Duration = Duration::from_secs(10);
const KEY: &str = "bc/weights";
const HOLDER: &str = "producer-0";

fn holder_url() -> String {
    format!("http://{HOLDER}.invalid:8083")
}

fn relay_url(i: u32) -> String {
    format!("http://getter-{i}.invalid:8085")
}

/// A metadata server alone, restartable on the same address and directory.
#[derive(Debug)]
struct Meta {
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Meta {
    async fn start(dir: &Path, addr: &str) -> Meta {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(TOKEN).unwrap());
        cfg.sweep_interval = Duration::from_millis(20);
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

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }

    /// What the producer's agent sends for `kt put --locale local`.
    async fn register(&self, version: &str) {
        let reg = RegisterKey {
            locale: Locale::Local,
            source: holder_url(),
            holder: Some(HOLDER.into()),
            version: version.into(),
            is_dir: true,
            size: 3,
            files: 1,
            tensors: None,
            digest: Some(kt_types::Hash([9; 32])),
            options: PutOptions::default(),
            only_if: None,
        };
        let resp = kt_api::client()
            .put(format!("{}/api/v1/keys/{KEY}", self.url()))
            .bearer_auth(TOKEN)
            .json(&reg)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.status());
    }

    /// `GET /api/v1/broadcasts/{group}`: the tree, or the error's code.
    async fn info(&self, group: &str) -> Result<GroupInfo, ErrorCode> {
        let resp = kt_api::client()
            .get(format!("{}/api/v1/broadcasts/{group}", self.url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        let ok = resp.status().is_success();
        let bytes = resp.bytes().await.unwrap();
        if ok {
            Ok(serde_json::from_slice(&bytes).unwrap())
        } else {
            let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
            Err(body.error.code)
        }
    }

    async fn connect(&self) -> Getter {
        let mut req = format!("ws://{}/api/v1/broadcasts/join", self.addr)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        let (ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
        Getter { ws }
    }

    /// Joins as getter `i`: the connection and its assignment.
    async fn join(&self, req: JoinRequest) -> (Getter, Assigned) {
        let mut g = self.connect().await;
        g.send(&GetterMessage::Join(req)).await;
        let assigned = g.assigned().await;
        (g, assigned)
    }
}

/// The fields of a [`GroupMessage::Assigned`].
#[derive(Debug, Clone, PartialEq)]
struct Assigned {
    group: String,
    rank: u32,
    version: String,
    fanout: u32,
    parent: Parent,
    secret: Option<String>,
}

/// A fake getter's connection.
#[derive(Debug)]
struct Getter {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Getter {
    async fn send(&mut self, msg: &GetterMessage) {
        let text = serde_json::to_string(msg).unwrap();
        self.ws.send(Message::Text(text.into())).await.unwrap();
    }

    /// The next message from the server (`None` once it closed).
    async fn recv(&mut self) -> Option<GroupMessage> {
        loop {
            let frame = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("a message from the metadata server in time");
            match frame {
                Some(Ok(Message::Text(text))) => {
                    return Some(unsealed(serde_json::from_str(&text).unwrap()));
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
                Some(Ok(other)) => panic!("unexpected frame {other:?}"),
            }
        }
    }

    async fn assigned(&mut self) -> Assigned {
        match self.recv().await {
            Some(GroupMessage::Assigned {
                group,
                rank,
                version,
                fanout,
                parent,
                secret,
                ..
            }) => Assigned {
                group,
                rank,
                version,
                fanout,
                parent,
                secret,
            },
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    /// The next message must be an error with `code`; the connection then closes.
    async fn refused(&mut self, code: ErrorCode) -> String {
        match self.recv().await {
            Some(GroupMessage::Error { code: c, message }) => {
                assert_eq!(c, code, "{message}");
                assert_eq!(self.recv().await, None, "closed after the error");
                message
            }
            other => panic!("expected a {code} error, got {other:?}"),
        }
    }

    async fn close(mut self) {
        self.ws.close(None).await.unwrap();
    }
}

fn join_req(group: Option<&str>, fanout: Option<u32>, i: u32) -> JoinRequest {
    JoinRequest {
        key: Key::parse(KEY).unwrap(),
        group: group.map(Into::into),
        fanout,
        window_ms: None,
        relay_url: relay_url(i),
        relay_key: Some(relay_key(i)),
        getter: Some(format!("getter-{i}")),
        rejoin: None,
    }
}

/// What getter `i`'s relay accepts besides its own token.
fn relay_key(i: u32) -> String {
    format!("relay-key-of-getter-{i:04}")
}

/// `msg` with its parent's key checked and taken off (the comparisons
/// below are of the tree): the origin (an agent) comes with a capability,
/// a relay with the relay's key; no parent comes without one.
fn unsealed(mut msg: GroupMessage) -> GroupMessage {
    let strip = |p: &mut Parent| {
        if p.url.is_empty() {
            return; // a parent that has not rejoined yet: nothing to show it
        }
        let key = p
            .key
            .take()
            .expect("every parent comes with what to show it");
        if p.rank == 0 {
            assert!(key.starts_with("kt-cap."), "{key}");
        } else {
            assert_eq!(key, relay_key(p.rank), "the relay's own key");
        }
    };
    match &mut msg {
        GroupMessage::Parent { parent } => strip(parent),
        GroupMessage::Assigned { parent, digest, .. } => {
            assert_eq!(
                *digest,
                Some(kt_types::Hash([9; 32])),
                "the registered digest"
            );
            strip(parent);
        }
        GroupMessage::Release | GroupMessage::Error { .. } => {}
    }
    msg
}

fn origin() -> Parent {
    Parent {
        rank: 0,
        url: holder_url(),
        id: HOLDER.into(),
        key: None,
    }
}

fn relay_parent(rank: u32) -> Parent {
    Parent {
        rank,
        url: relay_url(rank),
        id: format!("rank-{rank}"),
        key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_get_ranks_parents_replacements_and_releases() {
    let dir = tempfile::tempdir().unwrap();
    let meta = Meta::start(dir.path(), "127.0.0.1:0").await;
    meta.register("v1").await;

    let mut getters = Vec::new();
    for i in 1..=5 {
        let (g, a) = meta.join(join_req(Some("run-1"), Some(2), i)).await;
        assert_eq!(
            (a.group.as_str(), a.rank, a.version.as_str(), a.fanout),
            ("run-1", i, "v1", 2)
        );
        getters.push((g, a));
    }
    let parents: Vec<Parent> = getters.iter().map(|(_, a)| a.parent.clone()).collect();
    assert_eq!(
        parents,
        [
            origin(),
            origin(),
            relay_parent(1),
            relay_parent(1),
            relay_parent(2)
        ]
    );
    let info = meta.info("run-1").await.unwrap();
    assert_eq!(info.origin, HOLDER);
    assert!(info.open);
    let tree: Vec<(u32, u32)> = info.members.iter().map(|m| (m.rank, m.parent)).collect();
    assert_eq!(tree, [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]);

    // Rank 1 leaves without finishing: its children move to the origin.
    let mut getters = getters.into_iter().map(|(g, _)| g);
    let (g1, mut g2, mut g3, mut g4, mut g5) = (
        getters.next().unwrap(),
        getters.next().unwrap(),
        getters.next().unwrap(),
        getters.next().unwrap(),
        getters.next().unwrap(),
    );
    g1.close().await;
    for g in [&mut g3, &mut g4] {
        assert_eq!(
            g.recv().await,
            Some(GroupMessage::Parent { parent: origin() })
        );
    }
    let info = meta.info("run-1").await.unwrap();
    assert_eq!(info.members[0].state, MemberState::Gone);
    assert_eq!(
        (info.members[2].parent, info.members[2].replaced.clone()),
        (0, vec![1])
    );

    // A parent failure report moves the reporter up the tree.
    g5.send(&GetterMessage::ParentFailed {
        parent: 2,
        reason: "hash mismatch".into(),
        transient: false,
    })
    .await;
    assert_eq!(
        g5.recv().await,
        Some(GroupMessage::Parent { parent: origin() })
    );

    // 2 finishes: it has no downloading child left, so it is released.
    g2.send(&GetterMessage::Done { served_by: None }).await;
    assert_eq!(g2.recv().await, Some(GroupMessage::Release));

    // Joins that cannot be taken are refused with the reason.
    let mut other = meta.connect().await;
    other
        .send(&GetterMessage::Join(join_req(Some("run-1"), Some(3), 9)))
        .await;
    let msg = other.refused(ErrorCode::Conflict).await;
    assert!(msg.contains("fanout 2, not 3"), "{msg}");
    // A member without a relay key would have its children's tokens sent
    // to its relay: refused.
    let mut keyless = meta.connect().await;
    let mut req = join_req(Some("run-1"), Some(2), 8);
    req.relay_key = None;
    keyless.send(&GetterMessage::Join(req)).await;
    let msg = keyless.refused(ErrorCode::InvalidRequest).await;
    assert!(msg.contains("relay_key"), "{msg}");
    let mut bad = meta.connect().await;
    bad.ws
        .send(Message::Text("{not json".into()))
        .await
        .unwrap();
    bad.refused(ErrorCode::InvalidRequest).await;
    let mut unknown = meta.connect().await;
    let mut req = join_req(None, None, 9);
    req.key = Key::parse("bc/nothing").unwrap();
    unknown.send(&GetterMessage::Join(req)).await;
    unknown.refused(ErrorCode::NotFound).await;
    assert_eq!(meta.info("nope").await.unwrap_err(), ErrorCode::NotFound);
    // Without the token, no upgrade.
    let req = format!("ws://{}/api/v1/broadcasts/join", meta.addr)
        .into_client_request()
        .unwrap();
    assert!(tokio_tungstenite::connect_async(req).await.is_err());

    // Getters that name no group share the key's open unnamed group.
    let (_u1, a) = meta.join(join_req(None, None, 11)).await;
    let (_u2, b) = meta.join(join_req(None, None, 12)).await;
    assert!(a.group.starts_with("auto-"), "{}", a.group);
    assert_eq!((b.group, b.rank, b.fanout), (a.group, 2, 50));

    meta.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_rejoin_after_a_restart_and_keep_their_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let meta = Meta::start(dir.path(), "127.0.0.1:0").await;
    meta.register("v1").await;
    let mut assigned = Vec::new();
    let mut getters = Vec::new();
    for i in 1..=3 {
        let (g, a) = meta.join(join_req(Some("run-2"), Some(2), i)).await;
        assigned.push(a);
        getters.push(g);
    }
    let addr = meta.addr.to_string();
    meta.stop().await;
    // The server going away closes every member's connection.
    for g in &mut getters {
        assert_eq!(g.recv().await, None);
    }

    let meta = Meta::start(dir.path(), &addr).await;
    // Nobody has rejoined yet: the group is known, empty.
    let info = meta.info("run-2").await.unwrap();
    assert!(info.members.is_empty());
    // A new getter never takes a rank a member may still hold.
    let (_new, a) = meta.join(join_req(Some("run-2"), None, 99)).await;
    assert!(a.rank >= 257, "rank {}", a.rank);
    assert_eq!(a.parent, origin(), "its ancestors have not rejoined");
    // Nobody takes another getter's rank: a rejoin without the rank's
    // secret, or with another rank's, is refused (the key that checks
    // secrets survived the restart with the group's record).
    let rejoin_of = |a: &Assigned, secret: Option<String>| Rejoin {
        group: "run-2".into(),
        rank: a.rank,
        version: a.version.clone(),
        parent: a.parent.rank,
        done: false,
        served_by: None,
        secret,
    };
    for secret in [None, assigned[1].secret.clone(), Some("00".repeat(32))] {
        let mut req = join_req(None, None, 42);
        req.rejoin = Some(rejoin_of(&assigned[0], secret));
        let mut g = meta.connect().await;
        g.send(&GetterMessage::Join(req)).await;
        let why = g.refused(ErrorCode::Conflict).await;
        assert!(why.contains("another getter's"), "{why}");
    }
    // Rejoins keep rank and parent.
    let mut rejoined = Vec::new();
    for (i, a) in assigned.iter().enumerate() {
        let mut req = join_req(None, None, i as u32 + 1);
        assert!(a.secret.as_ref().is_some_and(|s| s.len() == 64), "{a:?}");
        req.rejoin = Some(rejoin_of(a, a.secret.clone()));
        let (g, again) = meta.join(req).await;
        assert_eq!(
            (again.rank, again.parent.clone()),
            (a.rank, a.parent.clone())
        );
        rejoined.push(g);
    }
    let info = meta.info("run-2").await.unwrap();
    let ranks: Vec<u32> = info.members.iter().map(|m| m.rank).collect();
    assert_eq!(ranks, [1, 2, 3, a.rank]);
    meta.stop().await;
}
