//! Benchmarks of kt.
//!
//! - `benches/sync_engine.rs`: criterion benches of the sync engine (scan, hash,
//!   diff, chunk root composition);
//! - the `kt-bench-rsync` binary: kt against a real rsync daemon on the same
//!   machine, both reading and writing tmpfs, each case the median of a few runs;
//! - the `kt-bench-metadata` binary: a metadata server under concurrent lookups
//!   ([`metaload`], latencies in a [`histogram`]);
//! - the `kt-bench-broadcast` binary: drives the broadcast benchmark scenario
//!   (`testbed/bench/broadcast.yaml`, netns target) and summarizes its report
//!   ([`broadcast`]);
//! - the `kt-bench-tensors` binary: a state dict between two node agents on
//!   the host backend, packed and unpacked, against a plain TCP copy of the
//!   same bytes ([`tensors`]);
//! - the `kt-bench-nccl` binary: the same state dict between two ranks on
//!   the NCCL backend (a CUDA GPU), through the transfer engine packed and
//!   unpacked, against a bare NCCL broadcast of the same bytes ([`nccl`]);
//! - the `kt-bench-recovery` binary: a large get with the store SIGKILLed and
//!   started again midway, against the same get undisturbed: the extra time
//!   and the bytes fetched twice ([`recovery`]);
//! - the `kt-bench-s3` binary: an S3 ingest (moto's server) into the store
//!   against a plain download of the same objects, and the ingesting
//!   process's peak RSS (`kt_dataset::ingest`; everything in the binary);
//! - the `kt-bench-gate` binary (`make bench-gate`): the rsync comparison a
//!   few times over, its median ratios held against the committed baseline
//!   `testbed/bench/baseline.json` ([`gate`]); CPU time comes from [`cpu`];
//! - the `kt-bench-cpu` binary (`make bench-cpu`): CPU seconds per GiB of a
//!   put, the store's send, a relaying broadcast member and a pure getter,
//!   each its own process on loopback ([`relay_cpu`]).
//!
//! The binary's pieces live here so that `main` stays a thin argument parser:
//! [`size`] (byte sizes such as `256MiB`), [`scratch`] (a work directory removed on
//! drop), [`data`] (seeded test trees), [`rsync`] (the daemon and the client
//! invocation), [`kt`] (in-process metadata and store servers plus a client),
//! [`compare`] (the cases) and [`report`] (medians, the table, the ratio line).

pub mod broadcast;
pub mod compare;
pub mod cpu;
pub mod data;
pub mod gate;
pub mod histogram;
pub mod kt;
pub mod metaload;
pub mod nccl;
pub mod recovery;
pub mod relay_cpu;
pub mod report;
pub mod rsync;
pub mod scratch;
pub mod size;
pub mod tensors;
pub mod tls;
