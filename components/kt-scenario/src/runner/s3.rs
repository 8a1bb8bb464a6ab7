//! The `s3_put` step (topology `s3`): makes a bucket prefix of the
//! testbed's S3 server hold a data set, moving only what differs
//! ([`crate::s3::sync_plan`]): a signed listing, then concurrent signed
//! uploads and deletes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use md5::Digest as _;
use object_store::ObjectStore;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;

use super::{Scn, StepError, StepResult};
use crate::format::Step;
use crate::s3::{
    ACCESS_KEY_ID, DEFAULT_CONCURRENCY, LocalFile, S3PutStep, SECRET_ACCESS_KEY, object_name,
    sync_plan,
};

/// A signed client of `bucket` with the testbed's credentials.
fn client(endpoint: &str, bucket: &str) -> Result<AmazonS3, StepError> {
    AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_access_key_id(ACCESS_KEY_ID)
        .with_secret_access_key(SECRET_ACCESS_KEY)
        .build()
        .map_err(|e| StepError::Input(format!("an S3 client of bucket {bucket}: {e}")))
}

fn s3_err(what: String) -> impl FnOnce(object_store::Error) -> StepError {
    move |e| StepError::Probe(format!("{what}: {e}"))
}

/// Every regular file below `root`: its path relative to `root` (with
/// `/`), size and MD5.
fn local_files(root: &Path) -> Result<BTreeMap<String, LocalFile>, StepError> {
    let io = |p: &Path, e: std::io::Error| StepError::Input(format!("{}: {e}", p.display()));
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let e = e.map_err(|e| io(&dir, e))?;
            let t = e.file_type().map_err(|x| io(&e.path(), x))?;
            let path = e.path();
            if t.is_dir() {
                stack.push(path);
            } else if t.is_file() {
                let bytes = std::fs::read(&path).map_err(|x| io(&path, x))?;
                let rel = path
                    .strip_prefix(root)
                    .unwrap_or(&path)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("/");
                out.insert(
                    rel,
                    LocalFile {
                        size: bytes.len() as u64,
                        md5: format!("{:x}", md5::Md5::digest(&bytes)),
                    },
                );
            } else {
                return Err(StepError::Input(format!(
                    "{}: only regular files and directories go to S3",
                    path.display()
                )));
            }
        }
    }
    Ok(out)
}

/// The objects below `prefix`: name relative to it → ETag.
async fn listing(store: &AmazonS3, prefix: &str) -> Result<BTreeMap<String, String>, StepError> {
    let at = (!prefix.is_empty()).then(|| ObjectPath::from(prefix.trim_end_matches('/')));
    let metas: Vec<_> = store
        .list(at.as_ref())
        .try_collect()
        .await
        .map_err(s3_err(format!("listing {prefix}")))?;
    Ok(metas
        .into_iter()
        .filter_map(|m| {
            let name = m.location.as_ref().strip_prefix(prefix)?.to_owned();
            Some((name, m.e_tag.unwrap_or_default()))
        })
        .collect())
}

fn object_path(prefix: &str, rel: &str) -> Result<ObjectPath, StepError> {
    let name = object_name(prefix, rel);
    ObjectPath::parse(&name)
        .map_err(|e| StepError::Input(format!("object name {name}: {e}")))
        .and_then(|p| {
            if p.as_ref() == name {
                Ok(p)
            } else {
                Err(StepError::Input(format!(
                    "object name {name} is not one an S3 client sends as is"
                )))
            }
        })
}

impl Scn<'_> {
    /// `s3_put`: lists the prefix, uploads what differs, deletes what the
    /// data set does not have; records the [`crate::s3::SyncPlan`].
    pub(super) async fn s3_put(
        &self,
        step: &Step,
        s: &S3PutStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let outcome = async {
            let endpoint = self.target.s3_endpoint().ok_or_else(|| {
                StepError::Input(format!(
                    "the {} target runs no S3 server for this scenario (topology `s3`)",
                    self.target.name()
                ))
            })?;
            let prefix = self.expand(&s.prefix)?;
            let dir: PathBuf = self
                .data
                .get(&s.data)
                .cloned()
                .ok_or_else(|| StepError::Input(format!("no data set {}", s.data)))?;
            let local = kt_sync::task::spawn(move || local_files(&dir))
                .await
                .map_err(|e| StepError::Digest(format!("hashing task: {}", e.0)))??;
            let store = Arc::new(client(&endpoint, &s.bucket)?);
            let listed = listing(&store, &prefix).await?;
            let plan = sync_plan(&local, &listed);
            let root = self.data[&s.data].clone();
            let concurrency = s.concurrency.unwrap_or(DEFAULT_CONCURRENCY).max(1);
            // Owned items: a stream over borrowed names makes a future that
            // is not `Send` for every lifetime.
            let puts: Vec<(PathBuf, Result<ObjectPath, StepError>)> = (plan.put.iter())
                .map(|rel| (root.join(rel), object_path(&prefix, rel)))
                .collect();
            let deletes: Vec<Result<ObjectPath, StepError>> = (plan.delete.iter())
                .map(|rel| object_path(&prefix, rel))
                .collect();
            futures::stream::iter(puts.into_iter().map(|(file, path)| {
                let store = store.clone();
                async move {
                    let path = path?;
                    let body = tokio::fs::read(&file)
                        .await
                        .map_err(|e| StepError::Input(format!("{}: {e}", file.display())))?;
                    store
                        .put(&path, body.into())
                        .await
                        .map_err(s3_err(format!("putting {path}")))?;
                    Ok::<_, StepError>(())
                }
            }))
            .buffer_unordered(concurrency)
            .try_collect::<()>()
            .await?;
            futures::stream::iter(deletes.into_iter().map(|path| {
                let store = store.clone();
                async move {
                    let path = path?;
                    store
                        .delete(&path)
                        .await
                        .map_err(s3_err(format!("deleting {path}")))
                }
            }))
            .buffer_unordered(concurrency)
            .try_collect::<()>()
            .await?;
            result.record = Some(plan.record());
            Ok(())
        }
        .await;
        self.expect_plain(step, outcome)
    }
}
