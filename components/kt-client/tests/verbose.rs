//! `kt --verbose` (the binary) prints the operation's trace id, and the
//! calls it makes carry that trace (`traceparent`); without `--verbose` it
//! prints none. The server is a small axum app on `127.0.0.1:0` that notes
//! the header and answers `not_found`.

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

type Seen = Arc<Mutex<Vec<String>>>;

async fn not_found(State(seen): State<Seen>, headers: HeaderMap) -> (StatusCode, String) {
    if let Some(t) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        seen.lock().unwrap().push(t.to_owned());
    }
    let body = kt_types::ErrorBody::new(kt_types::ErrorCode::NotFound, "no such key");
    (StatusCode::NOT_FOUND, serde_json::to_string(&body).unwrap())
}

async fn kt(url: String, verbose: bool) -> Output {
    kt_sync::task::spawn(move || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kt"));
        cmd.args(["--metadata-url", &url, "--token", "t", "rm", "team/k"]);
        if verbose {
            cmd.arg("--verbose");
        }
        cmd.env_remove(kt_types::env::TOKEN_FILE)
            .output()
            .expect("run kt")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbose_prints_the_trace_id_its_calls_carry() {
    let seen = Seen::default();
    let app = Router::new().fallback(not_found).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let out = kt(url.clone(), true).await;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(3), "not found: {stderr}");
    let id = stderr
        .lines()
        .find_map(|l| l.strip_prefix("kt: trace id "))
        .unwrap_or_else(|| panic!("no trace id in {stderr:?}"))
        .to_owned();
    assert_eq!(id.len(), 32, "{id}");
    let carried = seen.lock().unwrap().clone();
    assert!(!carried.is_empty(), "kt called the server");
    for t in &carried {
        let t = kt_api::trace::TraceParent::parse(t).expect("a well-formed traceparent");
        assert_eq!(t.trace_id().to_string(), id);
    }

    // Without --verbose: no trace id, and another trace.
    seen.lock().unwrap().clear();
    let out = kt(url, false).await;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("trace id"), "{stderr}");
    let again = seen.lock().unwrap().clone();
    assert!(!again.is_empty());
    assert!(
        !again[0].contains(&id),
        "each invocation is a trace of its own"
    );
}
