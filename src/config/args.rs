//! The `s3csi mount` command line: flags, `-o` lists and mount(8)'s helper conventions,
//! turned into one [`MountConfig`].

use super::{BucketSource, MountConfig, MountOptionError};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(about = "Mount an S3 bucket (or a prefix of it) on a directory", after_help = MOUNT_HELP)]
pub struct MountArgs {
    /// BUCKET or BUCKET:PREFIX
    pub source: String,
    /// Existing empty directory to mount on
    pub mountpoint: PathBuf,
    /// S3 endpoint, for S3-compatible stores (e.g. http://127.0.0.1:9000)
    #[arg(long, value_name = "URL")]
    pub endpoint_url: Option<String>,
    /// AWS region (default: from the environment / profile, else us-east-1)
    #[arg(long)]
    pub region: Option<String>,
    /// Address the bucket as ENDPOINT/BUCKET instead of BUCKET.ENDPOINT
    #[arg(long)]
    pub force_path_style: bool,
    /// Mount only keys under this prefix (same as BUCKET:PREFIX)
    #[arg(long)]
    pub prefix: Option<String>,
    /// Refuse every change
    #[arg(long)]
    pub read_only: bool,
    /// Owner of all files (default: the mounting user)
    #[arg(long)]
    pub uid: Option<String>,
    /// Group of all files (default: the mounting user's group)
    #[arg(long)]
    pub gid: Option<String>,
    /// Permission bits of files, octal [default: 0644]
    #[arg(long, value_name = "MODE")]
    pub file_mode: Option<String>,
    /// Permission bits of directories, octal [default: 0755]
    #[arg(long, value_name = "MODE")]
    pub dir_mode: Option<String>,
    /// Let users other than the mounting one access the mount
    #[arg(long)]
    pub allow_other: bool,
    /// Let root access the mount too
    #[arg(long)]
    pub allow_root: bool,
    /// Stay in the foreground instead of detaching once mounted
    #[arg(long)]
    pub foreground: bool,
    /// How long metadata from S3 is trusted, e.g. 1s, 500ms, 5m [default: 1s]
    #[arg(long, value_name = "DURATION")]
    pub metadata_ttl: Option<String>,
    /// Multipart upload part size, 5MiB..5GiB; doubles every 1000 parts [default: 8MiB]
    #[arg(long, value_name = "SIZE")]
    pub part_size: Option<String>,
    /// Maximum parallel S3 requests per open file [default: 16]
    #[arg(long, value_name = "N")]
    pub max_concurrency: Option<String>,
    /// Read-ahead memory shared by all open files [default: 512MiB]
    #[arg(long, value_name = "SIZE")]
    pub max_prefetch_memory: Option<String>,
    /// Memory for upload parts in flight, shared by all files being written [default: 256MiB]
    #[arg(long, value_name = "SIZE")]
    pub max_upload_memory: Option<String>,
    /// Make close of a new empty file wait until the object is in S3
    #[arg(long)]
    pub sync_create: bool,
    /// Make every unlink wait until S3 has deleted the object
    #[arg(long)]
    pub sync_delete: bool,
    /// Let the kernel cache file data while a file is open (default: direct I/O, which
    /// copies reads and writes once, on Linux 6.6+; see README "Semantics")
    #[arg(long)]
    pub page_cache: bool,
    /// Log every request at debug level
    #[arg(long)]
    pub debug: bool,
    /// Write logs here (default: stderr; /dev/null once detached)
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Options as mount(8) passes them: name[=value],... (same names as the flags)
    #[arg(short = 'o', value_name = "OPTS")]
    pub options: Vec<String>,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 'n', hide = true)]
    pub no_mtab: bool,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 's', hide = true)]
    pub sloppy: bool,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 'v', hide = true)]
    pub verbose: bool,
    /// (CSI node service only) do not mount: serve the /dev/fuse descriptor the node
    /// service hands over on DIR/control.sock, and keep crash-recovery state in DIR
    #[arg(long, hide = true, value_name = "DIR")]
    pub handoff_dir: Option<PathBuf>,
    /// (CSI node service only) with --handoff-dir: take over from a mounter that died
    #[arg(long, hide = true, requires = "handoff_dir")]
    pub recover: bool,
}

const MOUNT_HELP: &str = "\
Credentials come only from the AWS SDK default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, web identity (IRSA), container credentials (EKS Pod Identity), or the instance
profile. They are never accepted on the command line.

As a mount(8) helper (install the binary as /sbin/mount.s3csi):
  mount -t s3csi my-bucket:some/prefix /mnt/data -o allow-other,uid=1000
  fstab: my-bucket /mnt/data s3csi _netdev,allow-other,region=eu-west-1 0 0";

impl MountArgs {
    /// Turns the command line into a validated [`MountConfig`]. `-o` options apply first,
    /// explicit flags override them.
    pub fn to_config(&self) -> Result<MountConfig, MountOptionError> {
        let mut cfg = MountConfig::new(BucketSource::parse(&self.source)?);
        for list in &self.options {
            cfg.apply_option_list(list)?;
        }
        let valued = [
            ("endpoint-url", &self.endpoint_url),
            ("region", &self.region),
            ("prefix", &self.prefix),
            ("uid", &self.uid),
            ("gid", &self.gid),
            ("file-mode", &self.file_mode),
            ("dir-mode", &self.dir_mode),
            ("metadata-ttl", &self.metadata_ttl),
            ("part-size", &self.part_size),
            ("max-concurrency", &self.max_concurrency),
            ("max-prefetch-memory", &self.max_prefetch_memory),
            ("max-upload-memory", &self.max_upload_memory),
        ];
        for (name, value) in valued {
            if let Some(v) = value {
                cfg.apply_option(name, Some(v))?;
            }
        }
        for (name, on) in [
            ("force-path-style", self.force_path_style),
            ("read-only", self.read_only),
            ("allow-other", self.allow_other),
            ("allow-root", self.allow_root),
            ("sync-create", self.sync_create),
            ("sync-delete", self.sync_delete),
            ("page-cache", self.page_cache),
            ("debug", self.debug),
        ] {
            if on {
                cfg.apply_option(name, None)?;
            }
        }
        Ok(cfg)
    }
}
