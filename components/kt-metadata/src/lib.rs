//! The kt metadata server: the key registry of one namespace.
//!
//! [`registry`] is the pure state machine of keys, node agents and peers
//! (listing, TTLs, heartbeat reconciliation, eviction, source candidates,
//! teardown); [`leases`] the pure state machine of source leases (least-loaded
//! choice, expiry); [`db`] persists keys and agents in redb; [`server`] is the
//! HTTP API around them.
//!
//! Invariant: a mutation is committed to the database before it is answered,
//! so a restart loses nothing that a client was told happened.

pub mod db;
pub mod leases;
pub mod registry;
pub mod server;

pub use server::{Config, MetadataError, run};
