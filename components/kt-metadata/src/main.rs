use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kt_service::Token;
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
    /// Bearer token (prefer --token-file).
    #[arg(long, env = "KT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = "KT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
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
    let mut config = kt_metadata::Config::new(args.state_dir, token);
    config.max_in_flight = args.max_connections;
    kt_metadata::run(listener, config, shutdown).await?;
    Ok(())
}
