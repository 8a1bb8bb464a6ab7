//! The sidecar injector (`--webhook-listen`; the kustomize component
//! `sidecar-injector`): a mutating admission webhook that gives pods
//! labelled `kt.dev/agent: sidecar` the kt agent, as the components
//! agent-sidecar and agent-identity give it to the workloads they list.
//!
//! Its own HTTPS listener, apart from the API: the API server calls it
//! with no kt token, so nothing here is behind kt's auth, and nothing here
//! reads or changes the registry. One route, `POST /mutate`: an
//! AdmissionReview v1 in, the answer out ([`kt_kube::admission`]; the
//! injection itself is [`kt_kube::inject`], pure). The certificate comes
//! from cert-manager (`--webhook-tls-cert`, `--webhook-tls-key`) and is read
//! again as it is renewed ([`kt_service::tls`]); the template is read once,
//! at start (the ConfigMap's hash suffix restarts the server when it
//! changes).
//!
//! Bounds: a body of at most [`MAX_BODY`] (a pod is at most what etcd
//! stores, 1.5 MiB) that never sends nothing for [`BODY_IDLE`],
//! [`MAX_IN_FLIGHT`] reviews at once (more wait), each answered within
//! [`DEADLINE`], its wait included, or failed (the API server waits
//! `timeoutSeconds`, at most 30 s). Counted on the server's `/metrics` as
//! `kt_http_requests_total{route="/mutate"}` by status: 200 is an answer
//! (an injection, or a pod that has its agent), 400 a review that could
//! not be answered, which the webhook's failurePolicy then decides.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kt_kube::admission::{self, Verdict};
use kt_kube::inject::{Template, TemplateError};
use kt_service::tls::{Tls, TlsError};
use kt_service::{ApiBytes, ApiError, Metrics};
use kt_types::ErrorCode;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The webhook's route.
pub const MUTATE: &str = "/mutate";
/// The largest AdmissionReview taken.
pub const MAX_BODY: usize = 4 * 1024 * 1024;
/// Reviews answered at once (each is a little CPU: more wait, within
/// [`DEADLINE`]).
pub const MAX_IN_FLIGHT: usize = 64;
/// The longest a review may take, its body and its wait for a slot
/// included: a peer that stalls bodies holds a slot at most this long.
pub const DEADLINE: Duration = Duration::from_secs(10);
/// The longest a review's body may send nothing: the API server sends a
/// review whole, so only a stalling peer waits this long.
pub const BODY_IDLE: Duration = Duration::from_secs(1);
/// How long answers in flight may finish once the server stops.
const DRAIN: Duration = Duration::from_secs(5);

/// Why the webhook cannot start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("--inject-template {path}: {why}")]
    Read { path: String, why: String },
    #[error("--inject-template {path}: {error}")]
    Template { path: String, error: TemplateError },
    #[error(
        "--inject-template {0}: the template names no agent image: set --inject-agent-image \
         (KT_INJECT_AGENT_IMAGE)"
    )]
    NoImage(String),
    #[error("--webhook-tls-cert, --webhook-tls-key: {0}")]
    Tls(#[from] TlsError),
}

/// The injector: its template and its certificate.
#[derive(Debug, Clone)]
pub struct Webhook {
    template: Arc<Template>,
    tls: Tls,
}

impl Webhook {
    pub fn new(template: Template, tls: Tls) -> Webhook {
        Webhook {
            template: Arc::new(template),
            tls,
        }
    }

    /// The template of `template` (`--inject-template`), with `agent_image`
    /// (`--inject-agent-image`) as the agent's image, and the certificate
    /// pair.
    pub fn load(
        template: &Path,
        agent_image: Option<&str>,
        cert: &Path,
        key: &Path,
    ) -> Result<Webhook, WebhookError> {
        let shown = || template.display().to_string();
        let text = std::fs::read_to_string(template).map_err(|e| WebhookError::Read {
            path: shown(),
            why: e.to_string(),
        })?;
        let mut t = Template::from_yaml(&text).map_err(|error| WebhookError::Template {
            path: shown(),
            error,
        })?;
        if let Some(image) = agent_image.map(str::trim).filter(|i| !i.is_empty()) {
            t = t.with_agent_image(image);
        }
        if t.agent_image().is_none() {
            return Err(WebhookError::NoImage(shown()));
        }
        Ok(Webhook::new(t, Tls::load(cert, key)?))
    }

    /// The routes, counted on `metrics`.
    pub fn router(&self, metrics: Arc<Metrics>) -> Router {
        Router::new()
            .route(MUTATE, post(mutate))
            .with_state(self.template.clone())
            .fallback(|| async {
                ApiError::not_found("no such route: the webhook is POST /mutate")
            })
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .layer(axum::middleware::from_fn_with_state(
                BODY_IDLE,
                kt_service::idle_bodies_fail,
            ))
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                MAX_IN_FLIGHT,
            ))
            // Outside the limit (review B5): the wait for a slot counts, so
            // peers holding every slot with stalled bodies fail the queued
            // reviews within the deadline instead of holding them unbounded.
            .layer(axum::middleware::from_fn(deadline))
            .layer(axum::middleware::from_fn_with_state(
                metrics,
                kt_service::metrics::count_requests,
            ))
    }

    /// Serves the webhook over HTTPS on `listener` until `shutdown`.
    pub async fn serve(
        self,
        listener: TcpListener,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let addr = listener.local_addr()?;
        tracing::info!(%addr, route = MUTATE, "sidecar injector listening (HTTPS)");
        let app = self.router(metrics);
        kt_service::serve_tls(listener, app, shutdown, DRAIN, Some(&self.tls)).await
    }

    /// [`Webhook::serve`] beside a metadata server (its `run_with` task):
    /// counted on its `/metrics`, stopped with it, and stopping it if the
    /// listener fails (a server that would not inject must not look well).
    pub async fn serve_beside(self, listener: TcpListener, server: crate::Handle) {
        let shutdown = server.shutdown();
        if let Err(e) = self
            .serve(listener, server.metrics(), shutdown.clone())
            .await
        {
            tracing::error!(error = %e, "the sidecar injector failed; stopping the server");
            shutdown.cancel();
        }
    }
}

/// The flags of the webhook (each with its env var), checked together.
#[derive(Debug, Clone, Default)]
pub struct WebhookArgs {
    pub listen: Option<SocketAddr>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub template: Option<PathBuf>,
    pub agent_image: Option<String>,
}

impl WebhookArgs {
    /// `None` without `--webhook-listen`; with it, the loaded webhook and
    /// its address (the rest is required then, and refused without it).
    pub fn load(&self) -> Result<Option<(SocketAddr, Webhook)>, String> {
        let Some(addr) = self.listen else {
            let stray = [
                (self.tls_cert.is_some(), "--webhook-tls-cert"),
                (self.tls_key.is_some(), "--webhook-tls-key"),
                (self.template.is_some(), "--inject-template"),
            ];
            if let Some((_, flag)) = stray.iter().find(|(set, _)| *set) {
                return Err(format!(
                    "{flag} without --webhook-listen (KT_WEBHOOK_LISTEN)"
                ));
            }
            return Ok(None);
        };
        let need = |v: &Option<PathBuf>, flag: &str| {
            v.clone().ok_or_else(|| {
                format!("--webhook-listen needs {flag}: the webhook serves HTTPS with its template")
            })
        };
        let cert = need(&self.tls_cert, "--webhook-tls-cert (KT_WEBHOOK_TLS_CERT)")?;
        let key = need(&self.tls_key, "--webhook-tls-key (KT_WEBHOOK_TLS_KEY)")?;
        let template = need(&self.template, "--inject-template (KT_INJECT_TEMPLATE)")?;
        let hook = Webhook::load(&template, self.agent_image.as_deref(), &cert, &key)
            .map_err(|e| e.to_string())?;
        Ok(Some((addr, hook)))
    }
}

/// Fails a review that takes longer than [`DEADLINE`] (a body that
/// stalls holds a slot until then).
async fn deadline(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::time::timeout(DEADLINE, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::new(
            ErrorCode::Unavailable,
            format!("the review took longer than {} s", DEADLINE.as_secs()),
        )
        .into_response(),
    }
}

async fn mutate(State(template): State<Arc<Template>>, ApiBytes(body, _): ApiBytes) -> Response {
    match admission::review(&body, &template) {
        Ok(r) => {
            match &r.verdict {
                Verdict::Injected(ops) => tracing::info!(
                    pod = %r.pod, uid = %r.uid, ops = ops.len(), dry_run = r.dry_run,
                    "kt agent injected"
                ),
                Verdict::Present => {
                    tracing::debug!(pod = %r.pod, uid = %r.uid, "the pod has its kt agent")
                }
                Verdict::NotHandled(why) => {
                    tracing::warn!(uid = %r.uid, %why, "admission review not handled: allowed as is")
                }
            }
            axum::Json(r.response()).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "admission review refused (HTTP 400: the webhook's failurePolicy decides)");
            ApiError::bad_request(e.to_string()).into_response()
        }
    }
}
