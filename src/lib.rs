//! s3csi: an S3 file system (FUSE) and the Kubernetes CSI driver built around it.

pub mod cmd;
pub mod config;
pub mod csi;
pub mod demo;
pub mod fs;
pub mod logging;
pub mod metrics;
pub mod mounter;
pub mod s3;
pub mod s3server;
