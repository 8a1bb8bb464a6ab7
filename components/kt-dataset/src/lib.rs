//! The `Dataset` custom resource and its controller.
//!
//! - [`crd`]: the resource's types (they live in `kt_kube::dataset`, as the
//!   CLI speaks them too); the CRD manifest is generated from them.
//! - [`reconcile`]: one reconcile as a pure function of what was observed
//!   (the Dataset, the nodes and their node-cache agents, the source) to a
//!   plan (actions, the new status, when to look again), tested without I/O.
//! - [`nodes`]: the client of the node-cache agents' dataset API.
//! - [`controller`]: kube-rs's runtime around the reconcile: it gathers the
//!   observed state, carries the plan out, writes the status.
//! - [`metrics`]: the controller's own `/metrics` (bounded labels).
//! - [`ingest`]: putting an object-store (S3-compatible) source into the
//!   store, streamed with bounded memory, resumable and verified.

pub mod controller;
pub use kt_kube::dataset as crd;
pub mod ingest;
pub mod metrics;
pub mod nodes;
pub mod reconcile;

pub use crd::{Dataset, DatasetSpec, DatasetStatus};
