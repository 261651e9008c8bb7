//! Starting, tracking, adopting, replacing and stopping mounts.
//!
//! [`ProcessMounter`] mounts by descriptor ([`handoff`]): it opens `/dev/fuse`, mounts the
//! target itself and hands the descriptor to a child process of the same binary,
//! `s3csi mount --foreground --handoff-dir DIR ... BUCKET[:PREFIX] TARGET`, keeping a
//! duplicate. Then
//! - a mounter that dies (crash, OOM kill, kill -9) is replaced: the supervisor task
//!   notices within [`SUPERVISE_EVERY`], starts `s3csi mount --recover` and hands it the
//!   same descriptor; the mount never leaves mountinfo, requests wait meanwhile, and the
//!   replacement resolves the dead one's inode numbers from `DIR/inodes.log`. Every
//!   replacement is logged and counted; `status` reports a problem while it runs;
//! - a restarted node service asks every surviving mounter for its descriptor
//!   (`recover`), so it can replace them later too. Credentials for a replacement are
//!   read back from the running mounter's environment (`/proc/PID/environ`), never
//!   written to disk.
//!
//! As before, it
//! - puts it in its own session and process group, with stdin on /dev/null and stderr in a
//!   log file under the state directory (no pipe back to us), so a restart or crash of the
//!   node service leaves every mount serving;
//! - hands credentials over only as `AWS_*` environment variables;
//! - counts a publish as done only once the target shows up in `/proc/self/mountinfo` with
//!   a FUSE type, or fails with the last line the mounter wrote to stderr;
//! - records each mount in `STATE_DIR/mounts/*.state` (volume id, target, pid, handoff
//!   dir, source, args — no credentials) so that a restarted node service adopts its mounts
//!   and unpublishes them correctly later; per-mount recovery files live in
//!   `STATE_DIR/handoff/<key>/`;
//! - unmounts by SIGTERM (the mounter flushes open uploads and exits), then `umount2`,
//!   then a lazy `MNT_DETACH` only after a timeout, then closes its descriptor (which ends
//!   the FUSE connection), and reaps the child. Mounts made by older versions (the mounter
//!   mounted itself) are still adopted and unmounted the old way.
//!
//! Invariant: at most one operation runs per target at a time (the node service's
//! in-flight guard); the tracking map is only a cache of what mountinfo and the state
//! directory say.

pub mod handoff;
pub mod mountinfo;
pub mod pod;
pub mod pod_status;

use async_trait::async_trait;
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use mountinfo::MountEntry;

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
}

impl std::fmt::Debug for MountRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountRequest")
            .field("volume_id", &self.volume_id)
            .field("target", &self.target)
            .field("source", &self.source)
            .field("args", &self.args)
            .field("env", &self.env.iter().map(|(k, _)| *k).collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

struct Tracked {
    volume_id: String,
    pid: u32,
    /// Set by the reaper task when our child exits; None for adopted mounters.
    exited: Option<Arc<Mutex<Option<String>>>>,
    /// Our duplicate of the mount's /dev/fuse descriptor (mounts by descriptor only).
    fuse_fd: Option<Arc<OwnedFd>>,
    handoff_dir: Option<PathBuf>,
    /// What a replacement is started with; None when it could not be recovered.
    request: Option<MountRequest>,
    /// Unmount in progress: do not replace.
    stopping: bool,
    /// A replacement is starting, for this reason.
    replacing: Option<String>,
    replacements: u32,
    last_replacement: Option<String>,
    /// Failed replacement attempts in a row, and when to try again.
    failures: u32,
    retry_at: Option<Instant>,
    /// Pod mode: the mounter Pod serving this mount.
    pod: Option<String>,
}

impl Tracked {
    fn new(volume_id: String, pid: u32, exited: Option<Arc<Mutex<Option<String>>>>) -> Self {
        Tracked {
            volume_id,
            pid,
            exited,
            fuse_fd: None,
            handoff_dir: None,
            request: None,
            stopping: false,
            replacing: None,
            replacements: 0,
            last_replacement: None,
            failures: 0,
            retry_at: None,
            pod: None,
        }
    }

    /// Why the mounter is not running, if it is not.
    fn dead(&self) -> Option<String> {
        if let Some(e) = &self.exited {
            if let Some(s) = e.lock().unwrap().as_ref() {
                return Some(match &self.pod {
                    Some(pod) => format!("the mounter pod {pod} stopped ({s})"),
                    None => format!("the mounter process {} exited ({s})", self.pid),
                });
            }
            if self.pod.is_some() {
                return None;
            }
        }
        // A child killed a moment ago is a zombie until the reaper task runs: it already
        // serves nothing, and a status probe now would only wait for its replacement.
        (!pid_alive(self.pid)).then(|| format!("the mounter process {} is gone", self.pid))
    }
}

/// How often the supervisor looks for dead mounters.
pub const SUPERVISE_EVERY: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub struct Timeouts {
    /// How long a mount may take to appear.
    pub mount: Duration,
    /// How long SIGTERM and a plain unmount get before a lazy unmount.
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

pub struct ProcessMounter {
    bin: PathBuf,
    state_dir: PathBuf,
    timeouts: Timeouts,
    mounts: Mutex<HashMap<PathBuf, Tracked>>,
    /// One mount, unmount or replacement at a time per target.
    ops: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    replacements_total: AtomicU64,
    /// Pod mode: mounters run in Pods of their own; None: child processes.
    pods: Option<pod::PodLauncher>,
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

fn pid_alive(pid: u32) -> bool {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    match kill(Pid::from_raw(pid as i32), None) {
        Ok(()) => {
            // A zombie still answers kill(0); it is not serving anything.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            !stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        }
        Err(_) => false,
    }
}

/// Is the process `pid` a `s3csi mount` for `target`? (Guards against pid reuse.)
fn is_our_mounter(pid: u32, target: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.iter().any(|a| *a == b"mount") && args.contains(&target.as_os_str().as_encoded_bytes())
}

/// statvfs that gives up after `timeout`: on a mount whose mounter died while we hold its
/// descriptor, the call waits until a replacement answers. (The thread that waits ends
/// when the answer comes.)
pub fn statvfs_within(
    target: &Path,
    timeout: Duration,
) -> Result<nix::sys::statvfs::Statvfs, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = target.to_path_buf();
    std::thread::Builder::new()
        .name("s3csi-statvfs".into())
        .spawn(move || {
            let _ = tx.send(nix::sys::statvfs::statvfs(&path));
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(nix::errno::Errno::ENOTCONN)) => Err(format!(
            "{}: transport endpoint is not connected (the mounter is gone)",
            target.display()
        )),
        Ok(Err(e)) => Err(format!("{}: {e}", target.display())),
        Err(_) => Err(format!(
            "{}: the file system did not answer within {timeout:?}",
            target.display()
        )),
    }
}

/// `Some(reason)` when the mount on `target` does not answer (ENOTCONN and friends).
pub fn probe(target: &Path) -> Option<String> {
    statvfs_within(target, Duration::from_secs(5)).err()
}

/// The static credentials a running mounter was given (for its replacement), from its
/// environment. None of these are ever written to disk.
fn credentials_of(pid: u32) -> Vec<(&'static str, String)> {
    const KEYS: [&str; 3] = [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ];
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('='))
        .filter_map(|(k, v)| {
            KEYS.iter()
                .find(|key| **key == k)
                .map(|key| (*key, v.to_string()))
        })
        .collect()
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

/// A started mounter: a child process, or (pod mode) a Pod.
struct Child {
    pid: u32,
    pod: Option<String>,
    exited: Arc<Mutex<Option<String>>>,
    log: PathBuf,
    offset: u64,
}

impl ProcessMounter {
    /// `bin` is the s3csi binary to run as `bin mount ...`.
    pub fn new(bin: PathBuf, state_dir: PathBuf, timeouts: Timeouts) -> std::io::Result<Self> {
        {
            use std::os::unix::fs::PermissionsExt;
            // Records and mounter logs name volumes, buckets and paths: root's business only.
            std::fs::create_dir_all(&state_dir)?;
            std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o700))?;
            for sub in ["mounts", "logs", "handoff"] {
                std::fs::create_dir_all(state_dir.join(sub))?;
                std::fs::set_permissions(
                    state_dir.join(sub),
                    std::fs::Permissions::from_mode(0o700),
                )?;
            }
        }
        Ok(Self {
            bin,
            state_dir,
            timeouts,
            mounts: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            replacements_total: AtomicU64::new(0),
            pods: None,
        })
    }

    /// Pod mode: run every mounter in a Pod of its own through `launcher`.
    pub fn with_pods(mut self, launcher: pod::PodLauncher) -> Self {
        self.pods = Some(launcher);
        self
    }

    fn state_file(&self, target: &Path) -> PathBuf {
        self.state_dir
            .join("mounts")
            .join(format!("{}.state", key_for(target)))
    }

    /// The mounter's recovery directory (control socket, saved INIT, inode log).
    pub fn handoff_dir(&self, target: &Path) -> PathBuf {
        self.state_dir.join("handoff").join(key_for(target))
    }

    /// The log file of the mounter on `target`.
    pub fn log_file(&self, target: &Path) -> PathBuf {
        self.state_dir
            .join("logs")
            .join(format!("{}.log", key_for(target)))
    }

    /// How many mounters this node service replaced, all volumes together.
    pub fn replacements_total(&self) -> u64 {
        self.replacements_total.load(Ordering::Relaxed)
    }

    /// How many mounts this node service tracks (starting, serving, being replaced or
    /// being unmounted).
    pub fn mount_count(&self) -> usize {
        self.mounts.lock().unwrap().len()
    }

    fn op_lock(&self, target: &Path) -> Arc<tokio::sync::Mutex<()>> {
        self.ops
            .lock()
            .unwrap()
            .entry(target.to_path_buf())
            .or_default()
            .clone()
    }

    fn write_state(&self, target: &Path) {
        let text = {
            let mounts = self.mounts.lock().unwrap();
            let Some(t) = mounts.get(target) else {
                return;
            };
            let mut text = format!(
                "volume_id={}\ntarget={}\npid={}\n",
                t.volume_id,
                target.display(),
                t.pid
            );
            if let Some(dir) = &t.handoff_dir {
                text.push_str(&format!(
                    "handoff={}\nreplacements={}\n",
                    dir.display(),
                    t.replacements
                ));
            }
            if let Some(pod) = &t.pod {
                text.push_str(&format!("pod={pod}\n"));
            }
            if let Some(req) = &t.request {
                text.push_str(&format!("source={}\n", req.source));
                for a in req.args.iter().filter(|a| !a.contains('\n')) {
                    text.push_str(&format!("arg={a}\n"));
                }
            }
            text
        };
        let path = self.state_file(target);
        let tmp = path.with_extension("tmp");
        let res = private_file(&tmp, false)
            .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = res {
            tracing::warn!(error = %e, "cannot record the mount in the state directory");
        }
    }

    fn remove_state(&self, target: &Path) {
        let _ = std::fs::remove_file(self.state_file(target));
        let _ = std::fs::remove_dir_all(self.handoff_dir(target));
    }

    /// Adopts the mounts an earlier node service left running (state files whose target is
    /// still mounted); forgets the others. Mounts by descriptor give their descriptor back
    /// over their control socket, so they can be replaced later. Returns how many were
    /// adopted.
    pub fn recover(&self) -> usize {
        let Ok(dir) = std::fs::read_dir(self.state_dir.join("mounts")) else {
            return 0;
        };
        let mut adopted = 0;
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("state") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let fields: HashMap<&str, &str> =
                text.lines().filter_map(|l| l.split_once('=')).collect();
            let args: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("arg="))
                .map(str::to_string)
                .collect();
            let (Some(volume_id), Some(target), Some(pid)) = (
                fields.get("volume_id"),
                fields.get("target"),
                fields.get("pid").and_then(|p| p.parse::<u32>().ok()),
            ) else {
                let _ = std::fs::remove_file(&path);
                continue;
            };
            let target = PathBuf::from(target);
            let mounted = mountinfo::find(&target).is_some_and(|e| e.is_fuse());
            let pod_name = fields.get("pod").map(|p| p.to_string());
            let alive = match (&pod_name, fields.get("handoff")) {
                (Some(_), Some(dir)) => pod::answers(Path::new(dir)) == pod::Answer::Serving,
                _ => pid_alive(pid) && is_our_mounter(pid, &target),
            };
            let serving = mounted || alive;
            if !serving {
                tracing::info!(volume_id, target = %target.display(), "forgetting a mount that is gone");
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_dir_all(self.handoff_dir(&target));
                continue;
            }
            let mut t = Tracked::new(volume_id.to_string(), pid, None);
            if let (Some(name), Some(dir)) = (&pod_name, fields.get("handoff")) {
                t.exited = Some(watch_pod(Path::new(dir), name));
                t.pod = pod_name.clone();
            }
            if let Some(dir) = fields.get("handoff").map(PathBuf::from) {
                t.replacements = fields
                    .get("replacements")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                if alive {
                    match handoff::collect_fd(&dir, Duration::from_secs(5)) {
                        Ok(fd) => t.fuse_fd = Some(Arc::new(fd)),
                        Err(e) => tracing::warn!(volume_id, target = %target.display(), error = %e,
                            "cannot collect the FUSE descriptor; this mounter cannot be replaced if it dies"),
                    }
                }
                if let Some(source) = fields.get("source") {
                    // A mounter Pod's credentials stay in its Secret, which its
                    // replacement reads too.
                    let env = if pod_name.is_some() {
                        vec![]
                    } else {
                        credentials_of(pid)
                    };
                    t.request = Some(MountRequest {
                        volume_id: volume_id.to_string(),
                        target: target.clone(),
                        source: source.to_string(),
                        args,
                        scrub: env
                            .iter()
                            .filter(|(k, _)| *k != "AWS_ACCESS_KEY_ID")
                            .map(|(_, v)| v.clone())
                            .collect(),
                        env,
                        kernel: handoff::KernelMount::default(),
                    });
                }
                t.handoff_dir = Some(dir);
            }
            tracing::info!(
                volume_id,
                target = %target.display(),
                pid,
                pod = pod_name.as_deref().unwrap_or(""),
                descriptor = t.fuse_fd.is_some(),
                "adopted mount"
            );
            self.mounts.lock().unwrap().insert(target, t);
            adopted += 1;
        }
        adopted
    }

    /// Pod mode, after [`Self::recover`]: deletes this node's mounter Pods and Secrets
    /// that belong to no mount any more (left by a node service that died between
    /// creating and recording them, or by a mount that is gone), and reports mounts whose
    /// mounter Pod vanished while no node service held their descriptor.
    pub async fn reconcile(&self) -> Result<(), MountError> {
        let Some(pods) = &self.pods else {
            return Ok(());
        };
        let (live_pods, live_mounts, orphaned): (Vec<String>, Vec<String>, Vec<String>) = {
            let mounts = self.mounts.lock().unwrap();
            let live_pods = mounts.values().filter_map(|t| t.pod.clone()).collect();
            let live_mounts = mounts.keys().map(|p| mount_id(p)).collect();
            let orphaned = mounts
                .iter()
                .filter(|(_, t)| t.pod.is_some() && t.fuse_fd.is_none())
                .map(|(p, t)| format!("{} ({})", p.display(), t.volume_id))
                .collect();
            (live_pods, live_mounts, orphaned)
        };
        let (found_pods, found_secrets) = pods.list_managed().await?;
        for (name, _) in found_pods.iter().filter(|(n, _)| !live_pods.contains(n)) {
            tracing::info!(pod = name, "deleting a mounter pod that serves no mount");
            pods.delete_pod(name, pods.settings().termination_grace_seconds)
                .await?;
        }
        for (name, mount) in found_secrets.iter() {
            if !live_mounts.contains(mount) {
                tracing::info!(secret = name, "deleting a mounter secret of no mount");
                pods.delete_secret(name).await?;
            }
        }
        for m in orphaned {
            tracing::error!(
                mount = m,
                "this mount lost its mounter pod while no node service held its descriptor; \
                it reports abnormal until the volume is unpublished and published again"
            );
        }
        Ok(())
    }

    /// The last line the mounter wrote to its log since `offset`, secrets removed.
    fn last_line(&self, log: &Path, offset: u64, scrub: &[String]) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(log) {
            let _ = f.seek(SeekFrom::Start(offset));
            let _ = f.read_to_string(&mut text);
        }
        let mut line = text
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("the mounter exited without a message")
            .to_string();
        if let Some(rest) = line.strip_prefix("s3csi: ") {
            line = rest.to_string();
        }
        scrub_text(&line, scrub)
    }

    async fn wait_gone(&self, target: &Path, pid: Option<u32>, deadline: Instant) -> bool {
        loop {
            let mounted = mountinfo::find(target).is_some();
            let running = pid.is_some_and(pid_alive);
            if !mounted && !running {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_exit(&self, pid: u32, deadline: Instant) -> bool {
        while pid_alive(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Starts `s3csi mount --foreground --handoff-dir DIR [--recover] ARGS SOURCE TARGET`
    /// as a child process or, in pod mode, as Pod generation `generation` of the mount.
    async fn start_child(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
        generation: u32,
    ) -> Result<Child, MountError> {
        let Some(pods) = &self.pods else {
            return self.spawn_child(req, dir, recover);
        };
        let name = pods
            .start(req, &mount_id(&req.target), dir, recover, generation)
            .await?;
        Ok(Child {
            pid: 0,
            exited: watch_pod(dir, &name),
            pod: Some(name),
            log: dir.join(pod::LAST_ERROR_FILE),
            offset: 0,
        })
    }

    /// Stops a mounter at once (SIGKILL, or a Pod deleted without grace).
    async fn kill_child(&self, pid: u32, pod: Option<&str>) {
        match (pod, &self.pods) {
            (Some(name), Some(pods)) => {
                if let Err(e) = pods.delete_pod(name, 0).await {
                    tracing::warn!(pod = name, error = %e, "cannot delete the mounter pod");
                }
            }
            _ => kill9(pid),
        }
    }

    fn spawn_child(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
    ) -> Result<Child, MountError> {
        let log = self.log_file(&req.target);
        let logf = private_file(&log, true)
            .map_err(|e| MountError::other(format!("cannot open {}: {e}", log.display())))?;
        let offset = logf.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("mount")
            .arg("--foreground")
            .arg("--handoff-dir")
            .arg(dir);
        if recover {
            cmd.arg("--recover");
        }
        cmd.args(&req.args)
            .arg(&req.source)
            .arg(&req.target)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(logf)
            .kill_on_drop(false);
        if !req.env.is_empty() {
            // Given credentials replace the node's, including a stale session token.
            cmd.env_remove("AWS_SESSION_TOKEN")
                .env_remove("AWS_PROFILE")
                .env_remove("AWS_WEB_IDENTITY_TOKEN_FILE")
                .env_remove("AWS_ROLE_ARN");
            for (k, v) in &req.env {
                cmd.env(k, v);
            }
        }
        unsafe {
            // Own session and process group: signals to the node service (or its group)
            // do not reach the mounters, and they outlive it.
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| MountError::other(format!("cannot start {}: {e}", self.bin.display())))?;
        let pid = child.id().unwrap_or(0);
        tracing::info!(pid, recover, log = %log.display(), "started mounter");
        let exited: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        {
            let exited = exited.clone();
            let volume_id = req.volume_id.clone();
            tokio::spawn(async move {
                let status = child.wait().await;
                let text = match status {
                    Ok(s) => s.to_string(),
                    Err(e) => format!("unknown status ({e})"),
                };
                tracing::info!(volume_id, pid, status = %text, "mounter exited");
                *exited.lock().unwrap() = Some(text);
            });
        }
        Ok(Child {
            pid,
            pod: None,
            exited,
            log,
            offset,
        })
    }

    /// Waits until the child listens on its control socket (it checked the bucket first).
    /// In pod mode, also reads the Pod's status and Events every
    /// [`pod_status::INSPECT_EVERY`] meanwhile: a Pod that will not start fails the wait
    /// with its reason, at once or after [`pod_status::STUCK_GRACE`], and the timeout says
    /// what was seen last.
    async fn wait_listening(
        &self,
        child: &Child,
        dir: &Path,
        deadline: Instant,
        scrub: &[String],
    ) -> Result<(), MountError> {
        let mut watch = child
            .pod
            .as_deref()
            .map(|name| pod_status::StartWatch::new(name, scrub));
        let mut next_look = Instant::now() + pod_status::INSPECT_EVERY;
        loop {
            let d = dir.to_path_buf();
            let pong = blocking(move || -> std::io::Result<String> {
                let s = handoff::connect(&d, Duration::from_secs(2))?;
                handoff::send(&s, "PING", None)?;
                Ok(handoff::recv(&s)?.0)
            })
            .await;
            // A Pod's process has a pid of its own namespace; its socket is its alone.
            let ours = |l: &str| match child.pod {
                Some(_) => l.starts_with("OK pid="),
                None => l == format!("OK pid={}", child.pid),
            };
            if pong.is_ok_and(|l| ours(&l)) {
                return Ok(());
            }
            if child.exited.lock().unwrap().is_some() {
                return Err(self.exit_error(child, dir, watch.as_mut(), scrub).await);
            }
            if let (Some(watch), Some(pods)) = (watch.as_mut(), &self.pods) {
                if Instant::now() >= next_look {
                    match pods.inspect(watch.pod()).await {
                        Ok(state) => {
                            if let Err(e) = watch.observe(state, Instant::now()) {
                                // A mounter that ran and gave up said why, better than
                                // its Pod's exit code does.
                                return Err(match pod::last_error(dir) {
                                    Some(last) => {
                                        let message = scrub_text(&last, scrub);
                                        MountError {
                                            kind: classify(&message),
                                            message,
                                        }
                                    }
                                    None => e,
                                });
                            }
                        }
                        Err(e) => tracing::debug!(pod = watch.pod(), error = %e,
                            "cannot read the mounter pod's status"),
                    }
                    next_look = Instant::now() + pod_status::INSPECT_EVERY;
                }
            }
            if Instant::now() >= deadline {
                self.kill_child(child.pid, child.pod.as_deref()).await;
                let message = match (&watch, pod::last_error(dir)) {
                    (Some(w), None) => {
                        let last = w.last().map_or_else(
                            || "no reason in its status or events".to_string(),
                            |r| r.to_string(),
                        );
                        format!(
                            "the mounter pod {} was not ready within {:?}; last seen: {last}",
                            w.pod(),
                            self.timeouts.mount,
                        )
                    }
                    _ => format!(
                        "the mounter was not ready within {:?}; last mounter message: {}",
                        self.timeouts.mount,
                        self.last_line(&child.log, child.offset, scrub)
                    ),
                };
                return Err(MountError {
                    kind: FailureKind::Timeout,
                    message,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Why a child that stopped before it listened did so: its last words; for a Pod that
    /// left none (killed, OOM, its container never ran), what its status says.
    async fn exit_error(
        &self,
        child: &Child,
        dir: &Path,
        watch: Option<&mut pod_status::StartWatch>,
        scrub: &[String],
    ) -> MountError {
        if let (Some(watch), Some(pods), None) = (watch, &self.pods, pod::last_error(dir)) {
            // The API server may lag kubelet a little behind the socket.
            let until = Instant::now() + Duration::from_secs(3);
            loop {
                if let Ok(state) = pods.inspect(watch.pod()).await {
                    if let Err(e) = watch.observe(state, Instant::now()) {
                        return e;
                    }
                }
                if Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            return MountError::other(format!(
                "the mounter pod {} stopped without a message{}",
                watch.pod(),
                watch
                    .last()
                    .map(|r| format!("; last seen: {r}"))
                    .unwrap_or_default()
            ));
        }
        let message = self.last_line(&child.log, child.offset, scrub);
        MountError {
            kind: classify(&message),
            message,
        }
    }

    /// Hands `fd` to the (listening) child and waits until it serves.
    async fn hand_over(
        &self,
        child: &Child,
        dir: &Path,
        fd: &Arc<OwnedFd>,
        scrub: &[String],
    ) -> Result<(), MountError> {
        let d = dir.to_path_buf();
        let f = fd.clone();
        let timeout = self.timeouts.mount;
        let res = blocking(move || handoff::serve_fd(&d, f.as_raw_fd(), timeout)).await;
        res.map_err(|msg| {
            // If it died, its own last words say more.
            std::thread::sleep(Duration::from_millis(100));
            let message = if child.exited.lock().unwrap().is_some() {
                self.last_line(&child.log, child.offset, scrub)
            } else {
                msg
            };
            MountError {
                kind: classify(&message),
                message,
            }
        })
    }

    /// Starts the supervisor: replaces mounters that died while their mount is held.
    pub fn start_supervisor(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SUPERVISE_EVERY).await;
                let Some(me) = me.upgrade() else { return };
                let due: Vec<PathBuf> = {
                    let now = Instant::now();
                    me.mounts
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|(_, t)| {
                            t.fuse_fd.is_some()
                                && !t.stopping
                                && t.replacing.is_none()
                                && t.retry_at.is_none_or(|r| r <= now)
                                && t.dead().is_some()
                        })
                        .map(|(p, _)| p.clone())
                        .collect()
                };
                for target in due {
                    me.replace(&target).await;
                }
            }
        });
    }

    /// Starts a replacement for the dead mounter of `target` and hands it the descriptor.
    async fn replace(&self, target: &Path) {
        let op = self.op_lock(target);
        let _op = op.lock().await;
        let (volume_id, old_pid, old_pod, reason, fd, req, dir, n) = {
            let mut mounts = self.mounts.lock().unwrap();
            let Some(t) = mounts.get_mut(target) else {
                return;
            };
            let Some(reason) = t.dead() else { return };
            let (Some(fd), Some(dir)) = (t.fuse_fd.clone(), t.handoff_dir.clone()) else {
                return;
            };
            if t.stopping {
                return;
            }
            let Some(req) = t.request.clone() else {
                if t.retry_at.is_none() {
                    tracing::error!(volume_id = t.volume_id, target = %target.display(), %reason,
                        "the mounter died and its options are unknown; republish the volume to repair it");
                }
                t.retry_at = Some(Instant::now() + Duration::from_secs(3600));
                return;
            };
            t.replacing = Some(reason.clone());
            (
                t.volume_id.clone(),
                t.pid,
                t.pod.clone(),
                reason,
                fd,
                req,
                dir,
                t.replacements + 1,
            )
        };
        let started = Instant::now();
        tracing::warn!(
            volume_id,
            target = %target.display(),
            old_pid,
            %reason,
            replacement = n,
            "mounter died; starting a replacement with the same FUSE descriptor"
        );
        let result = async {
            if let Some(old) = &old_pod {
                // Its process is gone; the Pod object (phase Failed) is not. Its socket
                // goes too, or the new Pod's watch would take it for a dead mounter.
                self.kill_child(0, Some(old)).await;
                let _ = std::fs::remove_file(handoff::control_socket(&dir));
            }
            let child = self.start_child(&req, &dir, true, n).await?;
            let deadline = Instant::now() + self.timeouts.mount;
            let outcome = async {
                self.wait_listening(&child, &dir, deadline, &req.scrub)
                    .await?;
                self.hand_over(&child, &dir, &fd, &req.scrub).await
            }
            .await;
            if outcome.is_err() {
                self.kill_child(child.pid, child.pod.as_deref()).await;
            }
            outcome.map(|_| child)
        }
        .await;
        let mut mounts = self.mounts.lock().unwrap();
        let Some(t) = mounts.get_mut(target) else {
            return;
        };
        t.replacing = None;
        match result {
            Ok(child) => {
                let total = self.replacements_total.fetch_add(1, Ordering::Relaxed) + 1;
                t.pid = child.pid;
                t.pod = child.pod.clone();
                t.exited = Some(child.exited);
                t.replacements = n;
                t.failures = 0;
                t.retry_at = None;
                t.last_replacement = Some(reason.clone());
                drop(mounts);
                self.write_state(target);
                tracing::warn!(
                    volume_id,
                    target = %target.display(),
                    pid = child.pid,
                    pod = child.pod.as_deref().unwrap_or(""),
                    replacement = n,
                    replacements_total = total,
                    took_ms = started.elapsed().as_millis() as u64,
                    "replacement mounter serving"
                );
            }
            Err(e) => {
                t.failures += 1;
                let wait = Duration::from_secs(1 << t.failures.min(5));
                t.retry_at = Some(Instant::now() + wait);
                tracing::error!(
                    volume_id,
                    target = %target.display(),
                    error = %e,
                    retry_in = ?wait,
                    "replacement mounter failed"
                );
            }
        }
    }

    /// Unmounts a mount by descriptor: SIGTERM (the mounter completes uploads and exits),
    /// umount2, then closing our descriptor ends the FUSE connection.
    async fn unmount_handoff(
        &self,
        target: &Path,
        pid: u32,
        pod: Option<String>,
        exited: Option<Arc<Mutex<Option<String>>>>,
    ) -> Result<(), MountError> {
        use nix::mount::{umount2, MntFlags};
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let deadline = Instant::now() + self.timeouts.unmount;
        if let (Some(name), Some(pods)) = (&pod, &self.pods) {
            // Deleting the Pod gives the mounter its SIGTERM and grace period.
            let grace = self.timeouts.unmount.as_secs().max(1) as u32;
            if let Err(e) = pods.delete_pod(name, grace).await {
                tracing::warn!(pod = name, error = %e, "cannot delete the mounter pod");
            }
            let gone = || exited.as_ref().is_none_or(|e| e.lock().unwrap().is_some());
            while !gone() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if !gone() {
                tracing::warn!(
                    pod = name,
                    "mounter pod did not stop in time; deleting it now"
                );
                self.kill_child(0, Some(name)).await;
            }
            if let Err(e) = pods
                .delete_secret(&pod::PodLauncher::secret_name(&mount_id(target)))
                .await
            {
                tracing::warn!(error = %e, "cannot delete the mounter secret");
            }
        } else if pid > 0 && pid_alive(pid) && is_our_mounter(pid, target) {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            if !self.wait_exit(pid, deadline).await {
                tracing::warn!(pid, "mounter did not stop in time; killing it");
                kill9(pid);
            }
        }
        if mountinfo::find(target).is_some() {
            if let Err(e) = umount2(target, MntFlags::empty()) {
                tracing::warn!(error = %e, "unmount failed; waiting, then detaching lazily");
                if !self.wait_gone(target, None, deadline).await {
                    umount2(target, MntFlags::MNT_DETACH).map_err(|e| {
                        MountError::other(format!("cannot unmount {}: {e}", target.display()))
                    })?;
                }
            }
        }
        if let Some(exited) = exited {
            let grace = Instant::now() + Duration::from_secs(5);
            while exited.lock().unwrap().is_none() && Instant::now() < grace {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}

/// Watches a mounter Pod from this node: it has exited once its control socket refuses
/// connections, or once it left a fatal error in the handoff directory. The watch ends
/// when nobody else holds the returned flag any more (the mount was dropped).
fn watch_pod(dir: &Path, name: &str) -> Arc<Mutex<Option<String>>> {
    let exited: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let flag = exited.clone();
    let dir = dir.to_path_buf();
    let name = name.to_string();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SUPERVISE_EVERY).await;
            if Arc::strong_count(&flag) == 1 {
                return;
            }
            if let Some(err) = pod::last_error(&dir) {
                *flag.lock().unwrap() = Some(format!("failed: {err}"));
                return;
            }
            let d = dir.clone();
            if blocking(move || pod::answers(&d)).await == pod::Answer::Refused {
                tracing::info!(pod = name, "mounter pod stopped serving");
                *flag.lock().unwrap() = Some("its control socket is closed".into());
                return;
            }
        }
    });
    exited
}

fn kill9(pid: u32) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn classify(message: &str) -> FailureKind {
    let m = message.to_ascii_lowercase();
    if m.contains("nosuchbucket") || (m.contains("bucket") && m.contains("does not exist")) {
        FailureKind::NotFound
    } else if m.contains("denied") || m.contains("forbidden") {
        FailureKind::PermissionDenied
    } else if m.contains("mount option") || m.contains("invalid bucket source") {
        FailureKind::InvalidArgument
    } else {
        FailureKind::Other
    }
}

#[async_trait]
impl Mounter for ProcessMounter {
    async fn mount(&self, req: MountRequest) -> Result<(), MountError> {
        let op = self.op_lock(&req.target);
        let _op = op.lock().await;
        let dir = self.handoff_dir(&req.target);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| MountError::other(format!("cannot create {}: {e}", dir.display())))?;
        let child = self.start_child(&req, &dir, false, 0).await?;
        let mut tracked =
            Tracked::new(req.volume_id.clone(), child.pid, Some(child.exited.clone()));
        tracked.handoff_dir = Some(dir.clone());
        tracked.pod = child.pod.clone();
        tracked.stopping = true; // not replaceable until it serves
        self.mounts
            .lock()
            .unwrap()
            .insert(req.target.clone(), tracked);
        let deadline = Instant::now() + self.timeouts.mount;
        let result = async {
            self.wait_listening(&child, &dir, deadline, &req.scrub)
                .await?;
            let fd = handoff::kernel_mount(&req.target, &req.kernel).map_err(|e| MountError {
                kind: if e.raw_os_error() == Some(libc::EPERM) {
                    FailureKind::PermissionDenied
                } else {
                    FailureKind::Other
                },
                message: format!("cannot mount on {}: {e}", req.target.display()),
            })?;
            let fd = Arc::new(fd);
            if let Err(e) = self.hand_over(&child, &dir, &fd, &req.scrub).await {
                let _ = nix::mount::umount2(&req.target, nix::mount::MntFlags::MNT_DETACH);
                return Err(e);
            }
            Ok(fd)
        }
        .await;
        match result {
            Ok(fd) => {
                if let Some(t) = self.mounts.lock().unwrap().get_mut(&req.target) {
                    t.fuse_fd = Some(fd);
                    t.request = Some(req.clone());
                    t.stopping = false;
                }
                self.write_state(&req.target);
                Ok(())
            }
            Err(e) => {
                self.kill_child(child.pid, child.pod.as_deref()).await;
                if let Some(pods) = &self.pods {
                    let secret = pod::PodLauncher::secret_name(&mount_id(&req.target));
                    let _ = pods.delete_secret(&secret).await;
                }
                self.mounts.lock().unwrap().remove(&req.target);
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    async fn unmount(&self, target: &Path) -> Result<(), MountError> {
        use nix::mount::{umount2, MntFlags};
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let op = self.op_lock(target);
        let _op = op.lock().await;
        let tracked = {
            let mut mounts = self.mounts.lock().unwrap();
            mounts.get_mut(target).map(|t| {
                t.stopping = true;
                (
                    t.pid,
                    t.exited.clone(),
                    t.handoff_dir.is_some(),
                    t.pod.clone(),
                )
            })
        };
        if let Some((pid, exited, true, pod)) = tracked.clone() {
            self.unmount_handoff(target, pid, pod, exited).await?;
            // Dropping our descriptor closes the connection for good.
            self.mounts.lock().unwrap().remove(target);
            self.remove_state(target);
            return Ok(());
        }
        let pid = tracked
            .as_ref()
            .map(|(p, _, _, _)| *p)
            .filter(|p| *p > 0 && pid_alive(*p) && is_our_mounter(*p, target));
        let deadline = Instant::now() + self.timeouts.unmount;
        if let Some(pid) = pid {
            // The mounter flushes open uploads, then unmounts itself.
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            if !self.wait_gone(target, Some(pid), deadline).await {
                tracing::warn!(pid, "mounter did not stop in time");
            }
        }
        if mountinfo::find(target).is_some() {
            match umount2(target, MntFlags::empty()) {
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "unmount failed; waiting, then detaching lazily");
                    if !self.wait_gone(target, None, deadline).await {
                        umount2(target, MntFlags::MNT_DETACH).map_err(|e| {
                            MountError::other(format!("cannot unmount {}: {e}", target.display()))
                        })?;
                    }
                }
            }
        }
        if let Some(pid) = pid {
            // The mount is gone; a mounter that still runs has nothing left to serve.
            let grace = Instant::now() + Duration::from_secs(5);
            if !self.wait_gone(target, Some(pid), grace).await {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
        if let Some((_, Some(exited), _, _)) = tracked {
            // Our child: the reaper task collects it; give it a moment to do so.
            let grace = Instant::now() + Duration::from_secs(5);
            while exited.lock().unwrap().is_none() && Instant::now() < grace {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        self.mounts.lock().unwrap().remove(target);
        self.remove_state(target);
        Ok(())
    }

    fn status(&self, target: &Path) -> MountStatus {
        let mounted = mountinfo::find(target);
        let mounts = self.mounts.lock().unwrap();
        let Some(t) = mounts.get(target) else {
            drop(mounts);
            return MountStatus {
                problem: mounted.as_ref().and_then(|_| probe(target)),
                mounted,
                ..Default::default()
            };
        };
        let dead = t.dead();
        let held = t.fuse_fd.is_some() && !t.stopping;
        let mut recoverable = false;
        let problem = if let Some(reason) = &t.replacing {
            recoverable = true;
            Some(format!("{reason}; a replacement mounter is starting"))
        } else if let Some(reason) = dead {
            if held && t.request.is_some() {
                recoverable = true;
                Some(format!("{reason}; replacing it"))
            } else {
                Some(reason)
            }
        } else if mounted.is_none() {
            Some(format!("{} is no longer mounted", target.display()))
        } else {
            None
        };
        let status = MountStatus {
            volume_id: Some(t.volume_id.clone()),
            pid: Some(t.pid),
            mounted,
            problem,
            recoverable,
            replacements: t.replacements,
            last_replacement: t.last_replacement.clone(),
        };
        drop(mounts);
        if status.problem.is_none() {
            // Only now: a probe of a mount without a live mounter would wait.
            return MountStatus {
                problem: probe(target),
                ..status
            };
        }
        status
    }
}
