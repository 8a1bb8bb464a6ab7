//! The kt client: put/get/ls/rm against a metadata server and the store it names.
//!
//! Invariant: the client depends on the wire types, the sync engine and the
//! shared service plumbing (its broadcast relay is a small read server), never
//! on a server crate.

pub mod agent;
pub mod api;
pub mod arriving;
pub mod broadcast;
#[cfg(feature = "kube")]
pub mod datasets;
pub mod deadline;
mod download;
pub mod error;
#[cfg(feature = "kube")]
pub mod external;
mod local;
pub mod progress;
pub mod relay;
mod retry;
pub mod size;
mod stall;
pub mod status;
pub mod stream;
pub mod tensor;
pub mod trace;
pub mod transfer;

pub use api::{Client, ClientConfig, UrlMap};
pub use arriving::{Arrived, Arriving};
pub use deadline::Phase;
pub use error::ClientError;
pub use progress::Progress;
pub use stall::bytes_received;
pub use transfer::{GetOptions, GetSummary, PrefixSummary, PutSummary};
