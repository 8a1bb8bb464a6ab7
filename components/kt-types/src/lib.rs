//! Wire types shared by every kt component.
//!
//! Invariant: this crate performs no I/O and depends on no runtime. It holds the
//! vocabulary (keys, manifests, API bodies, error codes, env var names) that
//! servers and clients agree on, plus pure validation of that vocabulary.

#![deny(missing_docs)]

pub mod agent;
pub mod api;
pub mod auth;
pub mod broadcast;
pub mod codec;
pub mod dataset;
pub mod env;
pub mod error;
pub mod frame;
pub mod key;
pub mod manifest;
pub mod model;
pub mod paths;
pub mod shard;
pub mod size;
pub mod stats;
pub mod status;
pub mod tensor;

pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use key::{Key, KeyError, KeyPrefix};
pub use manifest::{Entry, EntryKind, Hash, Manifest, ManifestError, RootKind};
pub use model::{
    BroadcastWindow, KeyRecord, Lifespan, Locale, STORE_HOLDER, Source, agent_id_problem,
};
