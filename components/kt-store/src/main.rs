use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kt_types::env;

/// kt store server: holds locale=store data and serves it over the sync protocol.
#[derive(Debug, Parser)]
#[command(name = "kt-store", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = env::LISTEN, default_value = "0.0.0.0:8082")]
    listen: SocketAddr,
    /// Directory holding the data (a persistent volume in a cluster).
    #[arg(long, env = env::DATA_DIR)]
    data_dir: PathBuf,
    #[command(flatten)]
    metadata: kt_service::cli::MetadataArgs,
    /// URL under which clients reach this store (default: the listen address).
    #[arg(long, env = env::ADVERTISE_URL)]
    advertise_url: Option<String>,
    #[command(flatten)]
    server: kt_service::cli::ServerArgs,
    /// Chunk size for large files, in bytes (a power of two).
    #[arg(long, env = env::CHUNK_SIZE, default_value_t = kt_sync::defaults::CHUNK_SIZE)]
    chunk_size: u64,
    /// Bytes of the data volume no put may take (default: 2% of it, at
    /// most 1 GiB): a put that would is refused at once as `store full`.
    #[arg(long, env = env::STORE_RESERVE)]
    reserve: Option<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = args.server.load(Some(&args.metadata.metadata_url))?;
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let mut config = kt_store::Config::new(args.data_dir, args.metadata.metadata_url, server);
    config.advertise_url = args.advertise_url;
    config.chunk_size = args.chunk_size;
    config.reserve = args.reserve;
    kt_store::run(listener, config, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
