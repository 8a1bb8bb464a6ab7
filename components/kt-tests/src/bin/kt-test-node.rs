//! A separate process for tests that must SIGKILL a participant:
//! `kt-test-node put METADATA_URL KEY SRC` runs one put with the real client.

use kt_client::{Client, ClientConfig, Progress};
use kt_types::Key;
use kt_types::api::PutOptions;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("put") if args.len() == 5 => {
            let mut cfg = ClientConfig::new(&args[2], kt_tests::TOKEN);
            cfg.cache_dir = None;
            cfg.streams = 1;
            let client = Client::new(cfg)?;
            client
                .put(
                    &Key::parse(&args[3])?,
                    std::path::Path::new(&args[4]),
                    PutOptions::default(),
                    Progress::none(),
                )
                .await?;
            Ok(())
        }
        _ => anyhow::bail!("usage: kt-test-node put METADATA_URL KEY SRC"),
    }
}
