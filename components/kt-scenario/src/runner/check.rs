//! Checking steps: `assert`, `snapshot` and `metrics`, and the digests
//! that verify what pods received.

use std::path::{Path, PathBuf};

use kt_types::{Key, KeyPrefix};

use super::transfer::listing;
use super::{Scn, StepError, StepResult};
use crate::data::{self, Digest};
use crate::format::{MetricsStep, SnapshotStep, Step};

impl Scn<'_> {
    pub(super) async fn assert(&self, a: &crate::format::AssertStep) -> Result<(), StepError> {
        let mut errs = Vec::new();
        if let Some(p) = &a.prefix {
            let keys = self.keys_below(&self.expand(p)?).await?;
            if let Some(n) = a.count
                && keys.len() != n
            {
                errs.push(StepError::Check(format!(
                    "{} keys below `{}`, expected {n}: {keys:?}",
                    keys.len(),
                    self.expand(p)?
                )));
            }
        }
        for (list, want) in [(&a.exists, true), (&a.absent, false)] {
            for k in list {
                let (key, found) = self.key_exists(k).await?;
                if found != want {
                    errs.push(StepError::Check(format!(
                        "key {key} {}",
                        if want { "is missing" } else { "still exists" }
                    )));
                }
            }
        }
        if let Some(f) = &a.files {
            let want = self.digest_of_set(&f.data).await?;
            for p in self.select(&f.pod) {
                let ctx = self.ctx.for_pod(&p.name, p.index);
                let rel = ctx.expand(&f.path)?;
                if let Err(e) = self.target.fetch(&p.name, Path::new(&rel)).await {
                    errs.push(e.into());
                    continue;
                }
                let path = self.target.pod_dir(&p.name).join(rel);
                if let Err(e) = self
                    .verify_tree(&p.name, &path, &[(f.data.clone(), want.clone())])
                    .await
                {
                    errs.push(e);
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(StepError::Several(errs))
        }
    }

    /// `snapshot`: records a listing, or the metadata server's state.
    pub(super) async fn snapshot(&self, s: &SnapshotStep) -> Result<(), StepError> {
        let v = if s.metadata {
            self.metadata_dump().await?
        } else {
            let prefix = KeyPrefix::parse(&self.expand(s.ls.as_deref().unwrap_or(""))?)?;
            let list = self.client()?.ls(&prefix).await?;
            listing(&list.entries)
        };
        if let Ok(mut rec) = self.records.lock() {
            rec.insert(s.name.clone(), v);
        }
        Ok(())
    }

    /// `metrics`: the spread of a metric over a component's instances,
    /// checked against `at_most`.
    pub(super) async fn metrics(
        &self,
        step: &Step,
        m: &MetricsStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let outcome = self.spread(m).await.and_then(|(spread, record)| {
            result.record = Some(record);
            match m.at_most {
                Some(max) if spread.max > max.0 as f64 => Err(StepError::Check(format!(
                    "{} of {}: the largest is {} ({}, > {}); {} instances, median {}, smallest {}",
                    m.name,
                    m.component,
                    spread.max,
                    spread.largest,
                    max.0,
                    spread.count,
                    spread.median,
                    spread.min
                ))),
                _ => Ok(()),
            }
        });
        self.expect_plain(step, outcome)
    }

    pub(super) async fn verify_tree(
        &self,
        pod: &str,
        path: &Path,
        want: &[(String, Digest)],
    ) -> Result<(), StepError> {
        let got = digest_off_runtime(path.to_owned())
            .await
            .map_err(|e| StepError::at(pod, e))?;
        if want.iter().any(|(_, d)| d.hex == got.hex) {
            return Ok(());
        }
        let names: Vec<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
        Err(StepError::Verify {
            pod: pod.to_owned(),
            path: path.to_owned(),
            got: (got.files, got.bytes),
            sets: names.join(" or "),
            want: (want[0].1.files, want[0].1.bytes),
        })
    }

    pub(super) async fn digest_of_set(&self, name: &str) -> Result<Digest, StepError> {
        if let Some(d) = self.digests.lock().ok().and_then(|m| m.get(name).cloned()) {
            return Ok(d);
        }
        let path = self
            .data
            .get(name)
            .ok_or_else(|| StepError::Input(format!("no data set {name}")))?;
        let d = digest_off_runtime(path.clone()).await?;
        if let Ok(mut m) = self.digests.lock() {
            m.insert(name.to_owned(), d.clone());
        }
        Ok(d)
    }

    /// Key `k` (a template), and whether the metadata server has it.
    pub(super) async fn key_exists(&self, k: &str) -> Result<(Key, bool), StepError> {
        let key = Key::parse(&self.expand(k)?)?;
        let exists = match self.client()?.stat(&key).await {
            Ok(_) => true,
            Err(e) if e.code() == Some(kt_types::ErrorCode::NotFound) => false,
            Err(e) => return Err(e.into()),
        };
        Ok((key, exists))
    }

    /// Every key below `prefix`, walking the listing level by level.
    async fn keys_below(&self, prefix: &str) -> Result<Vec<String>, StepError> {
        Ok(self
            .records_below(prefix)
            .await?
            .into_iter()
            .map(|r| r.key.to_string())
            .collect())
    }

    pub(super) async fn records_below(
        &self,
        prefix: &str,
    ) -> Result<Vec<kt_types::KeyRecord>, StepError> {
        let client = self.client()?;
        let mut todo = vec![prefix.to_owned()];
        let mut out = Vec::new();
        while let Some(p) = todo.pop() {
            let prefix = KeyPrefix::parse(&p)?;
            let list = client.ls(&prefix).await?;
            for e in list.entries {
                if let Some(r) = e.record {
                    out.push(r);
                }
                if e.has_children {
                    todo.push(e.key);
                }
            }
        }
        out.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        Ok(out)
    }
}

/// Hashes a tree on a blocking thread, so polls and kills in parallel steps
/// are not held up by it.
async fn digest_off_runtime(path: PathBuf) -> Result<Digest, StepError> {
    kt_sync::task::spawn(move || data::digest(&path).map_err(|e| StepError::Digest(e.to_string())))
        .await
        .map_err(|e| StepError::Digest(format!("digest task: {}", e.0)))?
}
