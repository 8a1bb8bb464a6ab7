//! The kt node agent: one per pod (a sidecar, or started on demand by `kt`).
//!
//! - [`exports`]: what the agent serves — `locale=local` puts (the user's own
//!   files, zero copy) and downloaded copies — persisted in its state
//!   directory and served read-only through [`kt_service::reads`];
//! - [`control`]: the local control socket ([`kt_types::agent`]): hello,
//!   export a local path, export a downloaded copy, status;
//! - [`metadata`]: the metadata server's client (registration of local
//!   puts, key lookups, quorums, heartbeats);
//! - [`heartbeat`]: the heartbeat loop that announces every export and
//!   drops what the metadata server says is gone;
//! - [`tensors`]: GPU data — tensor registrations by process, point-to-point
//!   sessions between agents, quorum transfers (host or NCCL backend);
//! - [`exportable`]: which paths may be exported (below the export roots,
//!   never the system's places nor the agent's own state);
//! - [`datasets`]: node-cache mode (`--node-cache`): datasets held for the
//!   node under a hostPath root, within a byte budget, seeded by the
//!   `Dataset` controller through [`kt_types::dataset`]'s API;
//! - [`metrics`]: the gauges read at each scrape (exports, tensor sets,
//!   read leases, heartbeats);
//! - [`config`]: configuration and its defaults (socket, state dir, id, URL).
//! - `flight` (cargo feature `flight`, `--flight-addr`): Arrow Flight
//!   `DoGet` of a rank's share of the Parquet / Arrow IPC files below a
//!   prefix, read with the caller's token, as record batches.
//!
//! Start one in-process with [`start`] (or [`run`]) on a bound listener.
//!
//! Invariants: the HTTP API is the read half of the sync protocol and nothing
//! else; it serves the file entries of exported manifests only, never through
//! a symlink and never outside an export's path. The agent never writes to,
//! or deletes, exported files. A local export is served from the user's files
//! as they are: if they change after the export, getters are refused them
//! (a changed size is a conflict, changed content fails their blake3 checks)
//! and fail over to another source (export again to publish the change).
//! The state directory is the agent's alone (0700, its files 0600), made
//! safe before anything is written in it.

pub mod config;
pub mod control;
pub mod datasets;
pub mod exportable;
pub mod exports;
#[cfg(feature = "flight")]
pub mod flight;
pub mod heartbeat;
pub mod metadata;
pub mod metrics;
mod server;
pub mod tensors;

pub use config::Config;
pub use server::{AgentError, AgentHandle, run, start};
