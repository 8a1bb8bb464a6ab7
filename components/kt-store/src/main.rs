use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kt_service::Token;
use tokio_util::sync::CancellationToken;

/// kt store server: holds locale=store data and serves it over the sync protocol.
#[derive(Debug, Parser)]
#[command(name = "kt-store", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "KT_LISTEN", default_value = "0.0.0.0:8082")]
    listen: SocketAddr,
    /// Directory holding the data (a persistent volume in a cluster).
    #[arg(long, env = "KT_DATA_DIR")]
    data_dir: PathBuf,
    /// URL of the metadata server.
    #[arg(long, env = "KT_METADATA_URL")]
    metadata_url: String,
    /// URL under which clients reach this store (default: the listen address).
    #[arg(long, env = "KT_ADVERTISE_URL")]
    advertise_url: Option<String>,
    /// Bearer token (prefer --token-file).
    #[arg(long, env = "KT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = "KT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Chunk size for large files, in bytes (a power of two).
    #[arg(long, env = "KT_CHUNK_SIZE", default_value_t = kt_sync::defaults::CHUNK_SIZE)]
    chunk_size: u64,
    /// Requests served at once.
    #[arg(long, env = "KT_MAX_CONNECTIONS", default_value_t = 512)]
    max_connections: usize,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "KT_LOG", default_value = "info")]
    log: String,
    /// Log format: json, text or auto (json unless stderr is a terminal).
    #[arg(long, env = "KT_LOG_FORMAT", default_value = "auto")]
    log_format: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kt_service::telemetry::init_logging(Some(&args.log), Some(&args.log_format));
    let token = Token::resolve(args.token.as_deref(), args.token_file.as_deref())?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let shutdown = CancellationToken::new();
    kt_service::telemetry::cancel_on_signals(shutdown.clone());
    let mut config = kt_store::Config::new(args.data_dir, args.metadata_url, token);
    config.advertise_url = args.advertise_url;
    config.chunk_size = args.chunk_size;
    config.max_in_flight = args.max_connections;
    kt_store::run(listener, config, shutdown).await?;
    Ok(())
}
