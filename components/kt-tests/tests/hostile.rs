//! Hostile input: each gets a clear 4xx, the server keeps serving, nothing on disk changes.

use std::fs;

use kt_client::Progress;
use kt_tests::{CHUNK, Cluster, TOKEN, listing};
use kt_types::api::{PutOptions, PutPlan};
use kt_types::frame;
use kt_types::{Entry, EntryKind, ErrorBody, ErrorCode, Hash, Key};
use serde_json::json;

struct Probe {
    http: reqwest::Client,
}

impl Probe {
    async fn expect(&self, req: reqwest::RequestBuilder, status: u16, code: ErrorCode) -> String {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{:?}", resp);
        let body: ErrorBody = resp.json().await.expect("a JSON error body");
        assert_eq!(body.error.code, code, "{}", body.error.message);
        assert!(!body.error.message.is_empty());
        body.error.message
    }
}

/// A request declaring a `declared`-byte body of which only `sent` bytes
/// go out, and its answer (status, body). A server that refuses a body
/// while the client still writes it closes a connection with unread bytes,
/// which resets it and can drop the answer before the client reads it (the
/// race an HTTP client sending the whole body loses now and then: it gives
/// up on a failed write without reading): sending no more than the server
/// must read to decide, and reading whatever the writes did, keeps the
/// answer readable.
async fn oversized(
    base: &str,
    request_line: &str,
    headers: &str,
    declared: u64,
    sent: usize,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{request_line} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {TOKEN}\r\n\
         {headers}content-length: {declared}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    // A server that decides from the declared length answers and closes
    // before it reads these: the write may fail, the answer is still there.
    let _ = conn.write_all(&vec![b'x'; sent]).await;
    let mut answer = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let mut buf = [0u8; 8192];
        loop {
            let n = conn.read(&mut buf).await.expect("the answer, not a reset");
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || complete(&answer) {
                break;
            }
        }
    })
    .await
    .expect("an answer within 60 s");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a whole HTTP answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, body.to_owned())
}

/// Whether `answer` holds a whole HTTP/1.1 response with a content-length.
fn complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .is_some_and(|n| body.len() >= n)
}

fn file_entry(path: &str, data: &[u8]) -> Entry {
    Entry {
        path: path.into(),
        kind: EntryKind::File,
        size: data.len() as u64,
        mode: 0o644,
        mtime: 0,
        mtime_nsec: 0,
        hash: Some(Hash(*blake3::hash(data).as_bytes())),
        target: None,
    }
}

/// A put document (header + encoded manifest) with a digest that matches,
/// unless `digest` overrides it.
fn put_doc(key: &str, entries: serde_json::Value, digest: Option<Hash>) -> Vec<u8> {
    let manifest: kt_types::Manifest =
        serde_json::from_value(json!({ "root": "dir", "entries": entries })).unwrap();
    let encoded = kt_types::codec::to_bytes(&manifest);
    let digest = digest.unwrap_or_else(|| kt_sync::digest_of_encoded(&encoded));
    kt_types::codec::document_with(&json!({ "key": key, "digest": digest }), &encoded)
}

fn put_body(key: &str, entries: serde_json::Value) -> Vec<u8> {
    put_doc(key, entries, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_and_change_nothing() {
    let c = Cluster::start_with(|cfg| cfg.max_request_bytes = 1 << 20).await;
    let client = c.client();
    let src = c.dir.path().join("good");
    fs::write(&src, b"good data").unwrap();
    let good = Key::parse("safe/good").unwrap();
    client
        .put(&good, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let disk_before = listing(&c.store_data());

    // No connection reuse: a server may close a connection whose request body it
    // refused to read (oversized bodies), and the next request must not race that.
    let p = Probe {
        http: kt_api::client_builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap(),
    };
    let store = c.store_url();
    let meta = c.metadata_url();
    let auth = |r: reqwest::RequestBuilder| r.bearer_auth(TOKEN);

    // Invalid keys, in paths and in bodies. (URL clients fold `%2E%2E` segments
    // before sending, so `..` is probed in a body below.)
    let m = p
        .expect(
            auth(p.http.get(format!("{meta}/api/v1/keys/a/b%20c"))),
            400,
            ErrorCode::InvalidKey,
        )
        .await;
    assert!(m.contains("b c"), "{m}");
    p.expect(
        auth(p.http.get(format!("{meta}/api/v1/keys/a//b"))),
        400,
        ErrorCode::InvalidKey,
    )
    .await;
    p.expect(
        auth(p.http.get(format!("{store}/api/v1/trees/x/bad*char"))),
        400,
        ErrorCode::InvalidKey,
    )
    .await;
    p.expect(
        auth(p.http.get(format!("{meta}/api/v1/keys?prefix=a//b"))),
        400,
        ErrorCode::InvalidKey,
    )
    .await;
    let long = "k".repeat(1100);
    p.expect(
        auth(p.http.get(format!("{meta}/api/v1/keys/{long}"))),
        400,
        ErrorCode::InvalidKey,
    )
    .await;
    p.expect(
        auth(
            p.http
                .post(format!("{store}/api/v1/puts"))
                .body(put_body("../etc", json!([]))),
        ),
        400,
        ErrorCode::InvalidKey,
    )
    .await;

    // Manifests that escape the tree.
    let e = file_entry("x", b"x");
    for (bad, what) in [
        (
            json!([{ "path": "../x", "kind": "file", "mode": 420, "mtime": 0, "size": 1, "hash": e.hash }]),
            "..",
        ),
        (
            json!([{ "path": "/etc/passwd", "kind": "file", "mode": 420, "mtime": 0, "size": 1, "hash": e.hash }]),
            "absolute",
        ),
        (
            json!([{ "path": "l", "kind": "symlink", "mode": 511, "mtime": 0, "target": "../../etc" }]),
            "outside",
        ),
        (
            json!([{ "path": "l", "kind": "symlink", "mode": 511, "mtime": 0, "target": "/etc" }]),
            "outside",
        ),
        (
            json!([{ "path": "a/b", "kind": "file", "mode": 420, "mtime": 0, "size": 1, "hash": e.hash }]),
            "parent",
        ),
    ] {
        let m = p
            .expect(
                auth(
                    p.http
                        .post(format!("{store}/api/v1/puts"))
                        .body(put_body("safe/evil", bad)),
                ),
                400,
                ErrorCode::InvalidManifest,
            )
            .await;
        assert!(m.contains(what), "{m}");
    }
    // A digest that does not match the manifest.
    let lying = put_doc(
        "safe/evil",
        json!([file_entry("f", b"x")]),
        Some(Hash([7; 32])),
    );
    let m = p
        .expect(
            auth(p.http.post(format!("{store}/api/v1/puts")).body(lying)),
            400,
            ErrorCode::InvalidRequest,
        )
        .await;
    assert!(m.contains("digest"), "{m}");
    // Malformed JSON.
    p.expect(
        auth(
            p.http
                .post(format!("{store}/api/v1/puts"))
                .header("content-type", "application/json")
                .body("{not json"),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    // Oversized request: 2 MiB declared, one byte more than the limit sent
    // (all the server has to read to know; see `oversized`).
    let (status, body) = oversized(
        &store,
        "POST /api/v1/puts",
        "content-type: application/json\r\n",
        2 << 20,
        (1 << 20) + 1,
    )
    .await;
    assert_eq!(status, 413, "{body}");
    let body: ErrorBody = serde_json::from_str(&body).expect("a JSON error body");
    assert_eq!(
        body.error.code,
        ErrorCode::PayloadTooLarge,
        "{}",
        body.error.message
    );

    // A stream with the wrong content, a truncated stream, a stream with unrequested entries.
    let plan_for = |data: &'static [u8]| {
        let http = p.http.clone();
        let store = store.clone();
        async move {
            let body = put_body("safe/evil", json!([file_entry("f", data)]));
            let plan: PutPlan = auth(http.post(format!("{store}/api/v1/puts")).body(body))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            plan.session.unwrap()
        }
    };
    let sid = plan_for(b"expected").await;
    let mut wrong = frame::encode(0, 8).to_vec();
    wrong.extend_from_slice(b"EXPECTED");
    wrong.extend_from_slice(&frame::encode_end());
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/batch"))
                .body(wrong),
        ),
        400,
        ErrorCode::HashMismatch,
    )
    .await;
    // The session is gone with its staging area; committing it is impossible.
    p.expect(
        auth(p.http.post(format!("{store}/api/v1/puts/{sid}/commit"))),
        404,
        ErrorCode::NotFound,
    )
    .await;

    let sid = plan_for(b"expected").await;
    let mut cut = frame::encode(0, 8).to_vec();
    cut.extend_from_slice(b"expe");
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/batch"))
                .body(cut),
        ),
        400,
        ErrorCode::Truncated,
    )
    .await;

    let sid = plan_for(b"expected").await;
    let mut other = frame::encode(7, 1).to_vec();
    other.push(b'x');
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/batch"))
                .body(other),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;

    // Committing before everything arrived is a conflict, and nothing is published.
    let sid = plan_for(b"expected").await;
    p.expect(
        auth(p.http.post(format!("{store}/api/v1/puts/{sid}/commit"))),
        409,
        ErrorCode::Conflict,
    )
    .await;
    assert!(
        auth(p.http.delete(format!("{store}/api/v1/puts/{sid}")))
            .send()
            .await
            .unwrap()
            .status()
            .is_success()
    );

    // Chunks: wrong length, out-of-range chunk, corrupt content.
    let big: &'static [u8] = Box::leak(kt_tests::bytes(9, (2 * CHUNK) as usize).into_boxed_slice());
    let sid = plan_for(big).await;
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/files/0/chunks/0"))
                .body(vec![0u8; 10]),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/files/0/chunks/5"))
                .body(vec![0u8; 10]),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/files/0/chunks/1"))
                .body(Vec::new()),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    let half = CHUNK as usize;
    assert!(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/files/0/chunks/0"))
                .body(big[..half].to_vec())
        )
        .send()
        .await
        .unwrap()
        .status()
        .is_success()
    );
    let mut corrupt = big[half..].to_vec();
    corrupt[3] ^= 1;
    p.expect(
        auth(
            p.http
                .put(format!("{store}/api/v1/puts/{sid}/files/0/chunks/1"))
                .body(corrupt),
        ),
        400,
        ErrorCode::HashMismatch,
    )
    .await;
    // A chunk longer than its place in the file is refused at the first byte
    // too many (chunk 0 of `big` is CHUNK bytes).
    let sid = plan_for(big).await;
    let (status, body) = oversized(
        &store,
        &format!("PUT /api/v1/puts/{sid}/files/0/chunks/0"),
        "",
        CHUNK * 4,
        CHUNK as usize + 1,
    )
    .await;
    assert_eq!(status, 413, "{body}");
    assert!(
        auth(p.http.delete(format!("{store}/api/v1/puts/{sid}")))
            .send()
            .await
            .unwrap()
            .status()
            .is_success()
    );

    // Reads: unknown lease, ranges outside the file.
    p.expect(
        auth(
            p.http
                .get(format!("{store}/api/v1/reads/nope/files/0?offset=0&len=1")),
        ),
        404,
        ErrorCode::NotFound,
    )
    .await;
    let doc = auth(p.http.get(format!("{store}/api/v1/trees/safe/good")))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let read = kt_types::api::ReadManifest::from_document(&doc).unwrap();
    p.expect(
        auth(p.http.get(format!(
            "{store}/api/v1/reads/{}/files/0?offset=5&len=100",
            read.lease
        ))),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    p.expect(
        auth(p.http.get(format!(
            "{store}/api/v1/reads/{}/files/3?offset=0&len=1",
            read.lease
        ))),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;
    auth(
        p.http
            .delete(format!("{store}/api/v1/reads/{}", read.lease)),
    )
    .send()
    .await
    .unwrap();

    // Metadata: a store URL that is not a URL.
    p.expect(
        auth(
            p.http
                .post(format!("{meta}/api/v1/stores"))
                .json(&json!({"url": "file:///etc"})),
        ),
        400,
        ErrorCode::InvalidRequest,
    )
    .await;

    // A delete naming another version than the current one is refused.
    p.expect(
        auth(p.http.delete(format!(
            "{store}/api/v1/trees/safe/good?version=not-current"
        ))),
        409,
        ErrorCode::Conflict,
    )
    .await;

    // Nothing on disk changed, and the server still serves.
    assert_eq!(listing(&c.store_data()), disk_before);
    let out = c.dir.path().join("out");
    client.get(&good, &out, Progress::none()).await.unwrap();
    assert_eq!(fs::read(&out).unwrap(), b"good data");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_needs_the_token() {
    let c = Cluster::start().await;
    let http = kt_api::client();
    for base in [c.metadata_url(), c.store_url()] {
        for path in ["/healthz", "/readyz"] {
            assert!(
                http.get(format!("{base}{path}"))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .is_success()
            );
        }
        for (method, path) in [
            ("GET", "/metrics"),
            ("GET", "/api/v1/keys?prefix="),
            ("GET", "/api/v1/keys/a"),
            ("PUT", "/api/v1/keys/a"),
            ("DELETE", "/api/v1/keys/a"),
            ("POST", "/api/v1/stores"),
            ("GET", "/api/v1/store"),
            ("POST", "/api/v1/puts"),
            ("PUT", "/api/v1/puts/s/batch"),
            ("GET", "/api/v1/trees/a"),
            ("DELETE", "/api/v1/trees/a"),
            ("GET", "/api/v1/reads/l/files/0"),
        ] {
            let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            for token in [None, Some("wrong"), Some("")] {
                let mut req = http.request(m.clone(), format!("{base}{path}"));
                if let Some(t) = token {
                    req = req.bearer_auth(t);
                }
                let resp = req.send().await.unwrap();
                assert_eq!(
                    resp.status().as_u16(),
                    401,
                    "{method} {base}{path} with {token:?}"
                );
                let body: ErrorBody = resp.json().await.unwrap();
                assert_eq!(body.error.code, ErrorCode::Unauthorized);
            }
        }
    }
    // With the token, metrics are served in the Prometheus text format.
    let text = http
        .get(format!("{}/metrics", c.store_url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("kt_bytes_received_total"), "{text}");
    c.stop().await;
}
