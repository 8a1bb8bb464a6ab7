//! `kt --kube`: kt from outside the cluster, through the Kubernetes API.
//!
//! The token comes from Secret `kt-token` (key `token`), or where there is
//! none (an install on Kubernetes identities) from a TokenRequest for the
//! ServiceAccount `kt-operator`, unless one is given; the metadata server is
//! reached at `http://kt-metadata:8081` (`https://` where `KT_CA_FILE` is
//! set: an install with the tls component) and every server it names (the
//! store's `http://kt-store:8082`, agents' `http://<pod IP>:8090`) through
//! local port-forwards
//! ([`kt_kube::portforward::Forwarder`]), plugged into the client as its
//! [`UrlMap`]. The CLI's `--kube` and the Python package's
//! `kt.configure(kube=True)` both reach kt this way.

use std::sync::Arc;

pub use kt_kube::portforward::KubeOptions;
use kt_kube::portforward::{self, ForwardError, Forwarder};

use crate::UrlMap;

/// Why kt could not be reached through the Kubernetes API.
#[derive(Debug, thiserror::Error)]
pub enum ExternalError {
    /// No token was given and none could be had from the cluster.
    #[error("no token given (KT_TOKEN, --token-file): getting one from the cluster: {0}")]
    Token(#[source] ForwardError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// The forwards of one `kt` run.
#[derive(Debug)]
pub struct External {
    forwarder: Arc<Forwarder>,
    /// The local URL of the metadata server.
    pub metadata_url: String,
    /// The token read from the Secret, when none was given.
    pub token: Option<String>,
}

#[derive(Debug)]
struct ForwardMap(Arc<Forwarder>);

impl UrlMap for ForwardMap {
    fn map(&self, url: &str) -> Result<String, String> {
        self.0.local_url(url).map_err(|e| e.to_string())
    }
}

impl External {
    /// Connects to the cluster of `opts`; reads the token Secret when `read_token`.
    pub async fn connect(opts: &KubeOptions, read_token: bool) -> Result<Self, ExternalError> {
        let (client, namespace) = portforward::connect(opts).await?;
        let token = if read_token {
            let t = portforward::cluster_token(&client, &namespace)
                .await
                .map_err(ExternalError::Token)?;
            Some(t)
        } else {
            None
        };
        let forwarder = Forwarder::new(client, namespace);
        // A CA to trust means the servers serve TLS (the tls component).
        let metadata = match std::env::var_os(kt_api::tls::CA_FILE) {
            Some(_) => kt_kube::METADATA_SERVICE_URL_TLS,
            None => kt_kube::METADATA_SERVICE_URL,
        };
        let metadata_url = forwarder.local_url(metadata)?;
        tracing::debug!(namespace = forwarder.namespace(), %metadata_url, "reaching kt through port-forwards");
        Ok(External {
            forwarder,
            metadata_url,
            token,
        })
    }

    /// The client's URL map.
    pub fn url_map(&self) -> Arc<dyn UrlMap> {
        Arc::new(ForwardMap(self.forwarder.clone()))
    }

    /// Ends every forward.
    pub async fn close(&self) {
        self.forwarder.close().await;
    }
}
