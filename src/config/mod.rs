//! Typed, validated configuration. Strings from the command line, `-o` lists, fstab and
//! CSI volume contexts are parsed here, once; the rest of the crate only sees these types.
//! This layer imports no other layer of the crate (s3, fs, mounter and csi import it).

pub mod args;
pub mod content_type;
pub mod endpoint;
pub mod mount;
pub mod options;
pub mod units;
pub mod volume;

pub use args::MountArgs;
pub use endpoint::Endpoint;
pub use mount::{BucketSource, MountConfig, MountOptionError, NameError};
pub use options::{OptionSpec, MOUNT_OPTIONS};
