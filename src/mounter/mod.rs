//! Starting, tracking, adopting, replacing and stopping mounts on this node.
//!
//! The node service mounts by descriptor ([`handoff`]): it opens `/dev/fuse` and mounts
//! the target itself ([`kernel`]), then hands the descriptor to a mounter — `s3csi mount
//! --foreground --handoff-dir DIR ... BUCKET[:PREFIX] TARGET` — keeping a duplicate. A
//! [`backend::MounterBackend`] runs mounters: [`process::ProcessBackend`] as children in a
//! session of their own, [`pod::PodLauncher`] as one Pod per mount (which outlives the node
//! plugin's Pod). Above both, one [`MountManager`]:
//! - counts a publish as done once the mounter serves the handed-over descriptor, or fails
//!   with the typed [`handoff::Failure`] the mounter reported;
//! - records each mount in `STATE_DIR/mounts/*.state` ([`state::MountRecord`]; no
//!   credentials), so a restarted node service adopts its mounts and collects their
//!   descriptors back over their control sockets (`recover`);
//! - replaces a mounter that dies while its mount is held ([`supervisor`]): the mount never
//!   leaves mountinfo, requests wait meanwhile, and the replacement resolves the dead one's
//!   inode numbers from `DIR/inodes.log`;
//! - unmounts by stopping the mounter (SIGTERM or Pod deletion: it completes uploads), then
//!   `umount2` (a mount still busy after a second is detached lazily), then closing its
//!   descriptor.
//!
//! Invariant: at most one operation runs per target at a time (the node service's
//! in-flight guard and a lock per target); the tracking map is only a cache of what
//! mountinfo and the state directory say.

pub mod backend;
pub mod handoff;
pub mod kernel;
mod manager;
pub mod mountinfo;
pub mod pod;
pub mod pod_credentials;
pub mod pod_status;
pub mod process;
mod shared;
pub mod state;
mod supervisor;
#[cfg(test)]
pub(crate) mod tests;

use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use manager::MountManager;
pub use mountinfo::MountEntry;
pub use pod_credentials::PodCredentials;
pub use shared::SharedMounts;

/// One mount to start.
#[derive(Clone)]
pub struct MountRequest {
    pub volume_id: String,
    pub target: PathBuf,
    /// `BUCKET[:PREFIX]`
    pub source: String,
    /// Options for `s3csi mount` (no credentials, ever).
    pub args: Vec<String>,
    /// Extra environment (credentials). Never logged.
    pub env: Vec<(&'static str, String)>,
    /// Values to remove from any message that leaves this module.
    pub scrub: Vec<String>,
    /// How the kernel mount is made.
    pub kernel: handoff::KernelMount,
    /// The volume's data cache lives beside the node's state, not in the mount's handoff
    /// directory, and outlives its unpublish (`keepCache`; see `MountManager::keep_cache`).
    pub keep_cache: bool,
    /// The workload pod's credentials (`authenticationSource: pod`): its token goes into
    /// the mount's handoff directory and its variables into `env` when the mounter starts.
    pub pod_credentials: Option<PodCredentials>,
}

impl MountRequest {
    /// What publishes must agree on to share one mounter (see [`shared`]): the volume, its
    /// source, every mount option (the uid and gid fsGroup gives among them), how the
    /// kernel mounts it (read-only-ness), whether its cache is kept, and the credentials
    /// (for a pod's own, its service account and role, not its token).
    /// A SHA-256 of all that, so that the name (a directory on the node) says nothing of
    /// the credentials (the record beside the mount names the volume).
    pub fn share_key(&self) -> String {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        let mut part = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        part(self.volume_id.as_bytes());
        part(self.source.as_bytes());
        for a in &self.args {
            part(a.as_bytes());
        }
        let k = &self.kernel;
        part(k.fsname.as_bytes());
        part(&[
            k.read_only as u8,
            k.allow_other as u8,
            k.no_default_permissions as u8,
            self.keep_cache as u8,
        ]);
        for (name, value) in &self.env {
            part(name.as_bytes());
            part(value.as_bytes());
        }
        if let Some(c) = &self.pod_credentials {
            part(c.identity().as_bytes());
        }
        let digest = h.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("v-{hex}")
    }
}

impl std::fmt::Debug for MountRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountRequest")
            .field("volume_id", &self.volume_id)
            .field("target", &self.target)
            .field("source", &self.source)
            .field("args", &self.args)
            .field("env", &self.env.iter().map(|(k, _)| *k).collect::<Vec<_>>())
            .field("pod_credentials", &self.pod_credentials)
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FailureKind {
    /// The bucket (or endpoint) does not exist.
    NotFound,
    /// The mounter rejected its options.
    InvalidArgument,
    PermissionDenied,
    Timeout,
    Other,
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct MountError {
    pub kind: FailureKind,
    pub message: String,
}

impl From<handoff::Failure> for MountError {
    fn from(f: handoff::Failure) -> Self {
        Self {
            kind: f.kind,
            message: f.message,
        }
    }
}

impl MountError {
    fn other(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Other,
            message: message.into(),
        }
    }
}

/// What is on a target path.
#[derive(Debug, Clone, Default)]
pub struct MountStatus {
    /// The volume we mounted there (this process or an earlier one, per the state dir).
    pub volume_id: Option<String>,
    pub pid: Option<u32>,
    /// The kernel's view: the topmost mount on the path.
    pub mounted: Option<MountEntry>,
    /// Why the mount is not healthy, if it is not.
    pub problem: Option<String>,
    /// The problem is being repaired: a replacement mounter is (about to be) started.
    pub recoverable: bool,
    /// The only problem is that the mount did not answer the probe in time: its mounter
    /// is alive, busy or slow, and the mount must not be torn down for it.
    pub slow: bool,
    /// How many times the mounter of this mount was replaced by this node service.
    pub replacements: u32,
    /// Why the last replacement happened.
    pub last_replacement: Option<String>,
}

#[async_trait]
pub trait Mounter: Send + Sync + 'static {
    async fn mount(&self, req: MountRequest) -> Result<(), MountError>;
    /// Unmounts whatever is on `target` and stops its mounter. OK when nothing is there.
    async fn unmount(&self, target: &Path) -> Result<(), MountError>;
    fn status(&self, target: &Path) -> MountStatus;
    /// What statvfs says of the mount on `target`, giving up after a few seconds (a
    /// mount whose mounter does not answer would make it wait). Blocks.
    fn usage(&self, target: &Path) -> Result<kernel::Usage, kernel::ProbeError>;
    /// Gives the mounter serving `req.target` the workload's newer token (kubelet
    /// republishes with a fresh one, `requiresRepublish`). Fails when that mounter was
    /// started for another identity or other options (`share_key`). OK when nothing is
    /// mounted there.
    async fn refresh(&self, req: &MountRequest) -> Result<(), MountError>;
}

/// How often the supervisor looks for dead mounters.
pub const SUPERVISE_EVERY: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub struct Timeouts {
    /// How long a mount may take to appear.
    pub mount: Duration,
    /// How long a mounter gets to stop (complete its uploads) before it is killed.
    pub unmount: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            mount: Duration::from_secs(60),
            unmount: Duration::from_secs(30),
        }
    }
}

/// FNV-1a: stable across builds and versions, unlike std's hasher.
pub(crate) fn fnv64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// A short name for the mount on `target`, usable in Kubernetes object names.
fn mount_id(target: &Path) -> String {
    format!("{:016x}", fnv64(target.as_os_str().as_encoded_bytes()))
}

fn key_for(target: &Path) -> String {
    let h = fnv64(target.as_os_str().as_encoded_bytes());
    let leaf: String = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    format!("{leaf}-{h:016x}")
}

/// Creates (or opens) a file only its owner may read: mode 0600, also when it existed
/// with looser permissions from an older version.
fn private_file(path: &Path, append: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Replaces `path` with `bytes` atomically (a sibling temporary file renamed over it),
/// mode 0600: a crash leaves the old file or the new one, never half of one. The temporary
/// file is created new (`O_EXCL`, `O_NOFOLLOW`) under a name of its own, so that a link
/// planted in the directory (a mounter Pod can write its handoff directory) is never
/// followed, and two writers at once never write into one file.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `text` without any of the `scrub` values (credentials) in it.
fn scrub_text(text: &str, scrub: &[String]) -> String {
    let mut text = text.to_string();
    for s in scrub.iter().filter(|s| s.len() >= 4) {
        text = text.replace(s.as_str(), "<redacted>");
    }
    text
}

/// Runs blocking socket work off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking task panicked")
}
