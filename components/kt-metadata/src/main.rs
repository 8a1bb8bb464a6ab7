use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kt_types::env;

/// kt metadata server: the key registry of one namespace.
#[derive(Debug, Parser)]
#[command(name = "kt-metadata", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = env::LISTEN, default_value = "0.0.0.0:8081")]
    listen: SocketAddr,
    /// Directory of the registry database.
    #[arg(long, env = env::STATE_DIR)]
    state_dir: PathBuf,
    #[command(flatten)]
    server: kt_service::cli::ServerArgs,
    /// How often node agents heartbeat.
    #[arg(long, env = env::HEARTBEAT_INTERVAL, default_value = "2s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// An agent silent this long stops being a source and is evicted.
    #[arg(long, env = env::AGENT_TTL, default_value = "10s", value_parser = humantime::parse_duration)]
    agent_ttl: Duration,
    /// How long a source lease lasts unless the getter renews it.
    #[arg(long, env = env::LEASE_TTL, default_value = "30s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// Watch the namespace's pods and workloads labelled kt.dev/service: evict
    /// the agents of pods that are gone, tear down services whose last
    /// workload and pod are gone.
    #[arg(long, env = env::KUBE_WATCH, value_parser = clap::builder::BoolishValueParser::new())]
    kube_watch: bool,
    /// Namespace to watch (default: this pod's service-account namespace).
    #[arg(long, env = env::NAMESPACE)]
    namespace: Option<String>,
    /// With --kube-auth: who may do what, by ServiceAccount (YAML; the
    /// kt-access ConfigMap in the bundle).
    #[arg(long, env = env::ACCESS_MAP)]
    access_map: Option<PathBuf>,
    /// With --kube-auth: the audience tokens must be made for.
    #[arg(long, env = env::TOKEN_AUDIENCE, default_value = "kt")]
    token_audience: String,
    /// Serve the sidecar injector, an admission webhook (POST /mutate), on
    /// this address: HTTPS with --webhook-tls-cert and --webhook-tls-key,
    /// injecting --inject-template into the pods the API server sends.
    #[arg(long, env = env::WEBHOOK_LISTEN)]
    webhook_listen: Option<SocketAddr>,
    /// The webhook's PEM certificate chain (read again as it is renewed).
    #[arg(long, env = env::WEBHOOK_TLS_CERT)]
    webhook_tls_cert: Option<PathBuf>,
    /// The PEM private key of --webhook-tls-cert.
    #[arg(long, env = env::WEBHOOK_TLS_KEY)]
    webhook_tls_key: Option<PathBuf>,
    /// What the webhook injects: the pod template the agent-sidecar and
    /// agent-identity components render (the sidecar-injector component's
    /// template.yaml).
    #[arg(long, env = env::INJECT_TEMPLATE)]
    inject_template: Option<PathBuf>,
    /// The injected agent's image (the template carries none, so that
    /// kustomize's `images:` pins it in the ConfigMap).
    #[arg(long, env = env::INJECT_AGENT_IMAGE)]
    inject_agent_image: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // With --kube-auth this server reviews the tokens itself (`serve`).
    let server = args.server.load(None)?;
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let mut config = kt_metadata::Config::new(args.state_dir.clone(), server);
    config.heartbeat_interval = args.heartbeat_interval;
    config.agent_ttl = args.agent_ttl;
    config.lease_ttl = args.lease_ttl;
    serve(&args, listener, config, shutdown).await
}

/// Runs the server, with the namespace watch (`--kube-watch`),
/// ServiceAccount tokens (`--kube-auth`) and the sidecar injector
/// (`--webhook-listen`) when asked: the first two on one Kubernetes client
/// and namespace.
#[cfg(feature = "kube")]
async fn serve(
    args: &Args,
    listener: tokio::net::TcpListener,
    mut config: kt_metadata::Config,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let webhook = kt_metadata::webhook::WebhookArgs {
        listen: args.webhook_listen,
        tls_cert: args.webhook_tls_cert.clone(),
        tls_key: args.webhook_tls_key.clone(),
        template: args.inject_template.clone(),
        agent_image: args.inject_agent_image.clone(),
    }
    .load()
    .map_err(anyhow::Error::msg)?;
    let webhook = match webhook {
        Some((addr, hook)) => Some((
            kt_service::cli::listen(addr).with_context(|| format!("binding {addr}"))?,
            hook,
        )),
        None => None,
    };
    let mut watch = None;
    if args.kube_watch || args.server.auth.kube_auth {
        let namespace = args
            .namespace
            .clone()
            .or_else(kt_kube::in_cluster_namespace)
            .context(
                "--kube-watch and --kube-auth need a namespace: set KT_NAMESPACE or run in a pod",
            )?;
        // Only the configuration can fail here; API errors are retried (the
        // watch) or answered 503 (token reviews).
        let client = kube::Client::try_default().await.context(
            "--kube-watch, --kube-auth: no Kubernetes configuration (in-cluster or kubeconfig)",
        )?;
        if args.server.auth.kube_auth {
            let path = args
                .access_map
                .as_deref()
                .context("--kube-auth needs --access-map (KT_ACCESS_MAP): who may do what")?;
            let map = kt_metadata::kube_auth::load_access_map(path).map_err(anyhow::Error::msg)?;
            let reviewer = kt_metadata::kube_auth::KubeReviewer::new(
                client.clone(),
                &args.token_audience,
                &namespace,
                map,
            );
            config.server.auth = Some(kt_service::Auth::asking(
                config.server.auth.take(),
                std::sync::Arc::new(reviewer),
            ));
        }
        if args.kube_watch {
            watch = Some((client, kt_kube::watch::WatchConfig::new(namespace)));
        }
    }
    if watch.is_none() && webhook.is_none() {
        return Ok(kt_metadata::run(listener, config, shutdown).await?);
    }
    kt_metadata::run_with(listener, config, shutdown, move |handle| async move {
        let watch = async {
            if let Some((client, cfg)) = watch {
                kt_metadata::cluster::watch(handle.clone(), client, cfg).await;
            }
        };
        let hook = async {
            if let Some((listener, hook)) = webhook {
                hook.serve_beside(listener, handle.clone()).await;
            }
        };
        tokio::join!(watch, hook);
    })
    .await?;
    Ok(())
}

#[cfg(not(feature = "kube"))]
async fn serve(
    args: &Args,
    listener: tokio::net::TcpListener,
    config: kt_metadata::Config,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    if args.kube_watch || args.server.auth.kube_auth || args.webhook_listen.is_some() {
        anyhow::bail!(
            "--kube-watch, --kube-auth, --webhook-listen: this kt-metadata was built without the \
             `kube` feature"
        );
    }
    Ok(kt_metadata::run(listener, config, shutdown).await?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
