//! The kt metadata server: the key registry of one namespace.
//!
//! [`registry`] is the pure state machine of keys, node agents and peers
//! (listing, TTLs, heartbeat reconciliation, eviction, source candidates,
//! teardown); [`leases`] the pure state machine of source leases (least-loaded
//! choice, expiry); [`broadcast`] the pure state machine of broadcast groups
//! (the tree of getters of one key, parents, replacements, releases, rank
//! reservations); [`quorum`] the quorums of GPU broadcasts (in memory: who
//! takes part, the transfer plan, rendezvous and completion); [`db`]
//! persists keys, agents and broadcast groups in redb;
//! [`server`] is the HTTP API around them (and the WebSocket of broadcast
//! members); `cluster` (feature `kube`) applies the namespace watch's
//! decisions (evictions, teardowns) through a [`Handle`]; `kube_auth`
//! (feature `kube`) reviews ServiceAccount tokens (`--kube-auth`);
//! `webhook` (feature `kube`) is the sidecar injector, an admission webhook
//! on a listener of its own (`--webhook-listen`) that gives labelled pods
//! the kt agent (the injection is `kt_kube::inject`, pure).
//!
//! Invariant: a mutation is committed to the database before it is answered,
//! so a restart loses nothing that a client was told happened. Quorums are
//! the exception, by design: they are not persisted, and a restart fails the
//! open ones (their members report an error and may join again).

pub mod broadcast;
#[cfg(feature = "kube")]
pub mod cluster;
pub mod db;
#[cfg(feature = "kube")]
pub mod kube_auth;
pub mod leases;
pub mod quorum;
pub mod registry;
pub mod server;
#[cfg(feature = "kube")]
pub mod webhook;

pub use server::{Config, Handle, MetadataError, run, run_with};
