//! A separate process for tests that must SIGKILL a participant:
//! - `kt-test-node put METADATA_URL KEY SRC` runs one put with the real client;
//! - `kt-test-node tensor-hold SOCKET SHM_DIR KEY SEED` registers a state dict
//!   (4 × f32[256, 256], contents from SEED) with the agent at SOCKET, prints
//!   `holding`, and keeps it until killed.

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
        Some("tensor-hold") if args.len() == 6 => {
            use kt_client::tensor::{HostTensor, StateDict, TensorClient, TensorOptions, layout};
            let shm = std::path::Path::new(&args[3]);
            let seed: u64 = args[5].parse()?;
            let mut sd = StateDict::new();
            for i in 0..4 {
                let name = format!("w.{i}");
                let mut t = HostTensor::zeros_in(shm, kt_types::tensor::DType::F32, &[256, 256])?;
                layout::fill(seed, &name, t.bytes_mut());
                sd.push(name, t);
            }
            let mut kt =
                TensorClient::connect(std::path::Path::new(&args[2]), "http://unused", "unused")
                    .await?;
            kt.put_state_dict(&Key::parse(&args[4])?, &sd, &TensorOptions::default())
                .await?;
            println!("holding");
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
            }
        }
        _ => anyhow::bail!(
            "usage: kt-test-node put METADATA_URL KEY SRC | tensor-hold SOCKET SHM_DIR KEY SEED"
        ),
    }
}
