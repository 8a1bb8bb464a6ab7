use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kt_dataset::controller::{self, Config, Context, Namespaces, NodeCachePods, PvcIngest};
use kt_dataset::nodes::NodeCaches;
use kt_dataset::reconcile::Settings;
use kt_types::env;

/// The Dataset controller: places `datasets.kt.dev` on nodes through their
/// node-cache agents and labels the nodes.
#[derive(Debug, Parser)]
#[command(name = "kt-dataset-controller", version)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the controller (the default).
    Run,
    /// Print the Dataset CRD manifest.
    Crd,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = env::LISTEN, default_value = "0.0.0.0:8084")]
    listen: SocketAddr,
    /// URL of the metadata server.
    #[arg(
        long,
        env = env::METADATA_URL,
        default_value = "http://kt-metadata:8081"
    )]
    metadata_url: String,
    /// Namespace of the node-cache pods (default: this pod's own).
    #[arg(long, env = env::NAMESPACE)]
    namespace: Option<String>,
    /// Whose Datasets to obey: namespaces separated by commas, or `*` for
    /// every one. Default: --namespace only (the kt install's). A Dataset
    /// can place any key of this kt install onto nodes and read its
    /// namespace's Secrets and PVCs with the controller's rights: name
    /// only namespaces whose Dataset creators you trust that far (and give
    /// the controller a Role there).
    #[arg(long, env = env::DATASET_NAMESPACES, value_parser = Namespaces::parse)]
    dataset_namespaces: Option<Namespaces>,
    /// Port of the node-cache agents (the controller's, not one a pod
    /// names: see --node-cache-port-from-pod).
    #[arg(long, env = env::NODE_CACHE_PORT, default_value_t = 8090,
          value_parser = |s: &str| env::port(env::NODE_CACHE_PORT, s))]
    node_cache_port: u16,
    /// The DaemonSet whose pods (a controller ownerReference) are the
    /// node-cache agents: the controller sends them its token, so a pod
    /// that merely carries the node-cache label is ignored.
    #[arg(long, default_value = "kt-node-cache")]
    node_cache_daemonset: String,
    /// The ServiceAccount node-cache pods must run as.
    #[arg(long, default_value = "kt-node-cache")]
    node_cache_service_account: String,
    /// Take each agent's port from its pod (the port named `node-cache` or
    /// `http`) instead of --node-cache-port: for a testbed whose agents
    /// listen on ports of their own. Trusts the pod's spec; not for an
    /// install.
    #[arg(long)]
    node_cache_port_from_pod: bool,
    /// http or https (trusting the CAs of KT_CA_FILE).
    #[arg(long, env = env::NODE_CACHE_SCHEME, default_value = "http", value_parser = ["http", "https"])]
    node_cache_scheme: String,
    /// How long a node-cache agent may take to answer before it counts as
    /// unreachable.
    #[arg(long, env = env::NODE_CACHE_TIMEOUT, default_value = "3s", value_parser = humantime::parse_duration)]
    node_cache_timeout: Duration,
    /// How long a seeding broadcast group accepts joins.
    #[arg(long, env = env::SEED_WINDOW, default_value = "5s", value_parser = humantime::parse_duration)]
    seed_window: Duration,
    /// Where S3 ingests stage objects before the put.
    #[arg(
        long,
        env = env::STAGING_DIR,
        default_value = "/tmp/kt-dataset-staging"
    )]
    staging_dir: PathBuf,
    /// The image with `kt` that PVC ingest Jobs run; unset: PVC sources
    /// fail with reason `Unsupported`.
    #[arg(long, env = env::INGEST_IMAGE)]
    ingest_image: Option<String>,
    /// The metadata server's URL as ingest Jobs reach it (default:
    /// --metadata-url).
    #[arg(long, env = env::INGEST_METADATA_URL)]
    ingest_metadata_url: Option<String>,
    /// A Secret in each Dataset's namespace whose `token` key ingest Jobs
    /// present (an install with the static token; unused with
    /// --ingest-service-account).
    #[arg(long, env = env::INGEST_TOKEN_SECRET, default_value = "kt-token")]
    ingest_token_secret: String,
    /// The ServiceAccount (in each Dataset's namespace) ingest Jobs run as,
    /// presenting its projected token (audience kt) instead of the Secret:
    /// an install with kube identities, whose access map lets it write the
    /// service `datasets` (the datasets component's kt-dataset-ingest).
    #[arg(long, env = env::INGEST_SERVICE_ACCOUNT)]
    ingest_service_account: Option<String>,
    #[command(flatten)]
    server: kt_service::cli::ServerArgs,
}

/// This pod's namespace, as the ServiceAccount mount says.
fn own_namespace() -> Option<String> {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Some(Command::Crd) => {
            print!("{}", kt_dataset::crd::crd_yaml());
            Ok(())
        }
        Some(Command::Run) | None => run(args.run).await,
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let server = args.server.load(Some(&args.metadata_url))?;
    let token = server.token.clone();
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let namespace = args
        .namespace
        .clone()
        .or_else(own_namespace)
        .unwrap_or_else(|| "default".to_owned());
    let kube = kube::Client::try_default()
        .await
        .context("a Kubernetes client (in-cluster config or kubeconfig)")?;
    let mut kt_cfg = kt_client::ClientConfig::new(&args.metadata_url, token.expose());
    kt_cfg.token_file = args.server.token.token_file.clone();
    kt_cfg.cache_dir = None;
    kt_cfg.serve_copies = false;
    let kt = kt_client::Client::new(kt_cfg)?;
    let http = kt_api::tls::http_builder()?
        .connect_timeout(args.node_cache_timeout)
        .build()
        .context("the node-cache agents' HTTP client")?;
    let caches = NodeCaches::new(
        http,
        token.credential(),
        &args.node_cache_scheme,
        args.node_cache_port,
        args.node_cache_timeout,
    );
    let settings = Settings {
        seed_window: args.seed_window,
        ..Settings::default()
    };
    let pvc = args.ingest_image.clone().map(|image| PvcIngest {
        image,
        metadata_url: args
            .ingest_metadata_url
            .clone()
            .unwrap_or_else(|| args.metadata_url.clone()),
        token_secret: args.ingest_token_secret.clone(),
        service_account: args
            .ingest_service_account
            .clone()
            .filter(|s| !s.is_empty()),
    });
    let datasets = args
        .dataset_namespaces
        .clone()
        .unwrap_or_else(|| Namespaces::own(&namespace));
    let config = Config {
        datasets,
        namespace,
        settings,
        pvc,
        staging_dir: args.staging_dir.clone(),
        node_cache_pods: NodeCachePods {
            daemonset: args.node_cache_daemonset.clone(),
            service_account: args.node_cache_service_account.clone(),
            port_from_pod: args.node_cache_port_from_pod,
        },
    };
    let ctx = Context::new(kube, kt, caches, config);
    // Who may read /metrics: as on the store and agents.
    let auth = server.callers();
    let metrics = std::sync::Arc::new(kt_service::Metrics::with(|r| ctx.stats().register(r)));
    let ready = kt_service::Ready::default();
    ready.set(true);
    let app = kt_service::app(
        axum::Router::new(),
        auth,
        metrics,
        ready,
        server.max_in_flight,
    );
    tracing::info!(listen = %args.listen, "kt-dataset-controller started");
    let serve = kt_service::serve_tls(
        listener,
        app,
        shutdown.clone(),
        Duration::from_secs(5),
        server.tls.as_ref(),
    );
    let (served, ()) = tokio::join!(serve, controller::run(ctx, shutdown.clone()));
    served?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }

    #[test]
    fn crd_is_a_subcommand() {
        use clap::Parser;
        let a = super::Args::try_parse_from(["kt-dataset-controller", "crd"]).unwrap();
        assert!(matches!(a.command, Some(super::Command::Crd)));
        let a = super::Args::try_parse_from(["kt-dataset-controller", "--node-cache-port", "9000"])
            .unwrap();
        assert!(a.command.is_none());
        assert_eq!(a.run.node_cache_port, 9000);
        assert_eq!(a.run.node_cache_daemonset, "kt-node-cache");
        assert_eq!(a.run.node_cache_service_account, "kt-node-cache");
        assert!(!a.run.node_cache_port_from_pod);
        assert!(a.run.dataset_namespaces.is_none());
        assert!(a.run.ingest_service_account.is_none());
        assert_eq!(a.run.ingest_token_secret, "kt-token");
        let a = super::Args::try_parse_from([
            "kt-dataset-controller",
            "--ingest-service-account",
            "kt-dataset-ingest",
        ])
        .unwrap();
        assert_eq!(
            a.run.ingest_service_account.as_deref(),
            Some("kt-dataset-ingest")
        );
    }

    #[test]
    fn dataset_namespaces_are_a_list_or_every_one() {
        use clap::Parser;
        use kt_dataset::controller::Namespaces;
        let parse = |v: &str| {
            super::Args::try_parse_from(["kt-dataset-controller", "--dataset-namespaces", v])
                .map(|a| a.run.dataset_namespaces.unwrap())
        };
        assert_eq!(parse("*").unwrap(), Namespaces::All);
        let two = parse("kt, team-a").unwrap();
        assert!(two.contains("kt") && two.contains("team-a") && !two.contains("team-b"));
        assert!(parse("Team_A").is_err());
        assert!(parse(",").is_err());
    }
}
