//! Every server's `/metrics` as Prometheus reads it: after a put, a
//! zero-copy put and gets from the store and from an agent, each of the
//! metadata server, the store, an agent and a broadcast relay passes
//! `promtool check metrics` (Debian's `prometheus` package) with nothing
//! to say; the registry, store and agent gauges show what was done; and
//! every `kt_` series the alerts and the dashboard name is exported.
//!
//! Without promtool the test says so loudly and passes, unless `CI` is set
//! (then promtool is required: .ci/run installs it).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use kt_client::Progress;
use kt_tests::{Cluster, TOKEN, write_files};
use kt_types::Key;
use kt_types::api::PutOptions;
use kt_types::status::{ClusterStatus, Samples};
use tokio::io::AsyncWriteExt;

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn promtool() -> Option<&'static str> {
    let found = std::process::Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return Some("promtool");
    }
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(
        !ci,
        "promtool is missing and CI is set: apt-get install prometheus"
    );
    eprintln!(
        "\n\n!!!!!!!! SKIPPED: promtool is not installed (apt-get install prometheus); \
         the servers' /metrics were NOT checked as Prometheus reads them !!!!!!!!\n\n"
    );
    None
}

/// `promtool check metrics` on `text`: its complaints (empty when clean).
async fn check_metrics(promtool: &str, text: &str) -> String {
    let mut child = tokio::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(text.as_bytes()).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        said
    } else {
        format!("(exit {}) {said}", out.status)
    }
}

async fn scrape(http: &reqwest::Client, url: &str, accept: Option<&str>) -> String {
    let mut req = http.get(format!("{url}/metrics")).bearer_auth(TOKEN);
    if let Some(a) = accept {
        req = req.header(reqwest::header::ACCEPT, a);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200, "{url}/metrics");
    resp.text().await.unwrap()
}

/// The `kt_` names a rule or dashboard file queries, as sample names.
fn queried_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kt_") {
        let before = rest[..at].chars().last();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // `kt_store_*` in prose names a family of series, not one.
        let prose = tail[end..].starts_with('*') || tail[..end].ends_with('_');
        if !prose && !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

fn repo_file(rel: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_server_passes_promtool_and_exports_what_alerts_query() {
    let c = Cluster::start().await;
    let pod = c.start_agent("pod-a").await;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    write_files(&src, &[("a.bin", &[7u8; 3000]), ("b/c.txt", b"hello")]);
    let admin = c.client();
    admin
        .put(
            &key("team/data"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    let in_pod = c.client_with(|cfg| cfg.agent_socket = pod.socket().to_owned());
    in_pod
        .put_local(&key("svc/local"), &src, PutOptions::default())
        .await
        .unwrap();
    let reader = c.client_with(|cfg| cfg.serve_copies = false);
    reader
        .get(&key("team/data"), &dir.path().join("got"), Progress::none())
        .await
        .unwrap();
    reader
        .get(
            &key("svc/local"),
            &dir.path().join("got-local"),
            Progress::none(),
        )
        .await
        .unwrap();
    let relay = kt_client::relay::Relay::start("127.0.0.1", TOKEN, "relay-key")
        .await
        .unwrap();

    let http = kt_api::client();
    let servers = [
        ("metadata", c.metadata_url()),
        ("store", c.store_url()),
        ("agent", pod.url.clone()),
        ("relay", relay.url.clone()),
    ];
    let mut texts = Vec::new();
    for (name, url) in &servers {
        texts.push((*name, scrape(&http, url, None).await));
    }

    // What was done shows: the store received and sent the put's bytes for
    // its service, the agent served its origin copy, the registry holds
    // both keys by service and locale, and the gets were timed per route.
    let samples = |name: &str| Samples::parse(&texts.iter().find(|(n, _)| *n == name).unwrap().1);
    let store = samples("store");
    assert_eq!(store.sum("kt_bytes_received_total"), 3005.0);
    assert!(store.sum("kt_bytes_sent_total") >= 3005.0);
    assert!(store.has("kt_store_disk_free_bytes"));
    assert!(store.has("kt_build_info"));
    assert_eq!(
        store.get(
            "kt_service_bytes_total",
            &[("direction", "received"), ("service", "team")]
        ),
        Some(3005.0)
    );
    let agent = samples("agent");
    assert!(agent.sum("kt_bytes_sent_total") >= 3005.0);
    assert_eq!(
        agent.get("kt_agent_exports", &[("kind", "origin")]),
        Some(1.0)
    );
    let meta = samples("metadata");
    let held = |service: &str, locale: &str| {
        let labels = [("service", service), ("locale", locale)];
        (
            meta.get("kt_registry_keys", &labels),
            meta.get("kt_registry_bytes", &labels),
        )
    };
    assert_eq!(held("team", "store"), (Some(1.0), Some(3005.0)));
    assert_eq!(held("svc", "local"), (Some(1.0), Some(3005.0)));
    assert_eq!(
        meta.get("kt_registry_agents", &[("state", "live")]),
        Some(1.0)
    );
    assert!(
        store.sum("kt_http_request_duration_seconds_count") >= 1.0,
        "latency per route on the store"
    );
    assert!(
        texts.iter().all(|(_, t)| !t.contains("team/data")),
        "no key is a label"
    );

    // Every kt_ series the alerts and the dashboard query is exported by
    // some server.
    let mut exported = BTreeSet::new();
    for (_, t) in &texts {
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap_or_default();
            exported.insert(name.to_owned());
        }
    }
    for file in [
        "testbed/prometheus/rules.yaml",
        "kustomize/components/monitoring/dashboards/kt.json",
    ] {
        for name in queried_names(&repo_file(file)) {
            assert!(
                exported.contains(&name),
                "{file} queries {name}, which no server exports"
            );
        }
    }

    // A scraper that asks for OpenMetrics gets it.
    let om = scrape(
        &http,
        &c.store_url(),
        Some("application/openmetrics-text; version=1.0.0"),
    )
    .await;
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("# TYPE kt_bytes_sent counter"), "{om}");

    // `kt status`'s summary agrees.
    let status: ClusterStatus = http
        .get(format!("{}/api/v1/status", c.metadata_url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let team = status.usage.iter().find(|u| u.service == "team").unwrap();
    assert_eq!(
        (team.keys, team.bytes, team.locale.as_str()),
        (1, 3005, "store")
    );
    assert!(status.store_url.is_some());
    let report = admin.status(Duration::from_millis(50)).await.unwrap();
    assert_eq!(report.metadata.usage, status.usage);
    let store_seen = report.store.expect("the store's metrics were read");
    assert!(store_seen.disk_size_bytes.unwrap_or(0) > 0);
    assert_eq!(
        store_seen.version.as_deref(),
        Some(env!("CARGO_PKG_VERSION"))
    );
    let local = status.usage.iter().find(|u| u.locale == "local");
    assert_eq!(local.map(|u| u.keys), Some(1));

    if let Some(promtool) = promtool() {
        for (name, text) in &texts {
            let said = check_metrics(promtool, text).await;
            assert!(
                said.trim().is_empty(),
                "promtool check metrics on the {name}'s /metrics:\n{said}\n---\n{text}"
            );
        }
    }

    relay.stop().await;
    pod.stop().await;
    c.stop().await;
}

/// The store counts a put's bytes, and the reads of it, under the service
/// that owns the key (here the putter's own), not under the key's first
/// segment, which any writer picks (review finding 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_bytes_are_counted_under_the_owning_service() {
    use kt_types::auth::{AuthFile, Grant, Role};
    const WORKLOAD_A: &str = "workload-a-0123456789abc";
    let files = tempfile::tempdir().unwrap();
    let path = files.path().join("auth.json");
    let file = AuthFile {
        tokens: vec![Grant {
            token: WORKLOAD_A.into(),
            role: Role::Workload,
            name: None,
            services: Some(vec!["a".into()]),
            reads: None,
        }],
    };
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    let auth = kt_service::Auth::from_file(&path).unwrap();
    let c = Cluster::start_authed(Some(auth), |_| {}).await;
    let mut cfg = kt_client::ClientConfig::new(c.metadata_url(), WORKLOAD_A);
    cfg.cache_dir = Some(files.path().join("cache-a"));
    cfg.agent_socket = files.path().join("no-agent.sock");
    let workload = kt_client::Client::new(cfg).unwrap();
    let src = files.path().join("src");
    write_files(&src, &[("w", b"weights")]);
    workload
        .put(&key("zzz/x"), &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let reader = c.client_with(|cfg| cfg.serve_copies = false);
    reader
        .get(&key("zzz/x"), &files.path().join("got"), Progress::none())
        .await
        .unwrap();

    let text = scrape(&kt_api::client(), &c.store_url(), None).await;
    let store = Samples::parse(&text);
    let bytes = |direction: &str| {
        store.get(
            "kt_service_bytes_total",
            &[("direction", direction), ("service", "a")],
        )
    };
    assert_eq!(bytes("received"), Some(7.0), "{text}");
    assert_eq!(bytes("sent"), Some(7.0), "{text}");
    assert!(!text.contains("service=\"zzz\""), "{text}");
    c.stop().await;
}
