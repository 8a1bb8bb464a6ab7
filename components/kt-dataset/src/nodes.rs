//! The controller's client of the node-cache agents' dataset API (routes in
//! [`kt_types::dataset`]): a report, a seed, an unseed. Calls go through
//! [`kt_api::Api`] (the one HTTP client of kt) with the controller's
//! bearer token and a short time limit each: an agent that does not answer
//! in time is unreachable, which the reconcile treats as a lost node, not
//! as an error of the reconcile. A report is read up to
//! [`MAX_REPORT_BYTES`]: an agent cannot make the controller hold more.

use std::net::IpAddr;
use std::time::Duration;

use kt_api::{Api, CallError, Credential};
use kt_types::api::API_PREFIX;
use kt_types::dataset::{NodeDataset, NodeReport, SeedRequest};
use kt_types::paths::encode;

/// The most bytes of a report read (a report of thousands of datasets is
/// well below it).
pub const MAX_REPORT_BYTES: usize = 8 << 20;

/// Why a report could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("{url}: the report is longer than {MAX_REPORT_BYTES} bytes")]
    TooLarge { url: String },
    #[error("{url}: reading the report: {source}")]
    Read {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}: the report is no NodeReport: {source}")]
    Decode {
        url: String,
        #[source]
        source: serde_json::Error,
    },
}

/// How node-cache agents are reached.
#[derive(Debug, Clone)]
pub struct NodeCaches {
    api: Api,
    scheme: String,
    port: u16,
    timeout: Duration,
}

impl NodeCaches {
    /// Agents listen on `scheme://<pod IP>:<port>` (a pod may name another
    /// port, [`NodeCaches::at`]); each call is given `timeout`.
    pub fn new(
        http: reqwest::Client,
        token: impl Into<Credential>,
        scheme: &str,
        port: u16,
        timeout: Duration,
    ) -> NodeCaches {
        NodeCaches {
            api: Api::new(http, "http://unused.invalid", token),
            scheme: scheme.to_owned(),
            port,
            timeout,
        }
    }

    /// The default port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The agent at `ip`, on `port` (the default one when `None`).
    pub fn at(&self, ip: IpAddr, port: Option<u16>) -> NodeCache {
        let port = port.unwrap_or(self.port);
        let host = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        NodeCache {
            api: self.api.at(&format!("{}://{host}:{port}", self.scheme)),
            timeout: self.timeout,
        }
    }
}

/// One node-cache agent.
#[derive(Debug, Clone)]
pub struct NodeCache {
    api: Api,
    timeout: Duration,
}

fn datasets() -> String {
    format!("{API_PREFIX}/datasets")
}

fn dataset(namespace: &str, name: &str) -> String {
    format!(
        "{API_PREFIX}/datasets/{}/{}",
        encode(namespace),
        encode(name)
    )
}

impl NodeCache {
    /// Its base URL.
    pub fn base(&self) -> &str {
        self.api.base()
    }

    /// `GET /api/v1/datasets`, read up to [`MAX_REPORT_BYTES`].
    pub async fn report(&self) -> Result<NodeReport, ReportError> {
        let url = format!("{}{}", self.base(), datasets());
        let mut resp = self
            .api
            .get(&datasets())
            .timeout(self.timeout)
            .retry(1)
            .send()
            .await?;
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_REPORT_BYTES as u64)
        {
            return Err(ReportError::TooLarge { url });
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|source| ReportError::Read {
            url: url.clone(),
            source,
        })? {
            if body.len() + chunk.len() > MAX_REPORT_BYTES {
                return Err(ReportError::TooLarge { url });
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body).map_err(|source| ReportError::Decode { url, source })
    }

    /// `PUT /api/v1/datasets/{namespace}/{name}`: the dataset's state on the
    /// node as the agent answers it (the fetch runs in the background).
    pub async fn seed(
        &self,
        namespace: &str,
        name: &str,
        request: &SeedRequest,
    ) -> Result<NodeDataset, CallError> {
        self.api
            .put(&dataset(namespace, name))
            .json(request)
            .timeout(self.timeout)
            .retry(1)
            .fetch()
            .await
    }

    /// `DELETE /api/v1/datasets/{namespace}/{name}[?retain=true]`. A
    /// dataset the agent does not hold is already gone: success.
    pub async fn unseed(&self, namespace: &str, name: &str, retain: bool) -> Result<(), CallError> {
        let mut call = self
            .api
            .delete(&dataset(namespace, name))
            .timeout(self.timeout)
            .retry(1);
        if retain {
            call = call.query(&[("retain", "true")]);
        }
        match call.ok().await {
            Err(CallError::Status { status: 404, .. }) => Ok(()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_urls_and_paths() {
        let caches = NodeCaches::new(
            kt_api::client(),
            Credential::fixed("t"),
            "http",
            8090,
            Duration::from_secs(2),
        );
        assert_eq!(
            caches.at("10.0.0.7".parse().unwrap(), None).base(),
            "http://10.0.0.7:8090"
        );
        assert_eq!(
            caches.at("fd00::7".parse().unwrap(), Some(9000)).base(),
            "http://[fd00::7]:9000"
        );
        assert_eq!(dataset("team", "a b"), "/api/v1/datasets/team/a%20b");
    }

    /// An agent answering with an endless report is unreachable, not a
    /// controller out of memory; an ordinary one is read.
    #[tokio::test]
    async fn reports_are_read_up_to_a_bound() {
        use axum::routing::get;
        use futures::StreamExt;
        let report = NodeReport {
            node: "n1".into(),
            root: "/var/lib/kt/datasets".into(),
            budget_bytes: 1,
            used_bytes: 0,
            free_bytes: 1,
            datasets: vec![],
        };
        let ok = report.clone();
        let app = axum::Router::new()
            .route(
                "/ok/api/v1/datasets",
                get(move || async move { axum::Json(ok) }),
            )
            .route(
                "/endless/api/v1/datasets",
                get(|| async {
                    // Chunked, no length: only counting stops it.
                    let chunks = futures::stream::repeat_with(|| {
                        Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 1 << 16]))
                    })
                    .take(2 * MAX_REPORT_BYTES / (1 << 16));
                    axum::body::Body::from_stream(chunks)
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let agent = |prefix: &str| NodeCache {
            api: Api::new(
                kt_api::client(),
                &format!("http://{addr}/{prefix}"),
                Credential::fixed("t"),
            ),
            timeout: Duration::from_secs(30),
        };
        assert_eq!(agent("ok").report().await.unwrap(), report);
        let e = agent("endless").report().await.unwrap_err();
        assert!(matches!(e, ReportError::TooLarge { .. }), "{e}");
    }
}
