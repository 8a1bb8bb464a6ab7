//! A test CA and the server certificates it signs (rcgen), for the tests
//! of kt's TLS: HTTPS (tests/tls.rs) and Arrow Flight (tests/flight.rs).

use std::path::{Path, PathBuf};

/// A CA: its certificate and key.
pub struct Ca {
    pub cert: rcgen::Certificate,
    pub key: rcgen::KeyPair,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca")
    }
}

/// A new CA.
pub fn ca() -> Ca {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "kt test CA");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca { cert, key }
}

/// A server certificate for 127.0.0.1 signed by `ca`, written as
/// `<name>.crt` and `<name>.key`; its DER.
pub fn issue(ca: &Ca, dir: &Path, name: &str) -> (PathBuf, PathBuf, Vec<u8>) {
    let p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.cert, &ca.key).unwrap();
    let (c, k) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k, cert.der().to_vec())
}
