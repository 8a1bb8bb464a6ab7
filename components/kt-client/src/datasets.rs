//! `kt dataset` and `kt.datasets`: `Dataset` resources (`datasets.kt.dev`)
//! through the Kubernetes API server — applied, read, listed, deleted and
//! waited for. The controller (`kt-dataset-controller`) does the rest; this
//! module only speaks to the API server (a kubeconfig, or the pod's own
//! ServiceAccount in a cluster).
//!
//! Applies are server-side applies with field manager [`FIELD_MANAGER`], so
//! what `kubectl apply` and `kt dataset apply` set merge as in any cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kt_kube::dataset::{
    Dataset, DatasetSpec, Phase, Placement, PvcSource, ReclaimPolicy, Refresh, S3Source, Source,
};
use kt_kube::kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kt_kube::kube::runtime::watcher;
use kt_kube::portforward::{self, ForwardError, KubeOptions};

pub use kt_kube::kube::Error as KubeError;

/// The field manager of `kt dataset apply`.
pub const FIELD_MANAGER: &str = "kt";

/// Why a Dataset call failed.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The kubeconfig or the cluster could not be reached.
    #[error(transparent)]
    Connect(#[from] ForwardError),
    /// The API server refused or failed a call.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kt_kube::kube::Error,
    },
    /// No such Dataset.
    #[error("dataset {0:?} not found in namespace {1:?}")]
    NotFound(String, String),
    /// A manifest or a flag is not a valid Dataset.
    #[error("{0}")]
    Invalid(String),
    /// The Dataset ended `Failed`.
    #[error("dataset {name:?} failed: {reason}")]
    Failed { name: String, reason: String },
    /// It did not reach the phase in time.
    #[error("dataset {name:?} is {phase:?} ({reason}) after {after:?}, not {want:?}")]
    Timeout {
        name: String,
        phase: Phase,
        reason: String,
        want: Phase,
        after: Duration,
    },
}

impl DatasetError {
    fn api(what: impl Into<String>) -> impl FnOnce(kt_kube::kube::Error) -> DatasetError {
        let what = what.into();
        move |source| DatasetError::Api { what, source }
    }
}

/// The Datasets of one namespace.
#[derive(Clone)]
pub struct Datasets {
    api: Api<Dataset>,
    namespace: String,
}

impl std::fmt::Debug for Datasets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datasets")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Datasets {
    /// Connects with `opts` (a kubeconfig and context, or in-cluster).
    pub async fn connect(opts: &KubeOptions) -> Result<Self, DatasetError> {
        let (client, namespace) = portforward::connect(opts).await?;
        Ok(Self::new(client, &namespace))
    }

    /// The Datasets of `namespace` through `client`.
    pub fn new(client: kt_kube::kube::Client, namespace: &str) -> Self {
        Datasets {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
        }
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Creates or updates `ds` (server-side apply, forced: `kt` takes over
    /// the fields it sets).
    pub async fn apply(&self, ds: &Dataset) -> Result<Dataset, DatasetError> {
        let name = ds
            .metadata
            .name
            .clone()
            .ok_or_else(|| DatasetError::Invalid("a Dataset needs metadata.name".into()))?;
        if let Some(ns) = &ds.metadata.namespace
            && ns != &self.namespace
        {
            return Err(DatasetError::Invalid(format!(
                "dataset {name:?} names namespace {ns:?}, not {:?}",
                self.namespace
            )));
        }
        let mut body = serde_json::to_value(ds)
            .map_err(|e| DatasetError::Invalid(format!("dataset {name:?}: {e}")))?;
        if let Some(obj) = body.as_object_mut() {
            // Status is the controller's; an apply never carries it.
            obj.remove("status");
        }
        let params = PatchParams::apply(FIELD_MANAGER).force();
        self.api
            .patch(&name, &params, &Patch::Apply(&body))
            .await
            .map_err(DatasetError::api(format!("apply dataset {name:?}")))
    }

    /// The Dataset `name`.
    pub async fn get(&self, name: &str) -> Result<Dataset, DatasetError> {
        self.api
            .get_opt(name)
            .await
            .map_err(DatasetError::api(format!("get dataset {name:?}")))?
            .ok_or_else(|| DatasetError::NotFound(name.to_owned(), self.namespace.clone()))
    }

    /// Every Dataset of the namespace, by name.
    pub async fn list(&self) -> Result<Vec<Dataset>, DatasetError> {
        let mut items = self
            .api
            .list(&ListParams::default())
            .await
            .map_err(DatasetError::api("list datasets"))?
            .items;
        items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(items)
    }

    /// Asks for `name`'s deletion (the controller then removes its node
    /// copies and labels, and its finalizer). `false`: there was none.
    pub async fn delete(&self, name: &str) -> Result<bool, DatasetError> {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(true),
            Err(kt_kube::kube::Error::Api(s)) if s.code == 404 => Ok(false),
            Err(e) => Err(DatasetError::api(format!("delete dataset {name:?}"))(e)),
        }
    }

    /// Waits until `name` is in phase `want` (for its current generation),
    /// at most `timeout`. A Dataset that ends `Failed` (when `Failed` is
    /// not what is waited for) is an error at once, with its reason.
    pub async fn wait(
        &self,
        name: &str,
        want: Phase,
        timeout: Duration,
    ) -> Result<Dataset, DatasetError> {
        let started = std::time::Instant::now();
        // A name that is not there is an error now, not after the timeout.
        let mut last: Option<Dataset> = Some(self.get(name).await?);
        let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = watcher::watcher(self.api.clone(), cfg)
            .map_err(|e| DatasetError::Invalid(format!("watch dataset {name:?}: {e}")))
            .boxed();
        let waited = tokio::time::timeout(timeout, async {
            while let Some(event) = events.try_next().await? {
                let ds = match event {
                    watcher::Event::Apply(ds) | watcher::Event::InitApply(ds) => ds,
                    watcher::Event::Delete(_) => {
                        return Err(DatasetError::NotFound(
                            name.to_owned(),
                            self.namespace.clone(),
                        ));
                    }
                    watcher::Event::Init | watcher::Event::InitDone => continue,
                };
                match settled(&ds, want) {
                    Settled::Yes => return Ok(ds),
                    Settled::Failed(reason) => {
                        return Err(DatasetError::Failed {
                            name: name.to_owned(),
                            reason,
                        });
                    }
                    Settled::No => last = Some(ds),
                }
            }
            Err(DatasetError::Invalid(format!(
                "watch of dataset {name:?} ended"
            )))
        })
        .await;
        match waited {
            Ok(result) => result,
            Err(_) => {
                let (phase, reason) = last
                    .as_ref()
                    .and_then(|d| d.status.as_ref())
                    .map(|s| (s.phase, s.reason.clone().unwrap_or_default()))
                    .unwrap_or((Phase::Pending, "no status yet".into()));
                Err(DatasetError::Timeout {
                    name: name.to_owned(),
                    phase,
                    reason,
                    want,
                    after: started.elapsed(),
                })
            }
        }
    }
}

/// Whether a Dataset has reached the phase waited for.
#[derive(Debug, PartialEq)]
enum Settled {
    Yes,
    No,
    Failed(String),
}

fn settled(ds: &Dataset, want: Phase) -> Settled {
    let Some(status) = &ds.status else {
        return Settled::No;
    };
    // A status about an older spec says nothing about this one.
    let current = match (status.observed_generation, ds.metadata.generation) {
        (Some(seen), Some(generation)) => seen >= generation,
        (None, Some(_)) => false,
        _ => true,
    };
    if !current {
        return Settled::No;
    }
    if status.phase == want {
        return Settled::Yes;
    }
    if status.phase == Phase::Failed {
        return Settled::Failed(
            status
                .reason
                .clone()
                .unwrap_or_else(|| "no reason given".into()),
        );
    }
    Settled::No
}

/// A Dataset spec from the flags of `kt dataset apply NAME ...` and the
/// arguments of `kt.datasets.apply` (their field names).
#[derive(Debug, Clone, Default, serde::Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct SpecArgs {
    /// Source: a kt key (its latest version, or --version).
    #[arg(long)]
    pub key: Option<String>,
    /// Source: every object of s3://BUCKET[/PREFIX].
    #[arg(long)]
    pub s3: Option<String>,
    /// The S3 endpoint (default: AWS's).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// The S3 region.
    #[arg(long)]
    pub region: Option<String>,
    /// A Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
    #[arg(long)]
    pub credentials_secret: Option<String>,
    /// Source: a PersistentVolumeClaim, CLAIM[:PATH].
    #[arg(long)]
    pub pvc: Option<String>,
    /// How many nodes hold a copy.
    #[arg(long)]
    pub replicas: Option<u32>,
    /// Only nodes with this label (LABEL=VALUE; repeat for more).
    #[arg(long = "node-selector")]
    pub node_selector: Vec<String>,
    /// The path on the nodes (default /var/lib/kt/datasets/NAMESPACE/NAME).
    #[arg(long)]
    pub path: Option<String>,
    /// Pin this version of the key.
    #[arg(long)]
    pub version: Option<String>,
    /// Look for a newer version this often (e.g. 10m).
    #[arg(long)]
    pub interval: Option<String>,
    /// Keep node copies when they are no longer placed (until the node
    /// needs the space).
    #[arg(long)]
    pub retain: bool,
}

impl SpecArgs {
    /// Whether any source or placement flag is set (they do not mix with
    /// manifests).
    pub fn any(&self) -> bool {
        self.key.is_some()
            || self.s3.is_some()
            || self.pvc.is_some()
            || self.replicas.is_some()
            || !self.node_selector.is_empty()
            || self.path.is_some()
    }
}

impl SpecArgs {
    /// The spec, or why these arguments make none.
    pub fn spec(&self) -> Result<DatasetSpec, DatasetError> {
        let invalid = |m: String| DatasetError::Invalid(m);
        let source = match (&self.key, &self.s3, &self.pvc) {
            (Some(key), None, None) => {
                kt_types::Key::parse(key).map_err(|e| invalid(format!("key {key:?}: {e}")))?;
                Source::Key(key.clone())
            }
            (None, Some(url), None) => {
                let rest = url.strip_prefix("s3://").ok_or_else(|| {
                    invalid(format!("{url:?}: an S3 source is s3://BUCKET[/PREFIX]"))
                })?;
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(invalid(format!("{url:?} names no bucket")));
                }
                Source::S3(S3Source {
                    bucket: bucket.to_owned(),
                    prefix: prefix.to_owned(),
                    endpoint: self.endpoint.clone(),
                    region: self.region.clone(),
                    credentials_secret: self.credentials_secret.clone(),
                })
            }
            (None, None, Some(pvc)) => {
                let (claim, path) = match pvc.split_once(':') {
                    Some((c, p)) => (c, Some(p.to_owned())),
                    None => (pvc.as_str(), None),
                };
                if claim.is_empty() {
                    return Err(invalid(format!("{pvc:?} names no claim")));
                }
                Source::Pvc(PvcSource {
                    claim_name: claim.to_owned(),
                    path,
                })
            }
            (None, None, None) => {
                return Err(invalid(
                    "a dataset needs a source: --key, --s3 or --pvc".into(),
                ));
            }
            _ => {
                return Err(invalid(
                    "a dataset has one source: give one of --key, --s3, --pvc".into(),
                ));
            }
        };
        if source_is_not_s3(&source)
            && (self.endpoint.is_some()
                || self.region.is_some()
                || self.credentials_secret.is_some())
        {
            return Err(invalid(
                "--endpoint, --region and --credentials-secret are for --s3 sources".into(),
            ));
        }
        if self.replicas == Some(0) {
            return Err(invalid("--replicas must be at least 1".into()));
        }
        let mut node_selector = BTreeMap::new();
        for pair in &self.node_selector {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| invalid(format!("node selector {pair:?} is not LABEL=VALUE")))?;
            if k.is_empty() {
                return Err(invalid(format!("node selector {pair:?} names no label")));
            }
            node_selector.insert(k.to_owned(), v.to_owned());
        }
        if let Some(interval) = &self.interval {
            humantime::parse_duration(interval)
                .map_err(|e| invalid(format!("interval {interval:?}: {e}")))?;
        }
        Ok(DatasetSpec {
            source,
            placement: Placement {
                replicas: self.replicas,
                node_selector,
                match_expressions: Vec::new(),
            },
            path: self.path.clone(),
            refresh: Refresh {
                version: self.version.clone(),
                interval: self.interval.clone(),
            },
            reclaim_policy: if self.retain {
                ReclaimPolicy::Retain
            } else {
                ReclaimPolicy::Delete
            },
        })
    }
}

fn source_is_not_s3(source: &Source) -> bool {
    !matches!(source, Source::S3(_))
}

/// A Dataset named `name` with `spec`.
pub fn dataset(name: &str, spec: DatasetSpec) -> Dataset {
    Dataset::new(name, spec)
}

/// The Datasets of a YAML stream (`---`-separated documents; empty ones
/// skipped), each checked to be a `kt.dev/v1alpha1` `Dataset` with a name.
pub fn parse_manifests(yaml: &str) -> Result<Vec<Dataset>, DatasetError> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(yaml).enumerate() {
        let value = serde_json::Value::deserialize(doc)
            .map_err(|e| DatasetError::Invalid(format!("document {}: {e}", i + 1)))?;
        if value.is_null() {
            continue;
        }
        let api_version = value.get("apiVersion").and_then(|v| v.as_str());
        let kind = value.get("kind").and_then(|v| v.as_str());
        if api_version != Some("kt.dev/v1alpha1") || kind != Some("Dataset") {
            return Err(DatasetError::Invalid(format!(
                "document {}: apiVersion {api_version:?} kind {kind:?} is not a kt.dev/v1alpha1 Dataset",
                i + 1
            )));
        }
        let ds: Dataset = serde_json::from_value(value)
            .map_err(|e| DatasetError::Invalid(format!("document {}: {e}", i + 1)))?;
        if ds.metadata.name.as_deref().unwrap_or("").is_empty() {
            return Err(DatasetError::Invalid(format!(
                "document {}: a Dataset needs metadata.name",
                i + 1
            )));
        }
        out.push(ds);
    }
    if out.is_empty() {
        return Err(DatasetError::Invalid("no Dataset in the input".into()));
    }
    Ok(out)
}

/// One row of `kt dataset ls`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Row {
    pub name: String,
    pub phase: String,
    pub version: String,
    pub ready: String,
    pub bytes: Option<u64>,
    pub reason: String,
}

/// The rows of `kt dataset ls` (pure).
pub fn rows(datasets: &[Dataset]) -> Vec<Row> {
    datasets
        .iter()
        .map(|ds| {
            let st = ds.status.clone().unwrap_or_default();
            Row {
                name: ds.metadata.name.clone().unwrap_or_default(),
                phase: format!("{:?}", st.phase),
                version: st.version.unwrap_or_else(|| "-".into()),
                ready: format!("{}/{}", st.ready_nodes, ds.spec.placement.replicas()),
                bytes: st.bytes,
                reason: st.reason.unwrap_or_default(),
            }
        })
        .collect()
}

/// Waits until `name` is gone (its node copies and labels removed), at
/// most `timeout`.
pub async fn wait_deleted(
    datasets: &Datasets,
    name: &str,
    timeout: Duration,
) -> Result<(), DatasetError> {
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(datasets.api.clone(), cfg).boxed();
    let gone = tokio::time::timeout(timeout, async {
        let mut seen = false;
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Delete(_)) => return Ok(()),
                Ok(watcher::Event::InitApply(_)) => seen = true,
                Ok(watcher::Event::InitDone) if !seen => return Ok(()),
                Ok(_) => {}
                Err(e) => {
                    return Err(DatasetError::Invalid(format!(
                        "watch dataset {name:?}: {e}"
                    )));
                }
            }
        }
        Ok(())
    })
    .await;
    match gone {
        Ok(r) => r,
        Err(_) => {
            let ds = datasets.get(name).await;
            let (phase, reason) = match &ds {
                Ok(d) => d
                    .status
                    .as_ref()
                    .map(|s| (s.phase, s.reason.clone().unwrap_or_default()))
                    .unwrap_or((Phase::Pending, String::new())),
                Err(DatasetError::NotFound(..)) => return Ok(()),
                Err(_) => (Phase::Pending, String::new()),
            };
            Err(DatasetError::Invalid(format!(
                "dataset {name:?} is still there after {timeout:?} ({phase:?}{}): its node copies are being removed",
                if reason.is_empty() {
                    String::new()
                } else {
                    format!(", {reason}")
                }
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_kube::dataset::DatasetStatus;

    #[test]
    fn flags_make_a_spec() {
        let spec = SpecArgs {
            key: Some("team/imagenet".into()),
            replicas: Some(8),
            node_selector: vec!["gpu=a100".into()],
            interval: Some("10m".into()),
            ..Default::default()
        }
        .spec()
        .unwrap();
        assert_eq!(spec.source, Source::Key("team/imagenet".into()));
        assert_eq!(spec.placement.replicas(), 8);
        assert_eq!(spec.placement.node_selector["gpu"], "a100");
        let s3 = SpecArgs {
            s3: Some("s3://bucket/train/".into()),
            endpoint: Some("http://minio:9000".into()),
            ..Default::default()
        }
        .spec()
        .unwrap();
        assert!(
            matches!(s3.source, Source::S3(ref s) if s.bucket == "bucket" && s.prefix == "train/")
        );
        let pvc = SpecArgs {
            pvc: Some("claim:data/x".into()),
            retain: true,
            ..Default::default()
        }
        .spec()
        .unwrap();
        assert!(matches!(pvc.source, Source::Pvc(ref p) if p.path.as_deref() == Some("data/x")));
        assert_eq!(pvc.reclaim_policy, ReclaimPolicy::Retain);
    }

    #[test]
    fn bad_flags_say_why() {
        let cases = [
            (SpecArgs::default(), "needs a source"),
            (
                SpecArgs {
                    key: Some("a/b".into()),
                    s3: Some("s3://b".into()),
                    ..Default::default()
                },
                "one source",
            ),
            (
                SpecArgs {
                    s3: Some("bucket/x".into()),
                    ..Default::default()
                },
                "s3://BUCKET",
            ),
            (
                SpecArgs {
                    key: Some("../x".into()),
                    ..Default::default()
                },
                "key",
            ),
            (
                SpecArgs {
                    key: Some("a/b".into()),
                    replicas: Some(0),
                    ..Default::default()
                },
                "at least 1",
            ),
            (
                SpecArgs {
                    key: Some("a/b".into()),
                    node_selector: vec!["nolabel".into()],
                    ..Default::default()
                },
                "LABEL=VALUE",
            ),
            (
                SpecArgs {
                    key: Some("a/b".into()),
                    endpoint: Some("http://x".into()),
                    ..Default::default()
                },
                "for --s3",
            ),
            (
                SpecArgs {
                    key: Some("a/b".into()),
                    interval: Some("soon".into()),
                    ..Default::default()
                },
                "interval",
            ),
        ];
        for (args, want) in cases {
            let err = args.spec().unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }

    #[test]
    fn manifests_are_checked() {
        let two = parse_manifests(
            "apiVersion: kt.dev/v1alpha1\nkind: Dataset\nmetadata: {name: a}\nspec: {source: {key: t/a}}\n---\n---\napiVersion: kt.dev/v1alpha1\nkind: Dataset\nmetadata: {name: b}\nspec: {source: {key: t/b}, placement: {replicas: 3}}\n",
        )
        .unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[1].spec.placement.replicas(), 3);
        for (bad, want) in [
            (
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n",
                "not a kt.dev/v1alpha1 Dataset",
            ),
            (
                "apiVersion: kt.dev/v1alpha1\nkind: Dataset\nmetadata: {}\nspec: {source: {key: t/a}}\n",
                "metadata.name",
            ),
            (
                "apiVersion: kt.dev/v1alpha1\nkind: Dataset\nmetadata: {name: a}\nspec: {}\n",
                "document 1",
            ),
            ("", "no Dataset"),
        ] {
            let err = parse_manifests(bad).unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }

    #[test]
    fn a_status_of_an_older_generation_does_not_settle() {
        let mut ds = dataset(
            "a",
            SpecArgs {
                key: Some("t/a".into()),
                ..Default::default()
            }
            .spec()
            .unwrap(),
        );
        ds.metadata.generation = Some(2);
        assert_eq!(settled(&ds, Phase::Ready), Settled::No);
        ds.status = Some(DatasetStatus {
            phase: Phase::Ready,
            observed_generation: Some(1),
            ..Default::default()
        });
        assert_eq!(settled(&ds, Phase::Ready), Settled::No);
        ds.status.as_mut().unwrap().observed_generation = Some(2);
        assert_eq!(settled(&ds, Phase::Ready), Settled::Yes);
        let st = ds.status.as_mut().unwrap();
        st.phase = Phase::Failed;
        st.reason = Some("KeyNotFound".into());
        assert_eq!(
            settled(&ds, Phase::Ready),
            Settled::Failed("KeyNotFound".into())
        );
        assert_eq!(settled(&ds, Phase::Failed), Settled::Yes);
    }

    #[test]
    fn rows_show_ready_over_wanted() {
        let mut ds = dataset(
            "a",
            SpecArgs {
                key: Some("t/a".into()),
                replicas: Some(8),
                ..Default::default()
            }
            .spec()
            .unwrap(),
        );
        ds.status = Some(DatasetStatus {
            phase: Phase::Seeding,
            ready_nodes: 3,
            version: Some("v1".into()),
            ..Default::default()
        });
        let r = &rows(&[ds])[0];
        assert_eq!(
            (r.phase.as_str(), r.ready.as_str(), r.version.as_str()),
            ("Seeding", "3/8", "v1")
        );
    }
}
