use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// kt metadata server: the key registry of one namespace.
#[derive(Debug, Parser)]
#[command(name = "kt-metadata", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "KT_LISTEN", default_value = "0.0.0.0:8081")]
    listen: SocketAddr,
    /// Directory of the registry database.
    #[arg(long, env = "KT_STATE_DIR")]
    state_dir: PathBuf,
    #[command(flatten)]
    server: kt_service::cli::ServerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let token = args.server.init()?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let shutdown = CancellationToken::new();
    kt_service::telemetry::cancel_on_signals(shutdown.clone());
    let mut config = kt_metadata::Config::new(args.state_dir, token);
    config.max_in_flight = args.server.max_connections;
    kt_metadata::run(listener, config, shutdown).await?;
    Ok(())
}
