//! kt-scenario: brings up a testbed (local processes, network namespaces,
//! later docker and kind/k3d), runs YAML scenarios against it, asserts on
//! insta snapshots and timing budgets, and writes reports.
//!
//! - [`format`]: what a scenario file may say (its actions from one table,
//!   [`format::step`]); [`validate`]: loading and checking files, errors
//!   with file:line:column ([`locate`]).
//! - [`fault`]: the one [`fault::Fault`] type: what the runner's fault
//!   steps and the chaos soak inject into a target.
//! - [`data`]: deterministic data sets and tree digests.
//! - [`target`]: the [`target::Target`] trait and the local and netns targets.
//! - [`runner`]: executes scenarios; [`snapshot`]: insta snapshots with
//!   redactions; [`report`]: terminal table, JSON, JUnit, HTML; [`live`]: the
//!   progress view.
//! - [`chaos`]: the seeded chaos soak (`kt-scenario chaos`).
//! - [`prometheus`]: topology `prometheus` (a real Prometheus scraping the
//!   testbed) and the `promql` step.

pub mod argv;
pub mod chaos;
pub mod data;
pub mod datasets;
pub mod fault;
pub mod format;
pub mod live;
pub mod locate;
pub mod prometheus;
pub mod report;
pub mod runner;
pub mod s3;
pub mod snapshot;
pub mod target;
pub mod template;
pub mod tensor;
pub mod validate;
