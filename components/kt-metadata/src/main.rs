use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

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
    /// How often node agents heartbeat.
    #[arg(long, env = "KT_HEARTBEAT_INTERVAL", default_value = "2s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// An agent silent this long stops being a source and is evicted.
    #[arg(long, env = "KT_AGENT_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    agent_ttl: Duration,
    /// How long a source lease lasts unless the getter renews it.
    #[arg(long, env = "KT_LEASE_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let token = args.server.init()?;
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let mut config = kt_metadata::Config::new(args.state_dir, token);
    config.max_in_flight = args.server.max_connections;
    config.heartbeat_interval = args.heartbeat_interval;
    config.agent_ttl = args.agent_ttl;
    config.lease_ttl = args.lease_ttl;
    kt_metadata::run(listener, config, shutdown).await?;
    Ok(())
}
