use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::StatusCode;
use axum::routing::get;

use super::*;

#[test]
fn backoff_doubles_up_to_its_ceiling_and_jitters_within_it() {
    let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    let mut ceilings = Vec::new();
    for _ in 0..6 {
        let c = b.ceiling();
        let d = b.next_delay();
        assert!(d >= c / 2 && d <= c, "{d:?} outside [{:?}, {c:?}]", c / 2);
        ceilings.push(c.as_millis());
    }
    assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
    b.reset();
    assert_eq!(b.ceiling(), Duration::from_millis(100));
    // Clients that failed together do not come back together.
    let delays: std::collections::HashSet<Duration> = (0..50)
        .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).next_delay())
        .collect();
    assert!(delays.len() > 40, "{} distinct delays of 50", delays.len());
    // Huge attempt counts neither overflow nor pass the maximum.
    let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    for _ in 0..100 {
        assert!(b.next_delay() <= Duration::from_secs(30));
    }
}

/// A server on 127.0.0.1:0 whose `/api/v1/x` answers what `answer` says
/// for the n-th request (counted from 0).
async fn server(
    answer: impl Fn(usize) -> (StatusCode, String) + Clone + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let handler = move || {
        let (answer, seen) = (answer.clone(), seen.clone());
        async move { answer(seen.fetch_add(1, Ordering::SeqCst)) }
    };
    let app = axum::Router::new().route("/api/v1/x", get(handler.clone()).post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, calls)
}

fn body(code: &str, msg: &str) -> String {
    format!(r#"{{"error":{{"code":"{code}","message":"{msg}"}}}}"#)
}

fn api(url: &str) -> Api {
    Api::new(reqwest::Client::new(), url, "t")
}

#[tokio::test]
async fn answers_decode_to_the_servers_code_or_one_from_the_status() {
    let (url, _) = server(|n| match n {
        0 => (StatusCode::NOT_FOUND, body("not_found", "no key a/b")),
        1 => (StatusCode::BAD_GATEWAY, "upstream gone".into()),
        _ => (StatusCode::OK, r#"{"a":1}"#.into()),
    })
    .await;
    let a = api(&url);
    let e = a.get("/api/v1/x").ok().await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert_eq!(e.to_string(), "no key a/b (not_found, HTTP 404)");
    let e = a.get("/api/v1/x").ok().await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unavailable);
    assert!(e.to_string().contains("upstream gone"), "{e}");
    assert!(e.to_string().contains(&url), "names the URL: {e}");
    let v: serde_json::Value = a.get("/api/v1/x").fetch().await.unwrap();
    assert_eq!(v["a"], 1);
}

#[tokio::test]
async fn an_idempotent_call_waits_out_a_server_that_is_away() {
    let (url, calls) = server(|n| {
        if n < 2 {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                body("unavailable", "restarting"),
            )
        } else {
            (StatusCode::OK, "{}".into())
        }
    })
    .await;
    let quick = || Backoff::new(Duration::from_millis(1), Duration::from_millis(5));
    let a = api(&url);
    a.get("/api/v1/x")
        .retry_with(3, quick())
        .ok()
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // Not asked to retry: the first answer stands.
    calls.store(0, Ordering::SeqCst);
    let e = a.get("/api/v1/x").ok().await.unwrap_err();
    assert_eq!(
        (e.code(), calls.load(Ordering::SeqCst)),
        (ErrorCode::Unavailable, 1)
    );
    // A POST that reached the server is not sent again.
    calls.store(0, Ordering::SeqCst);
    let e = a
        .post("/api/v1/x")
        .retry_with(3, quick())
        .ok()
        .await
        .unwrap_err();
    assert!(e.server_away());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn answers_about_the_data_are_never_retried() {
    let (url, calls) = server(|_| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            body("no_source", "no live source of a/b"),
        )
    })
    .await;
    let e = api(&url)
        .get("/api/v1/x")
        .retry_with(
            3,
            Backoff::new(Duration::from_millis(1), Duration::from_millis(1)),
        )
        .ok()
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoSource);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_refused_connection_is_retried_then_reported_with_its_url() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let e = api(&url)
        .post("/api/v1/x")
        .retry_with(
            2,
            Backoff::new(Duration::from_millis(1), Duration::from_millis(2)),
        )
        .ok()
        .await
        .unwrap_err();
    assert!(e.not_sent(), "{e:?}");
    assert_eq!(e.code(), ErrorCode::Unavailable);
    assert!(
        e.to_string().starts_with(&format!("{url}/api/v1/x: ")),
        "{e}"
    );
}

#[test]
fn apis_share_their_client_and_token_across_servers() {
    let a = Api::new(reqwest::Client::new(), "http://meta:8081/", "tok");
    assert_eq!(
        a.url(&kt_types::paths::store()),
        "http://meta:8081/api/v1/store"
    );
    let b = a.at("http://10.0.0.7:8090");
    assert_eq!(b.base(), "http://10.0.0.7:8090");
    assert_eq!(
        format!("{b:?}"),
        r#"Api { base: "http://10.0.0.7:8090", .. }"#
    );
}
