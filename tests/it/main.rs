//! The integration tests, one binary: real FUSE mounts, the CSI services over their unix
//! socket, pod mode against a fake API server, the embedded S3 server, all against S3
//! servers started on 127.0.0.1 (`common`). One binary links the crate once instead of once
//! per file, and shares one moto server among all tests.
//!
//! Run one area with a filter: `cargo test --release --test it -- mount::`.

mod common;

mod bad_input;
mod bounded;
mod cache;
mod credentials;
mod csi;
mod deferred_delete;
mod docs;
mod edit;
mod empty_create;
mod faults;
mod fsx;
mod handoff;
mod metadata;
mod metrics;
mod mount;
mod parse_props;
mod pod_mode;
mod posix;
mod registration;
mod s3_server;
