//! The kt metadata server: the key registry of one namespace.
//!
//! [`registry`] is the pure state machine (what keys exist, listing, TTLs);
//! [`db`] persists it in redb; [`server`] is the HTTP API around both.
//!
//! Invariant: a mutation is committed to the database before it is answered,
//! so a restart loses nothing that a client was told happened.

pub mod db;
pub mod registry;
pub mod server;

pub use server::{Config, MetadataError, run};
