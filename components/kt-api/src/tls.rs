//! https between kt's processes: the CAs a kt client trusts are those of
//! the PEM bundle `KT_CA_FILE` names, and only those (kt's certificates
//! come from the cluster's own CA, never a public one). Without it, https
//! URLs fail with an unknown issuer; http URLs work as ever.

use std::sync::Arc;

/// The variable naming the CA bundle.
pub use kt_types::env::CA_FILE;

/// Why the CA bundle cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{CA_FILE}={path}: {why}")]
pub struct CaError {
    pub path: String,
    pub why: String,
}

/// The certificates of `KT_CA_FILE`, if it is set (DER).
fn bundle() -> Result<Option<(String, Vec<u8>)>, CaError> {
    let Some(path) = std::env::var_os(CA_FILE).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let shown = path.to_string_lossy().into_owned();
    let pem = std::fs::read(&path).map_err(|e| CaError {
        path: shown.clone(),
        why: e.to_string(),
    })?;
    Ok(Some((shown, pem)))
}

/// A `reqwest` client builder trusting `KT_CA_FILE`'s CAs (every kt client
/// starts from this one), with [`crate::client_builder`]'s defaults. No
/// built-in roots: a reqwest feature some other crate of the build turns on
/// (`rustls-tls-native-roots`, through object_store) would otherwise add the
/// system's store (and `SSL_CERT_FILE`'s) to them.
pub fn http_builder() -> Result<reqwest::ClientBuilder, CaError> {
    let mut b = crate::client_builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false);
    if let Some((path, pem)) = bundle()? {
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| CaError {
            path: path.clone(),
            why: e.to_string(),
        })?;
        if certs.is_empty() {
            return Err(CaError {
                path,
                why: "no PEM certificate in it".into(),
            });
        }
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    Ok(b)
}

/// A rustls client configuration trusting `KT_CA_FILE`'s CAs (WebSockets
/// to `wss://` URLs); `None` without it.
pub fn rustls_client() -> Result<Option<Arc<rustls::ClientConfig>>, CaError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let Some((path, pem)) = bundle()? else {
        return Ok(None);
    };
    let bad = |why: String| CaError {
        path: path.clone(),
        why,
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        let c = c.map_err(|e| bad(e.to_string()))?;
        roots.add(c).map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Some(Arc::new(config)))
}
