//! The topology's `s3` on the process targets: moto's S3 server
//! (`kt_dataset::ingest::moto`, a child process on `127.0.0.1:0`) with the
//! topology's buckets created. The Dataset controller runs beside the
//! runner on both process targets (netns too: only the node agents get
//! namespaces of their own), so the loopback endpoint is reachable from it
//! and from the runner's `s3_put` steps.
//!
//! Invariant: the server lives as long as the [`S3Server`] (it is killed
//! when dropped, which `Target::down` does).

use kt_dataset::ingest::moto::{self, Moto};

use super::TargetError;
use crate::s3::S3Spec;

/// A running S3 server holding the topology's buckets.
#[derive(Debug)]
pub struct S3Server {
    moto: Moto,
}

impl S3Server {
    /// Starts moto and creates every bucket of `spec`.
    pub async fn start(spec: &S3Spec) -> Result<S3Server, TargetError> {
        let moto = Moto::start()
            .await
            .map_err(|e| TargetError::Failed(format!("the testbed's S3 server (moto): {e}")))?;
        for b in &spec.buckets {
            moto.create_bucket(b)
                .await
                .map_err(|e| TargetError::Failed(format!("creating bucket {b}: {e}")))?;
        }
        Ok(S3Server { moto })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        self.moto.endpoint().to_owned()
    }
}

/// Why no S3 server can run here (moto's server not installed), if so.
pub fn unavailable() -> Option<String> {
    moto::find()
        .err()
        .map(|e| format!("runs moto's S3 server (topology `s3`), which is not here: {e}"))
}
