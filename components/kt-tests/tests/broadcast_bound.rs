//! A pod-bound token in a broadcast group speaks for its own pod only: it
//! joins as its own agent, and the `served_by` it reports (done, or on a
//! rejoin) must be on its pod's IP, since its children are sent there.
//!
//! The metadata server is real (on loopback); the pod's token is vouched
//! for by a fake reviewer, as the Kubernetes one would for a token bound to
//! pod `pod-a` at 127.0.0.1. The getters speak the protocol and move no
//! data: no URL they announce is dialled.

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use kt_service::Token;
use kt_service::auth::{Auth, ReviewFuture, Reviewed, Reviewer, Verdict};
use kt_types::api::{PutOptions, RegisterKey};
use kt_types::auth::{Principal, Role};
use kt_types::broadcast::{GetterMessage, GroupMessage, JoinRequest, MemberState, Rejoin};
use kt_types::{ErrorCode, Key, Locale};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

/// Longest wait for one message or condition.
const WAIT: Duration = Duration::from_secs(10);
const KEY: &str = "bc/bound";
const ADMIN: &str = "admin-token";
const POD_A: &str = "pod-a-token";
/// Pod a's IP, and another one.
const OWN_IP: &str = "127.0.0.1";
const OTHER_IP: &str = "127.0.0.2";

/// Vouches for the admin and for pod a's token (bound to [`OWN_IP`]).
#[derive(Debug)]
struct Pods;

impl Reviewer for Pods {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
        let verdict = match token {
            ADMIN => Verdict::Known(Principal::admin()),
            POD_A => Verdict::Known(Principal {
                role: Role::Pod,
                name: Some("pod-a".into()),
                services: None,
                reads: None,
                ip: Some(OWN_IP.parse().unwrap()),
                scope: None,
            }),
            _ => Verdict::Refused("unknown token".into()),
        };
        Box::pin(async move {
            Ok(Reviewed {
                verdict,
                ttl: Duration::from_secs(60),
            })
        })
    }
}

struct Meta {
    addr: std::net::SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Meta {
    async fn start(dir: &std::path::Path) -> Meta {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(ADMIN).unwrap());
        cfg.server.auth = Some(Auth::none().with_reviewer(Arc::new(Pods)));
        cfg.sweep_interval = Duration::from_millis(20);
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move { kt_metadata::run(listener, cfg, s).await.unwrap() });
        Meta { addr, stop, task }
    }

    /// What a producer's agent sends for `kt put --locale local`.
    async fn register(&self) {
        let reg = RegisterKey {
            locale: Locale::Local,
            source: "http://producer-0.invalid:8083".into(),
            holder: Some("producer-0".into()),
            version: "v1".into(),
            is_dir: true,
            size: 3,
            files: 1,
            tensors: None,
            digest: Some(kt_types::Hash([9; 32])),
            options: PutOptions::default(),
            only_if: None,
        };
        let resp = kt_api::client()
            .put(format!("http://{}/api/v1/keys/{KEY}", self.addr))
            .bearer_auth(ADMIN)
            .json(&reg)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.status());
    }

    /// The state of member `rank` of `group`, as the server tells it.
    async fn state(&self, group: &str, rank: u32) -> Option<MemberState> {
        let info: kt_types::broadcast::GroupInfo = kt_api::client()
            .get(format!("http://{}/api/v1/broadcasts/{group}", self.addr))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        info.members
            .iter()
            .find(|m| m.rank == rank)
            .map(|m| m.state)
    }

    /// Waits until member `rank` of `group` is in `state`.
    async fn wait_state(&self, group: &str, rank: u32, state: MemberState) {
        let waited = tokio::time::timeout(WAIT, async {
            while self.state(group, rank).await != Some(state) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        waited
            .await
            .unwrap_or_else(|_| panic!("rank {rank} of {group} never {state:?}"));
    }

    /// A connection of pod a, its join sent.
    async fn join(&self, req: &JoinRequest) -> Getter {
        let mut ws = format!("ws://{}/api/v1/broadcasts/join", self.addr)
            .into_client_request()
            .unwrap();
        ws.headers_mut()
            .insert("authorization", format!("Bearer {POD_A}").parse().unwrap());
        let (ws, _) = tokio_tungstenite::connect_async(ws).await.unwrap();
        let mut g = Getter { ws };
        g.send(&GetterMessage::Join(req.clone())).await;
        g
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("the metadata server stops")
            .unwrap();
    }
}

struct Getter {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Getter {
    async fn send(&mut self, msg: &GetterMessage) {
        let text = serde_json::to_string(msg).unwrap();
        self.ws.send(Message::Text(text.into())).await.unwrap();
    }

    /// The next message (`None` once the server closed).
    async fn recv(&mut self) -> Option<GroupMessage> {
        loop {
            let frame = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("a message from the metadata server in time");
            match frame {
                Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(&text).unwrap()),
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
                Some(Ok(other)) => panic!("unexpected frame {other:?}"),
            }
        }
    }

    /// The assignment: group, rank and secret.
    async fn assigned(&mut self) -> (String, u32, Option<String>) {
        match self.recv().await {
            Some(GroupMessage::Assigned {
                group,
                rank,
                secret,
                ..
            }) => (group, rank, secret),
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    /// The next message is a 403, naming `what`; then the server closes.
    async fn forbidden(&mut self, what: &str) {
        match self.recv().await {
            Some(GroupMessage::Error { code, message }) => {
                assert_eq!(code, ErrorCode::Forbidden, "{message}");
                assert!(message.contains(what), "{message}");
                assert_eq!(self.recv().await, None, "closed after the error");
            }
            other => panic!("expected a 403 naming {what}, got {other:?}"),
        }
    }
}

fn url(ip: &str, port: u16) -> String {
    format!("http://{ip}:{port}")
}

fn join_req(group: &str, getter: &str) -> JoinRequest {
    JoinRequest {
        key: Key::parse(KEY).unwrap(),
        group: Some(group.into()),
        fanout: Some(1),
        window_ms: None,
        relay_url: url(OWN_IP, 8085),
        relay_key: Some("relay-key-of-pod-a".into()),
        getter: Some(getter.into()),
        rejoin: None,
    }
}

#[tokio::test]
async fn a_pod_token_speaks_for_its_own_pod_only() {
    let dir = tempfile::tempdir().unwrap();
    let meta = Meta::start(dir.path()).await;
    meta.register().await;

    // Another agent's name: refused, no member made.
    let mut g = meta.join(&join_req("run-1", "pod-b")).await;
    g.forbidden("its own agent only").await;
    // A relay on another IP: refused.
    let mut other = join_req("run-1", "pod-a");
    other.relay_url = url(OTHER_IP, 8085);
    let mut g = meta.join(&other).await;
    g.forbidden("relay_url").await;

    // As itself: rank 1. Done with its agent on another IP: refused, and
    // the member is not done (its children would be sent there).
    let mut g1 = meta.join(&join_req("run-1", "pod-a")).await;
    let (group, rank, secret) = g1.assigned().await;
    assert_eq!((group.as_str(), rank), ("run-1", 1));
    g1.send(&GetterMessage::Done {
        served_by: Some(url(OTHER_IP, 8083)),
    })
    .await;
    g1.forbidden("served_by").await;
    meta.wait_state("run-1", 1, MemberState::Gone).await;

    // A rejoin claiming an agent on another IP: refused too.
    let mut rejoin = join_req("run-1", "pod-a");
    rejoin.rejoin = Some(Rejoin {
        group: "run-1".into(),
        rank: 1,
        version: "v1".into(),
        parent: 0,
        done: true,
        served_by: Some(url(OTHER_IP, 8083)),
        secret: secret.clone(),
    });
    let mut g = meta.join(&rejoin).await;
    g.forbidden("served_by").await;

    // On its own IP: accepted. Its child (fanout 1: rank 2 under rank 1)
    // is sent to that agent once rank 1 leaves.
    let mut g2 = meta.join(&join_req("run-1", "pod-a")).await;
    let (_, rank2, _) = g2.assigned().await;
    assert_eq!(rank2, 2);
    let mut g3 = meta.join(&join_req("run-1", "pod-a")).await;
    let (_, rank3, _) = g3.assigned().await;
    assert_eq!(rank3, 3);
    let served_by = url(OWN_IP, 8083);
    g2.send(&GetterMessage::Done {
        served_by: Some(served_by.clone()),
    })
    .await;
    meta.wait_state("run-1", 2, MemberState::Done).await;
    g2.ws.close(None).await.unwrap();
    match g3.recv().await {
        Some(GroupMessage::Parent { parent }) => {
            assert_eq!((parent.rank, parent.url.as_str()), (2, served_by.as_str()));
        }
        other => panic!("expected rank 3's new parent, got {other:?}"),
    }
    drop(g3);
    meta.stop().await;
}
