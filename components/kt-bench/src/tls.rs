//! A CA and a server certificate for 127.0.0.1, made for one run (`--tls`),
//! in a temporary directory removed with it.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The files of a run's certificates.
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// `ca.crt`, and `server.crt`/`server.key` for 127.0.0.1 signed by it.
    pub fn create() -> anyhow::Result<TestPki> {
        let dir = tempfile::tempdir().context("a directory for the certificates")?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "kt-bench CA");
        let ca_key = rcgen::KeyPair::generate()?;
        let ca = ca.self_signed(&ca_key)?;
        let server = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?;
        let key = rcgen::KeyPair::generate()?;
        let cert = server.signed_by(&key, &ca, &ca_key)?;
        let write = |name: &str, pem: String| {
            std::fs::write(dir.path().join(name), pem).with_context(|| format!("writing {name}"))
        };
        write("ca.crt", ca.pem())?;
        write("server.crt", cert.pem())?;
        write("server.key", key.serialize_pem())?;
        Ok(TestPki { dir })
    }

    /// The CA's certificate (`KT_CA_FILE`).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// The server's certificate and key.
    pub fn server(&self) -> (PathBuf, PathBuf) {
        let d: &Path = self.dir.path();
        (d.join("server.crt"), d.join("server.key"))
    }
}
