//! No code: this crate's dependencies ask for the union of the features
//! the workspace's builds need, so that `cargo build -p kt-store`, the test
//! build, maturin's build of kt-python and the benches resolve one feature
//! set per dependency and share its compiled form (see Cargo.toml).
