//! Filesystem broadcasts end to end: real metadata server and store, real
//! clients with their relays, on 127.0.0.1.

use std::fs;
use std::time::Duration;

use kt_client::Progress;
use kt_client::broadcast::{BroadcastOptions, BroadcastSummary};
use kt_tests::{CHUNK, Cluster, bytes, fingerprint, wait_until, write_files};
use kt_types::api::PutOptions;
use kt_types::broadcast::{GroupInfo, MemberState, parent_rank};
use kt_types::{ErrorCode, Key};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// Puts a tree of small files, a two-chunk file and a 40-chunk file.
async fn put_tree(c: &Cluster, k: &str) -> std::path::PathBuf {
    let src = c.dir.path().join(format!("src-{}", k.replace('/', "-")));
    write_files(
        &src,
        &[("a/one.txt", b"one"), ("b/two.txt", b"two"), ("zero", b"")],
    );
    fs::write(src.join("pair.bin"), bytes(3, (2 * CHUNK) as usize)).unwrap();
    fs::write(src.join("big.bin"), bytes(4, (40 * CHUNK + 7) as usize)).unwrap();
    c.client()
        .put(&key(k), &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    src
}

async fn group_info(c: &Cluster, group: &str) -> Option<GroupInfo> {
    let url = format!("{}/api/v1/broadcasts/{group}", c.metadata_url());
    let resp = kt_api::client()
        .get(&url)
        .bearer_auth(kt_tests::TOKEN)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

fn options(group: &str, fanout: u32) -> BroadcastOptions {
    BroadcastOptions {
        group: Some(group.to_owned()),
        fanout: Some(fanout),
        window: Some(Duration::from_secs(30)),
        delete: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broadcast_tree_delivers_every_copy_ranks_and_parents() {
    let c = Cluster::start().await;
    let src = put_tree(&c, "bc/tree").await;
    let getters = (0..7).map(|i| {
        let (client, dest) = (c.client(), c.dir.path().join(format!("dest-{i}")));
        async move {
            let s = client
                .get_broadcast(
                    &key("bc/tree"),
                    &dest,
                    &options("tree-1", 2),
                    Progress::none(),
                )
                .await
                .expect("broadcast get");
            (dest, s)
        }
    });
    let results: Vec<(std::path::PathBuf, BroadcastSummary)> =
        futures::future::join_all(getters).await;
    let want = fingerprint(&src);
    let mut ranks: Vec<u32> = Vec::new();
    for (dest, s) in &results {
        assert_eq!(
            fingerprint(dest),
            want,
            "copy at {} differs",
            dest.display()
        );
        assert_eq!(s.group, "tree-1");
        assert_eq!(
            s.parents,
            vec![parent_rank(s.rank, 2).unwrap()],
            "rank {} fetched from the wrong parent",
            s.rank
        );
        ranks.push(s.rank);
    }
    ranks.sort();
    assert_eq!(ranks, (1..=7).collect::<Vec<_>>());
    // Ranks 1 to 3 have children: they relayed the whole key to each.
    let size: u64 = want.total_bytes();
    for (_, s) in &results {
        let children = (1..=7u32)
            .filter(|r| parent_rank(*r, 2) == Some(s.rank))
            .count() as u64;
        assert_eq!(s.relayed, children * size, "rank {} relayed", s.rank);
    }
    let info = group_info(&c, "tree-1").await.expect("group info");
    assert_eq!(info.fanout, 2);
    assert_eq!(info.origin, "store");
    assert!(
        info.members.iter().all(|m| m.state == MemberState::Done),
        "{:?}",
        info.members
    );
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_that_fails_is_replaced_and_the_child_completes() {
    let c = Cluster::start().await;
    let src = put_tree(&c, "bc/fail").await;
    // Rank 1 is a member whose relay refuses connections.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let ws = fake_member(&c, "bc/fail", "fail-1", dead_url).await;
    // Rank 2 (fanout 1: its parent is rank 1) fails over to the origin.
    let dest = c.dir.path().join("dest");
    let s = c
        .client()
        .get_broadcast(
            &key("bc/fail"),
            &dest,
            &options("fail-1", 1),
            Progress::none(),
        )
        .await
        .expect("broadcast get");
    assert_eq!(s.rank, 2);
    assert_eq!(s.parents, vec![1, 0]);
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    let info = group_info(&c, "fail-1").await.expect("group info");
    let two = info.members.iter().find(|m| m.rank == 2).unwrap();
    assert_eq!(two.replaced, vec![1]);
    drop(ws);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reusing_a_closed_group_id_is_an_error() {
    let c = Cluster::start().await;
    put_tree(&c, "bc/once").await;
    let once = BroadcastOptions {
        group: Some("once-1".into()),
        fanout: None,
        window: Some(Duration::from_millis(200)),
        delete: false,
    };
    let client = c.client();
    client
        .get_broadcast(
            &key("bc/once"),
            &c.dir.path().join("d1"),
            &once,
            Progress::none(),
        )
        .await
        .expect("first get");
    wait_until("the window to close", Duration::from_secs(10), || async {
        group_info(&c, "once-1").await.is_none_or(|g| !g.open)
    })
    .await;
    let err = client
        .get_broadcast(
            &key("bc/once"),
            &c.dir.path().join("d2"),
            &once,
            Progress::none(),
        )
        .await
        .expect_err("a closed group's id was reused");
    assert_eq!(err.code(), Some(ErrorCode::Conflict), "{err}");
    assert!(err.to_string().contains("once-1"), "{err}");
    // Without a group id, getters never collide.
    let unnamed = BroadcastOptions::default();
    let s = client
        .get_broadcast(
            &key("bc/once"),
            &c.dir.path().join("d3"),
            &unnamed,
            Progress::none(),
        )
        .await
        .expect("unnamed group");
    assert!(s.group.starts_with("auto-"), "{}", s.group);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_keys_and_bad_groups_are_refused() {
    let c = Cluster::start().await;
    let client = c.client();
    let err = client
        .get_broadcast(
            &key("bc/none"),
            &c.dir.path().join("d"),
            &options("none-1", 2),
            Progress::none(),
        )
        .await
        .expect_err("unknown key");
    assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");
    put_tree(&c, "bc/bad").await;
    let err = client
        .get_broadcast(
            &key("bc/bad"),
            &c.dir.path().join("d"),
            &options("no/slashes", 2),
            Progress::none(),
        )
        .await
        .expect_err("bad group id");
    assert_eq!(err.code(), Some(ErrorCode::InvalidRequest), "{err}");
    c.stop().await;
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Joins `group` (fanout 1) as rank 1 over a raw WebSocket, claiming to
/// relay at `relay_url`; dropping the socket leaves the group.
async fn fake_member(c: &Cluster, k: &str, group: &str, relay_url: String) -> Ws {
    use futures::{SinkExt, StreamExt};
    use kt_types::broadcast::{GetterMessage, GroupMessage, JoinRequest};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;

    let ws_url = format!(
        "{}/api/v1/broadcasts/join",
        c.metadata_url().replace("http://", "ws://")
    );
    let mut req = ws_url.into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {}", kt_tests::TOKEN).parse().unwrap(),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let join = GetterMessage::Join(JoinRequest {
        key: key(k),
        group: Some(group.into()),
        fanout: Some(1),
        window_ms: Some(30_000),
        relay_url,
        relay_key: Some("relay-key-of-the-stuck-member".into()),
        getter: None,
        rejoin: None,
    });
    ws.send(Message::text(serde_json::to_string(&join).unwrap()))
        .await
        .unwrap();
    let Some(Ok(Message::Text(t))) = ws.next().await else {
        panic!("no assignment");
    };
    let assigned: GroupMessage = serde_json::from_str(t.as_str()).unwrap();
    assert!(
        matches!(assigned, GroupMessage::Assigned { rank: 1, .. }),
        "{assigned:?}"
    );
    ws
}

/// A rank 1 whose relay accepts connections and never answers; aborting
/// the returned task resets them.
async fn stuck_member(c: &Cluster, k: &str, group: &str) -> (Ws, tokio::task::JoinHandle<()>) {
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_url = format!("http://{}", relay.local_addr().unwrap());
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = relay.accept().await {
            held.push(s);
        }
    });
    (fake_member(c, k, group, relay_url).await, holder)
}

/// A parent that relays the store's answers but fails every range past the
/// first `good` chunks; counts the bytes it passed on.
async fn partial_parent(
    store: String,
    good: u64,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use axum::extract::{Path, Query, State};
    use axum::http::StatusCode;
    use axum::routing::{delete, get, post};
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Clone)]
    struct Proxy {
        store: String,
        good: u64,
        passed: std::sync::Arc<AtomicU64>,
        http: reqwest::Client,
    }
    async fn forward(req: reqwest::RequestBuilder) -> Result<axum::body::Bytes, StatusCode> {
        let resp = req
            .bearer_auth(kt_tests::TOKEN)
            .send()
            .await
            .map_err(|_| StatusCode::BAD_GATEWAY)?;
        if !resp.status().is_success() {
            return Err(StatusCode::BAD_GATEWAY);
        }
        resp.bytes().await.map_err(|_| StatusCode::BAD_GATEWAY)
    }
    let passed = std::sync::Arc::new(AtomicU64::new(0));
    let proxy = Proxy {
        store,
        good,
        passed: passed.clone(),
        http: kt_api::client(),
    };
    let app = axum::Router::new()
        .route(
            "/api/v1/trees/{*key}",
            get(|State(p): State<Proxy>, Path(k): Path<String>| async move {
                forward(p.http.get(format!("{}/api/v1/trees/{k}", p.store))).await
            }),
        )
        .route(
            "/api/v1/reads/{lease}/files/{index}",
            get(
                |State(p): State<Proxy>,
                 Path((lease, index)): Path<(String, u32)>,
                 Query(q): Query<kt_types::api::RangeQuery>| async move {
                    if q.offset / CHUNK >= p.good {
                        return Err(StatusCode::SERVICE_UNAVAILABLE);
                    }
                    let url = format!("{}/api/v1/reads/{lease}/files/{index}", p.store);
                    let req = p
                        .http
                        .get(url)
                        .query(&[("offset", q.offset), ("len", q.len)]);
                    let data = forward(req).await?;
                    p.passed.fetch_add(data.len() as u64, Ordering::SeqCst);
                    Ok(data)
                },
            ),
        )
        .route(
            "/api/v1/reads/{lease}/batch",
            post(|| async { StatusCode::SERVICE_UNAVAILABLE }),
        )
        .route(
            "/api/v1/reads/{lease}",
            delete(
                |State(p): State<Proxy>, Path(lease): Path<String>| async move {
                    let url = format!("{}/api/v1/reads/{lease}", p.store);
                    let _ = p.http.delete(url).bearer_auth(kt_tests::TOKEN).send().await;
                    StatusCode::NO_CONTENT
                },
            ),
        )
        .with_state(proxy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, passed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_parent_leaves_the_child_only_the_missing_chunks_to_fetch() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src-resume");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("big.bin"), bytes(9, (40 * CHUNK) as usize)).unwrap();
    c.client()
        .put(
            &key("bc/resume"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    // Rank 1 serves the first 10 of 40 chunks, then fails every request.
    let (relay_url, passed) = partial_parent(c.store_url(), 10).await;
    let ws = fake_member(&c, "bc/resume", "resume-1", relay_url).await;
    let before = c.store_metrics.bytes_out();
    let dest = c.dir.path().join("dest");
    let mut client_cfg = c.client().config().clone();
    // One chunk at a time: the first 10 surely come from rank 1.
    client_cfg.streams = 1;
    let client = kt_client::Client::new(client_cfg).unwrap();
    let s = client
        .get_broadcast(
            &key("bc/resume"),
            &dest,
            &options("resume-1", 1),
            Progress::none(),
        )
        .await
        .expect("broadcast get");
    assert_eq!(s.parents, vec![1, 0]);
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    let from_parent = passed.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(from_parent, 10 * CHUNK);
    let from_store = c.store_metrics.bytes_out() - before - from_parent;
    assert_eq!(
        from_store,
        30 * CHUNK,
        "the child fetched again chunks it had from its first parent"
    );
    drop(ws);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn getters_rejoin_with_their_rank_after_a_metadata_restart() {
    let mut c = Cluster::start().await;
    let src = put_tree(&c, "bc/restart").await;
    let (ws, holder) = stuck_member(&c, "bc/restart", "restart-1").await;
    // Rank 2 fetches from the stuck rank 1: it waits on it.
    let (client, dest) = (c.client(), c.dir.path().join("dest"));
    let getter = tokio::spawn(async move {
        client
            .get_broadcast(
                &key("bc/restart"),
                &dest,
                &options("restart-1", 1),
                Progress::none(),
            )
            .await
            .map(|s| (dest, s))
    });
    wait_until("rank 2 to join", Duration::from_secs(10), || async {
        group_info(&c, "restart-1")
            .await
            .is_some_and(|g| g.members.iter().any(|m| m.rank == 2))
    })
    .await;
    c.restart_metadata().await;
    drop(ws);
    // The group is back; rank 2 rejoins with its rank (rank 1 does not).
    wait_until("rank 2 to rejoin", Duration::from_secs(20), || async {
        group_info(&c, "restart-1")
            .await
            .is_some_and(|g| g.members.iter().any(|m| m.rank == 2))
    })
    .await;
    // Rank 1's relay goes away: rank 2 moves to the origin and completes.
    holder.abort();
    let (dest, s) = getter.await.unwrap().expect("broadcast get");
    assert_eq!(s.rank, 2);
    assert_eq!(s.parents, vec![1, 0]);
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}
