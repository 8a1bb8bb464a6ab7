//! An S3 server in the testbed (issue 33): the topology's `s3` and the
//! `s3_put` step that makes a bucket prefix hold a data set (pure; the
//! target's side is `target::s3`, the runner's `runner::s3`).
//!
//! ```yaml
//! topology:
//!   s3: { buckets: [datasets] }    # or `s3: true` (one bucket, `kt`)
//! data:
//!   v1: { seed: 1, files: 10000, dirs: 20, size: { min: 1KiB, max: 8KiB } }
//!   v2: { seed: 2, from: v1, change: 1 }   # one file, new contents
//! steps:
//!   - s3_put: { bucket: datasets, prefix: train/, data: v1 }
//!     record: uploaded             # objects, put, put_bytes, deleted
//!   - dataset: { apply: { name: train, source: { s3: { bucket: datasets,
//!                prefix: train/, endpoint: "{{s3}}",
//!                credentialsSecret: s3-credentials } } } }
//!   - s3_put: { bucket: datasets, prefix: train/, data: v2 }   # moves 1
//! ```
//!
//! `s3_put` is a sync, not a copy: it lists the prefix and puts only the
//! files whose MD5 differs from the object's ETag (a single-part upload's
//! ETag is its MD5) or that are missing, and deletes the objects below the
//! prefix that the data set does not have. So a derived data set (`from`
//! with `change`/`delete`) changes exactly those objects, and the data set
//! is what a reader of the prefix must end up with: `read_dataset`'s
//! `verify` names it.
//!
//! Invariant: after a successful `s3_put`, the objects below the prefix are
//! exactly the data set's files (name = prefix + relative path, contents
//! equal), whatever the prefix held before.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::format::OnOrSpec;

/// The bucket `s3: true` makes.
pub const DEFAULT_BUCKET: &str = "kt";

/// The testbed's S3 credentials (moto accepts any, but refuses anonymous
/// reads of objects a signed request put): `s3_put` signs with them, and
/// with topology `nodes` too the Secret [`CREDENTIALS_SECRET`] of the
/// Datasets' namespace holds them for a Dataset's `credentialsSecret`.
pub const ACCESS_KEY_ID: &str = "kt-testbed";
pub const SECRET_ACCESS_KEY: &str = "kt-testbed-secret";

/// The Secret (in `crate::datasets::DATASET_NAMESPACE`) with the testbed's
/// S3 credentials.
pub const CREDENTIALS_SECRET: &str = "s3-credentials";

/// The Secret [`CREDENTIALS_SECRET`] as the API holds it.
pub fn credentials_secret() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": CREDENTIALS_SECRET, "namespace": crate::datasets::DATASET_NAMESPACE},
        "data": {
            "AWS_ACCESS_KEY_ID": b64(ACCESS_KEY_ID),
            "AWS_SECRET_ACCESS_KEY": b64(SECRET_ACCESS_KEY),
        },
    })
}

fn b64(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// How many uploads (or deletes) `s3_put` has in flight at once.
pub const DEFAULT_CONCURRENCY: usize = 32;

/// The topology's `s3`: `true`, or the buckets to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Spec {
    pub buckets: Vec<String>,
}

impl<'de> Deserialize<'de> for S3Spec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            buckets: Vec<String>,
        }
        Ok(match OnOrSpec::<Full>::deserialize_for(d, "s3")? {
            OnOrSpec::On => S3Spec {
                buckets: vec![DEFAULT_BUCKET.to_owned()],
            },
            OnOrSpec::Spec(f) => S3Spec { buckets: f.buckets },
        })
    }
}

/// Why a bucket name is not one S3 (and moto) accepts: 3–63 characters of
/// lowercase letters, digits, `-` and `.`, starting and ending with a
/// letter or digit.
pub fn bucket_problem(name: &str) -> Option<String> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ends = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !(3..=63).contains(&name.len())
        || !ok_chars
        || !ends(name.bytes().next())
        || !ends(name.bytes().last())
    {
        return Some(format!(
            "bucket `{name}`: 3 to 63 lowercase letters, digits, `-` or `.`, starting and ending with a letter or digit"
        ));
    }
    None
}

/// `s3_put: { bucket, prefix, data }`: makes the objects below `prefix` in
/// `bucket` equal the data set `data` (see the module doc). The step's
/// `record` gets [`SyncPlan::record`] of what it did.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3PutStep {
    pub bucket: String,
    /// Object names are `prefix` + the file's path in the data set
    /// (`train/` + `d0/f00001.bin`); may hold `{{ }}` templates.
    #[serde(default)]
    pub prefix: String,
    /// A tree data set (not a single file).
    pub data: String,
    /// Uploads in flight at once (default [`DEFAULT_CONCURRENCY`]).
    #[serde(default)]
    pub concurrency: Option<usize>,
}

/// An object's ETag as its MD5 in lowercase hex: the quotes S3 puts
/// around it removed; None for a multipart ETag (`<md5>-<parts>`), which
/// is no MD5 of the contents.
pub fn etag_md5(etag: &str) -> Option<String> {
    let t = etag.trim().trim_matches('"').to_ascii_lowercase();
    (t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit())).then_some(t)
}

/// One local file to sync: its size and MD5 (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    pub size: u64,
    pub md5: String,
}

/// What a sync does: names relative to the prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncPlan {
    /// Files to upload (missing, or contents differ), sorted.
    pub put: Vec<String>,
    /// Objects the data set does not have, sorted.
    pub delete: Vec<String>,
    /// Files in the data set.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The bytes of `put`.
    pub put_bytes: u64,
}

impl SyncPlan {
    /// What a snapshot records of a sync.
    pub fn record(&self) -> serde_json::Value {
        serde_json::json!({
            "objects": self.objects,
            "bytes": self.bytes,
            "put": self.put.len(),
            "put_bytes": self.put_bytes,
            "deleted": self.delete.len(),
        })
    }
}

/// The sync of `local` (relative path → file) onto `listed` (relative
/// name → ETag): a file is put unless an object of that name has its MD5
/// as ETag; an object no file names is deleted.
pub fn sync_plan(
    local: &BTreeMap<String, LocalFile>,
    listed: &BTreeMap<String, String>,
) -> SyncPlan {
    let mut plan = SyncPlan::default();
    for (name, f) in local {
        plan.objects += 1;
        plan.bytes += f.size;
        let same = listed
            .get(name)
            .and_then(|e| etag_md5(e))
            .is_some_and(|m| m == f.md5);
        if !same {
            plan.put.push(name.clone());
            plan.put_bytes += f.size;
        }
    }
    plan.delete = listed
        .keys()
        .filter(|n| !local.contains_key(*n))
        .cloned()
        .collect();
    plan
}

/// The object name of relative path `rel` below `prefix`.
pub fn object_name(prefix: &str, rel: &str) -> String {
    format!("{prefix}{rel}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_from_true_or_buckets() {
        let s: S3Spec = serde_yaml_ng::from_str("true").unwrap();
        assert_eq!(s.buckets, vec![DEFAULT_BUCKET.to_owned()]);
        let s: S3Spec = serde_yaml_ng::from_str("{ buckets: [a1b, c2d] }").unwrap();
        assert_eq!(s.buckets, vec!["a1b".to_owned(), "c2d".to_owned()]);
        assert!(serde_yaml_ng::from_str::<S3Spec>("false").is_err());
        assert!(serde_yaml_ng::from_str::<S3Spec>("{ bukets: [a] }").is_err());
    }

    #[test]
    fn the_secret_holds_the_credentials() {
        use base64::Engine as _;
        let s = credentials_secret();
        let key = s["data"]["AWS_ACCESS_KEY_ID"].as_str().unwrap();
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(key)
            .unwrap();
        assert_eq!(decoded, ACCESS_KEY_ID.as_bytes());
        assert_eq!(s["metadata"]["name"], CREDENTIALS_SECRET);
    }

    #[test]
    fn bucket_names() {
        assert!(bucket_problem("datasets").is_none());
        assert!(bucket_problem("my.bucket-2").is_none());
        for bad in [
            "ab",
            "Upper",
            "-dash",
            "dot.",
            "under_score",
            &"x".repeat(64),
        ] {
            assert!(bucket_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn etags() {
        let md5 = "0123456789abcdef0123456789ABCDEF";
        assert_eq!(
            etag_md5(&format!("\"{md5}\"")).as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert_eq!(etag_md5(&format!("\"{md5}-3\"")), None);
        assert_eq!(etag_md5("\"\""), None);
    }

    fn file(size: u64, md5: &str) -> LocalFile {
        LocalFile {
            size,
            md5: md5.to_owned(),
        }
    }

    #[test]
    fn a_sync_moves_only_what_differs() {
        let a = "a".repeat(32);
        let b = "b".repeat(32);
        let local = BTreeMap::from([
            ("same".to_owned(), file(10, &a)),
            ("changed".to_owned(), file(20, &b)),
            ("new".to_owned(), file(30, &a)),
            ("multipart".to_owned(), file(40, &a)),
        ]);
        let listed = BTreeMap::from([
            ("same".to_owned(), format!("\"{a}\"")),
            ("changed".to_owned(), format!("\"{a}\"")),
            ("multipart".to_owned(), format!("\"{a}-2\"")),
            ("gone".to_owned(), format!("\"{a}\"")),
        ]);
        let p = sync_plan(&local, &listed);
        assert_eq!(p.put, vec!["changed", "multipart", "new"]);
        assert_eq!(p.delete, vec!["gone"]);
        assert_eq!((p.objects, p.bytes, p.put_bytes), (4, 100, 90));
        // Into an empty prefix everything goes; onto itself nothing.
        let all = sync_plan(&local, &BTreeMap::new());
        assert_eq!((all.put.len(), all.delete.len()), (4, 0));
        let listed_same: BTreeMap<String, String> = local
            .iter()
            .map(|(n, f)| (n.clone(), format!("\"{}\"", f.md5)))
            .collect();
        let none = sync_plan(&local, &listed_same);
        assert!(none.put.is_empty() && none.delete.is_empty());
        assert_eq!(
            none.record(),
            serde_json::json!({"objects": 4, "bytes": 100, "put": 0, "put_bytes": 0, "deleted": 0})
        );
    }

    fn errors(src: &str) -> Vec<String> {
        match crate::validate::parse(std::path::Path::new("s.yaml"), src) {
            Ok(_) => Vec::new(),
            Err(d) => d.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn s3_steps_are_validated() {
        let good = "topology: { nodes: 2, s3: { buckets: [ds1] }, pods: [ { name: a } ] }\ndata: { t: { files: 1 } }\nsteps:\n  - s3_put: { bucket: ds1, prefix: \"{{scenario}}/\", data: t }\n    record: up\n  - dataset: { apply: { name: d, source: { s3: { bucket: ds1, endpoint: \"{{s3}}\" } } } }\n";
        assert!(errors(good).is_empty(), "{:?}", errors(good));
        let no_s3 = "topology: { pods: [ { name: a } ] }\ndata: { t: { files: 1 } }\nsteps:\n  - s3_put: { bucket: ds1, data: t }\n";
        assert!(
            errors(no_s3)[0].contains("topology `s3`"),
            "{:?}",
            errors(no_s3)
        );
        let bad = "topology: { s3: { buckets: [B_] }, pods: [ { name: a } ] }\ndata: { t: { files: 1 }, f: { file: 1KiB } }\nsteps:\n  - s3_put: { bucket: other, prefix: tr, data: f, concurrency: 0 }\n  - s3_put: { bucket: B_, prefix: /x/, data: nope }\n";
        let e = errors(bad);
        for want in [
            "3 to 63 lowercase",
            "no bucket `other`",
            "a prefix is empty or a folder",
            "single-file data set",
            "concurrency is at least 1",
            "no data set named `nope`",
        ] {
            assert!(e.iter().any(|m| m.contains(want)), "{want}: {e:?}");
        }
        let no_var =
            "topology: { pods: [ { name: a } ] }\nsteps:\n  - ls: { prefix: \"{{s3}}\" }\n";
        assert!(
            errors(no_var)
                .iter()
                .any(|m| m.contains("unknown template variable `s3`")),
            "{:?}",
            errors(no_var)
        );
    }

    #[test]
    fn names_below_the_prefix() {
        assert_eq!(object_name("train/", "d0/f1.bin"), "train/d0/f1.bin");
        assert_eq!(object_name("", "f1.bin"), "f1.bin");
    }
}
