//! GPU data transport for the node agent (and the memory helpers clients use).
//!
//! - [`transport`]: the [`Backend`] trait (map lent memory, allocate staging
//!   buffers, copy, connect the ranks of a plan) and the [`Comm`] trait (one
//!   collective: a broadcast within a subset of ranks);
//! - [`host`]: the host backend, CPU tensors in shared memory moved over TCP
//!   between agents (a tree per broadcast, cut-through);
//! - [`shm`]: shared-memory files: created by applications, mapped by agents;
//! - [`pack`]: bucket plans for `pack` (one dtype per buffer, bounded size);
//! - [`engine`]: runs this rank's part of a [`kt_types::tensor::TransferPlan`].
//!
//! Everything here is blocking: a transfer runs on its own thread (the
//! agent uses `spawn_blocking`), which is how NCCL wants to be driven too.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod hold;
pub mod host;
pub mod pack;
pub mod reduce;
pub mod shm;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
pub mod transport;

pub use engine::{Lent, Link, run, transfer, transfer_on};
pub use host::HostBackend;
pub use transport::{Backend, Comm, Endpoint, Region, TransportError};
