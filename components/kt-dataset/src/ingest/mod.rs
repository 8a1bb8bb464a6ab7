//! Putting an S3 or PVC source into the store.
//!
//! - [`plan`]: the pure core of an S3 ingest (listing + previous record →
//!   what to fetch, keep and remove), tested without I/O;
//! - [`s3`]: the ingest itself (object_store, staging, the put);
//! - [`moto`]: an S3-compatible server for tests and the bench (moto's
//!   server mode, started as a child process).

pub mod moto;
pub mod plan;
pub mod s3;

pub use s3::{
    IngestError, IngestEvent, IngestReport, OnProgress, S3Config, S3Credentials, download, ingest,
};
