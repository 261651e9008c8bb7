//! Starting, tracking, adopting and stopping mounts.
//!
//! [`ProcessMounter`] runs each volume as a child process of the same binary,
//! `s3csi mount --foreground ... BUCKET[:PREFIX] TARGET`, and
//! - puts it in its own session and process group, with stdin on /dev/null and stderr in a
//!   log file under the state directory (no pipe back to us), so a restart or crash of the
//!   node service leaves every mount serving;
//! - hands credentials over only as `AWS_*` environment variables;
//! - counts a publish as done only once the target shows up in `/proc/self/mountinfo` with
//!   a FUSE type, or fails with the last line the mounter wrote to stderr;
//! - records each mount in `STATE_DIR/mounts/*.state` (volume id, target, pid) so that a
//!   restarted node service adopts its mounts and unpublishes them correctly later;
//! - unmounts by SIGTERM (the mounter flushes open uploads and unmounts itself), then
//!   `umount2`, then a lazy `MNT_DETACH` only after a timeout, and reaps the child.
//!
//! Invariant: at most one operation runs per target at a time (the node service's
//! in-flight guard); the tracking map is only a cache of what mountinfo and the state
//! directory say.

pub mod mountinfo;

use async_trait::async_trait;
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
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
}

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
}

fn key_for(target: &Path) -> String {
    // FNV-1a: stable across builds, unlike std's hasher.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in target.as_os_str().as_encoded_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
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

/// `Some(reason)` when the mount on `target` does not answer (ENOTCONN and friends).
pub fn probe(target: &Path) -> Option<String> {
    match nix::sys::statvfs::statvfs(target) {
        Ok(_) => None,
        Err(nix::errno::Errno::ENOTCONN) => Some(format!(
            "{}: transport endpoint is not connected (the mounter is gone)",
            target.display()
        )),
        Err(e) => Some(format!("{}: {e}", target.display())),
    }
}

impl ProcessMounter {
    /// `bin` is the s3csi binary to run as `bin mount ...`.
    pub fn new(bin: PathBuf, state_dir: PathBuf, timeouts: Timeouts) -> std::io::Result<Self> {
        for sub in ["mounts", "logs"] {
            std::fs::create_dir_all(state_dir.join(sub))?;
        }
        Ok(Self {
            bin,
            state_dir,
            timeouts,
            mounts: Mutex::new(HashMap::new()),
        })
    }

    fn state_file(&self, target: &Path) -> PathBuf {
        self.state_dir
            .join("mounts")
            .join(format!("{}.state", key_for(target)))
    }

    /// The log file of the mounter on `target`.
    pub fn log_file(&self, target: &Path) -> PathBuf {
        self.state_dir
            .join("logs")
            .join(format!("{}.log", key_for(target)))
    }

    fn write_state(&self, target: &Path, volume_id: &str, pid: u32) {
        let text = format!(
            "volume_id={volume_id}\ntarget={}\npid={pid}\n",
            target.display()
        );
        let path = self.state_file(target);
        let tmp = path.with_extension("tmp");
        let res = std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = res {
            tracing::warn!(error = %e, "cannot record the mount in the state directory");
        }
    }

    fn remove_state(&self, target: &Path) {
        let _ = std::fs::remove_file(self.state_file(target));
    }

    /// Adopts the mounts an earlier node service left running (state files whose target is
    /// still mounted); forgets the others. Returns how many were adopted.
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
            let serving = mounted || (pid_alive(pid) && is_our_mounter(pid, &target));
            if !serving {
                tracing::info!(volume_id, target = %target.display(), "forgetting a mount that is gone");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            tracing::info!(volume_id, target = %target.display(), pid, "adopted mount");
            self.mounts.lock().unwrap().insert(
                target,
                Tracked {
                    volume_id: volume_id.to_string(),
                    pid,
                    exited: None,
                },
            );
            adopted += 1;
        }
        adopted
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
        for s in scrub.iter().filter(|s| s.len() >= 4) {
            line = line.replace(s.as_str(), "<redacted>");
        }
        line
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
        let log = self.log_file(&req.target);
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| MountError::other(format!("cannot open {}: {e}", log.display())))?;
        let offset = logf.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("mount")
            .arg("--foreground")
            .args(&req.args)
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
        tracing::info!(pid, log = %log.display(), "started mounter");
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
        self.mounts.lock().unwrap().insert(
            req.target.clone(),
            Tracked {
                volume_id: req.volume_id.clone(),
                pid,
                exited: Some(exited.clone()),
            },
        );
        let deadline = Instant::now() + self.timeouts.mount;
        loop {
            if mountinfo::find(&req.target).is_some_and(|e| e.is_fuse()) {
                self.write_state(&req.target, &req.volume_id, pid);
                return Ok(());
            }
            if exited.lock().unwrap().is_some() {
                self.mounts.lock().unwrap().remove(&req.target);
                let message = self.last_line(&log, offset, &req.scrub);
                return Err(MountError {
                    kind: classify(&message),
                    message,
                });
            }
            if Instant::now() >= deadline {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                self.mounts.lock().unwrap().remove(&req.target);
                let last = self.last_line(&log, offset, &req.scrub);
                return Err(MountError {
                    kind: FailureKind::Timeout,
                    message: format!(
                        "the mount did not appear within {:?}; last mounter message: {last}",
                        self.timeouts.mount
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn unmount(&self, target: &Path) -> Result<(), MountError> {
        use nix::mount::{umount2, MntFlags};
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let tracked = self
            .mounts
            .lock()
            .unwrap()
            .get(target)
            .map(|t| (t.pid, t.exited.clone()));
        let pid = tracked
            .as_ref()
            .map(|(p, _)| *p)
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
        if let Some((_, Some(exited))) = tracked {
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
            return MountStatus {
                problem: mounted.as_ref().and_then(|_| probe(target)),
                mounted,
                ..Default::default()
            };
        };
        let exited = t.exited.as_ref().and_then(|e| e.lock().unwrap().clone());
        let problem = if let Some(status) = exited {
            Some(format!("the mounter process exited ({status})"))
        } else if t.exited.is_none() && !pid_alive(t.pid) {
            Some(format!("the mounter process {} is gone", t.pid))
        } else if mounted.is_none() {
            Some(format!("{} is no longer mounted", target.display()))
        } else {
            probe(target)
        };
        MountStatus {
            volume_id: Some(t.volume_id.clone()),
            pid: Some(t.pid),
            mounted,
            problem,
        }
    }
}
