//! The commands of the `s3csi` binary that are not a service of their own: they put the
//! layers together (options, S3 client, file system, handoff protocol) for one process.

pub mod mount;
