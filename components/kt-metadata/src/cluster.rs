//! The namespace watch (`--kube-watch`): `kt_kube::watch` decides, this
//! applies its decisions to the server through a [`Handle`]: the agent of a
//! pod that is gone is evicted (and persisted, as the sweep does); a service
//! whose last workload and pod are gone is torn down as by
//! `DELETE /api/v1/services/{name}`. See `kt_kube::state` for the rules,
//! startup included.
//!
//! A pod's agent is evicted, not retired: a StatefulSet pod comes back under
//! the same name, and its agent's next heartbeat makes it a source again.

use std::time::Duration;

use kt_kube::state::{Action, RecordedAgent};
use kt_kube::watch::WatchConfig;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::server::Handle;

/// Teardown attempts before one is given up (each failure is logged).
const TEARDOWN_ATTEMPTS: u32 = 6;
/// Delay before the second attempt; doubled after each.
const TEARDOWN_RETRY: Duration = Duration::from_secs(1);

/// Watches `cfg.namespace` with `client` until the server stops.
pub async fn watch(handle: Handle, client: kube::Client, cfg: WatchConfig) {
    let shutdown = handle.shutdown();
    let recorded = handle
        .agents()
        .await
        .into_iter()
        .map(|a| RecordedAgent {
            id: a.id,
            service: a.service,
        })
        .collect();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let watcher = tokio::spawn(kt_kube::watch::run(
        client,
        cfg,
        recorded,
        tx,
        shutdown.clone(),
    ));
    let mut teardowns = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(_) = teardowns.join_next() => {}
            action = rx.recv() => match action {
                Some(Action::Evict(ids)) => evict(&handle, &ids).await,
                Some(Action::Teardown(service)) => {
                    teardowns.spawn(teardown(handle.clone(), service));
                }
                None => break,
            },
        }
    }
    teardowns.abort_all();
    while teardowns.join_next().await.is_some() {}
    let _ = watcher.await;
}

async fn evict(handle: &Handle, ids: &[String]) {
    match handle.evict_agents(ids, "its pod is gone").await {
        Ok(evicted) if evicted.is_empty() => {
            tracing::debug!(pods = ?ids, "pods gone; no agent of theirs was registered");
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(pods = ?ids, error = %e, "could not persist an eviction; it is redone at start")
        }
    }
}

/// Tears `service` down, retrying a failure (the store unreachable) a few times.
async fn teardown(handle: Handle, service: String) {
    let mut backoff = kt_api::Backoff::new(TEARDOWN_RETRY, TEARDOWN_RETRY * 16);
    for attempt in 1..=TEARDOWN_ATTEMPTS {
        match handle.teardown(&service).await {
            Ok(r) => {
                tracing::info!(
                    service,
                    keys = r.deleted.len(),
                    agents = r.evicted.len(),
                    "service gone from the cluster: torn down"
                );
                return;
            }
            Err(e) if attempt < TEARDOWN_ATTEMPTS => {
                tracing::warn!(service, attempt, error = %e.message, "teardown of a vanished service failed; retrying");
                backoff.wait().await;
            }
            Err(e) => {
                tracing::error!(service, error = %e.message, "teardown of a vanished service failed; giving up (run `kt teardown`)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The watch wired into a real metadata server on 127.0.0.1:0, with a
    //! scripted Kubernetes API.

    use std::time::Duration;

    use kt_kube::mock::{self, MockApi, Reply};
    use kt_service::Token;
    use serde_json::{Value, json};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::Config;

    const TOKEN: &str = "test-token";

    struct Server {
        url: String,
        http: reqwest::Client,
        shutdown: CancellationToken,
        done: tokio::task::JoinHandle<()>,
        _dir: tempfile::TempDir,
    }

    impl Server {
        async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
            let mut req = self
                .http
                .request(method, format!("{}/api/v1/{path}", self.url))
                .bearer_auth(TOKEN);
            if let Some(b) = body {
                req = req.json(&b);
            }
            let resp = req.send().await.expect("request");
            assert!(resp.status().is_success(), "{path}: {}", resp.status());
            resp.json().await.unwrap_or(Value::Null)
        }

        async fn agents(&self) -> Vec<String> {
            let list = self.call(reqwest::Method::GET, "agents", None).await;
            list["agents"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|a| a["id"].as_str().unwrap_or_default().to_owned())
                .collect()
        }

        async fn has_key(&self, key: &str) -> bool {
            let resp = self
                .http
                .get(format!("{}/api/v1/keys/{key}", self.url))
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("request");
            resp.status().is_success()
        }

        async fn stop(self) {
            self.shutdown.cancel();
            self.done.await.expect("server task");
        }
    }

    async fn start(client: kube::Client) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let config = Config::new(dir.path(), Token::new(TOKEN).expect("token"));
        let shutdown = CancellationToken::new();
        let mut cfg = WatchConfig::new("kt");
        cfg.backoff_initial = Duration::from_millis(10);
        cfg.backoff_max = Duration::from_millis(50);
        let stop = shutdown.clone();
        let done = tokio::spawn(async move {
            crate::run_with(listener, config, stop, move |h| watch(h, client, cfg))
                .await
                .expect("server");
        });
        Server {
            url,
            http: kt_api::client(),
            shutdown,
            done,
            _dir: dir,
        }
    }

    async fn wait_until<F, Fut>(what: &str, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !f().await {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn heartbeat(id: &str, service: &str) -> Value {
        json!({"id": id, "url": format!("http://{id}:8090"), "service": service, "serves": []})
    }

    #[tokio::test]
    async fn deleted_pods_and_workloads_evict_agents_and_tear_down_services() {
        let api = MockApi::default();
        // The initial pod list: web-a (service web) and train-x (service train).
        api.script(
            "pods",
            Reply::Json(
                http_ok(),
                mock::list(
                    &[
                        mock::pod("web-a", "web", "Running", "10"),
                        mock::pod("train-x", "train", "Running", "11"),
                    ],
                    "12",
                ),
            ),
        );
        api.script(
            "jobs",
            Reply::Json(
                http_ok(),
                mock::list(&[mock::workload("Job", "train", "train", "5")], "12"),
            ),
        );
        api.script(
            "deployments",
            Reply::Json(
                http_ok(),
                mock::list(&[mock::workload("Deployment", "web", "web", "6")], "12"),
            ),
        );
        let (client, mock_task) = api.client("kt");
        let server = start(client).await;
        let s = &server;
        // Agents announce themselves; train-x holds a resource key of service train.
        for (id, service) in [("web-a", "web"), ("train-x", "train")] {
            s.call(
                reqwest::Method::POST,
                "agents",
                Some(heartbeat(id, service)),
            )
            .await;
        }
        s.call(
            reqwest::Method::PUT,
            "keys/train/ckpt",
            Some(json!({
                "locale": "local",
                "holder": "train-x",
                "source": "http://train-x:8090",
                "version": "v1",
                "is_dir": false,
                "size": 1,
                "files": 1,
                "lifespan": "resource",
                "service": "train",
                "digest": "0000000000000000000000000000000000000000000000000000000000000000",
            })),
        )
        .await;
        assert!(s.has_key("train/ckpt").await);
        // The pod watch: web-a is deleted. The job watch: train is deleted
        // (its pod finishes first).
        api.script(
            "pods?watch",
            Reply::Events(vec![
                mock::event("DELETED", mock::pod("web-a", "web", "Running", "20")),
                mock::event("MODIFIED", mock::pod("train-x", "train", "Succeeded", "21")),
            ]),
        );
        api.script(
            "jobs?watch",
            Reply::Events(vec![mock::event(
                "DELETED",
                mock::workload("Job", "train", "train", "22"),
            )]),
        );
        wait_until("web-a evicted", || async {
            !s.agents().await.contains(&"web-a".to_owned())
        })
        .await;
        wait_until("train torn down", || async {
            !s.has_key("train/ckpt").await
        })
        .await;
        assert!(!s.agents().await.contains(&"train-x".to_owned()));
        server.stop().await;
        mock_task.abort();
    }

    fn http_ok() -> http::StatusCode {
        http::StatusCode::OK
    }
}
