use std::net::SocketAddr;
use std::path::PathBuf;

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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let token = args.server.init()?;
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let mut config = kt_metadata::Config::new(args.state_dir, token);
    config.max_in_flight = args.server.max_connections;
    kt_metadata::run(listener, config, shutdown).await?;
    Ok(())
}
