//! Typed, validated configuration. Strings from the command line, `-o` lists, fstab and
//! (later) CSI volume contexts are parsed here, once; the rest of the crate only sees
//! these types.

pub mod args;
pub mod mount;
pub mod volume;

pub use args::MountArgs;
pub use mount::{BucketSource, MountConfig, MountOptionError};
