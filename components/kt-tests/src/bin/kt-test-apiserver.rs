//! `kt-test-apiserver KUBECONFIG`: the in-memory Kubernetes API server
//! ([`kt_kube::apiserver`]) serving the `Dataset` resource, for tests in
//! other languages (the Python package's `kt.datasets`). Writes a
//! kubeconfig for it to KUBECONFIG, prints `ready <url>`, and serves until
//! its standard input closes.

use std::io::Read;

use kt_kube::apiserver::{ApiServer, ApiServerConfig};
use kt_kube::dataset::Dataset;
use kt_kube::kube::core::ApiResource;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: kt-test-apiserver KUBECONFIG"))?;
    // The server runs on the runtime's workers while this thread waits on
    // standard input.
    let rt = tokio::runtime::Runtime::new()?;
    let server = rt.block_on(ApiServer::start(ApiServerConfig::default()))?;
    server.register_crd(&ApiResource::erase::<Dataset>(&()), true);
    server.kubeconfig(std::path::Path::new(&path))?;
    println!("ready {}", server.url());
    let mut sink = Vec::new();
    std::io::stdin().read_to_end(&mut sink)?;
    drop(server);
    Ok(())
}
