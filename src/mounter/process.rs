//! Mounters as child processes of the node service, each in a session and process group
//! of its own (signals to the node service do not reach it, and it outlives a restart or
//! crash of the node service), stdin on /dev/null, stderr in a private log file, and
//! credentials only as `AWS_*` environment variables.

use super::backend::{ExitFlag, MounterBackend, MounterHandle};
use super::state::MountRecord;
use super::{private_file, scrub_text, MountError, MountRequest};
use async_trait::async_trait;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The credentials a mounter may be given, all of them `AWS_*` variables.
pub const CREDENTIAL_KEYS: [&str; 3] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
];

/// Every variable a mount's own credentials may set: static keys, or a pod's token
/// exchange ([`super::pod_credentials::VARIABLES`]).
pub fn mount_credential_keys() -> impl Iterator<Item = &'static str> {
    CREDENTIAL_KEYS
        .into_iter()
        .chain(super::pod_credentials::VARIABLES)
}

pub struct ProcessBackend {
    /// The s3csi binary to run as `bin mount ...`.
    bin: PathBuf,
    /// Where each mounter's stderr goes: `<logs>/<key>.log`.
    logs: PathBuf,
}

impl ProcessBackend {
    pub fn new(bin: PathBuf, logs: PathBuf) -> Self {
        Self { bin, logs }
    }

    /// The log file of the mounter on `target`.
    pub fn log_file(&self, target: &Path) -> PathBuf {
        self.logs.join(format!("{}.log", super::key_for(target)))
    }
}

pub fn pid_alive(pid: u32) -> bool {
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

/// The exit flag of a mounter that is not our child (adopted from an earlier node
/// service, so no `wait` of ours sees it end): set once its pidfd says it has exited,
/// so that an unpublish after an upgrade waits no longer than one before it. Without
/// pidfds (Linux < 5.3) the process table is polled. The watch ends with the flag's last
/// other holder.
fn watch_exit(pid: u32) -> ExitFlag {
    let exited: ExitFlag = Arc::new(Mutex::new(None));
    let flag = exited.clone();
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let pidfd = (fd >= 0).then(|| {
        // SAFETY: a descriptor just returned to us, owned by nothing else.
        let owned =
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        // SAFETY: the AsyncFd owns the descriptor, which stays open and the same until
        // the AsyncFd is dropped.
        unsafe { tokio::io::unix::AsyncFd::register(owned) }
    });
    tokio::spawn(async move {
        match pidfd {
            // A pidfd is readable once its process has exited.
            Some(Ok(fd)) => {
                let _ = fd.readable().await;
            }
            _ => {
                while pid_alive(pid) {
                    if Arc::strong_count(&flag) == 1 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        tracing::info!(pid, "adopted mounter exited");
        *flag.lock().unwrap() = Some("exited (adopted: status unknown)".into());
    });
    exited
}

/// The static credentials a running mounter was given, from its environment.
fn credentials_of(pid: u32) -> Vec<(&'static str, String)> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('='))
        .filter_map(|(k, v)| {
            mount_credential_keys()
                .find(|key| *key == k)
                .map(|key| (key, v.to_string()))
        })
        .collect()
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
    }
}

/// The last line written to `log` since `offset`, secrets removed.
fn last_line(log: &Path, offset: u64, scrub: &[String]) -> String {
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

fn last_words(m: &MounterHandle, scrub: &[String]) -> String {
    match &m.log {
        Some((log, offset)) => last_line(log, *offset, scrub),
        None => "the mounter exited without a message".into(),
    }
}

#[async_trait]
impl MounterBackend for ProcessBackend {
    async fn start(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
        _generation: u32,
    ) -> Result<MounterHandle, MountError> {
        let log = self.log_file(&req.target);
        let logf = private_file(&log, true)
            .map_err(|e| MountError::other(format!("cannot open {}: {e}", log.display())))?;
        let offset = logf.metadata().map(|m| m.len()).unwrap_or(0);
        let pod_variables = req
            .env
            .iter()
            .any(|(k, _)| super::pod_credentials::VARIABLES.contains(k));
        if recover && !pod_variables && dir.join(super::pod_credentials::TOKEN_FILE).exists() {
            // It ran with a pod's own credentials, whose variables died with it (adopted
            // after it had exited): never replace them with the node's.
            return Err(MountError::other(
                "the mounter of a mount with a pod's credentials is gone with its variables; \
                 not replacing it with other credentials"
                    .to_string(),
            ));
        }
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
            // Given credentials replace the node's, including a stale session token, and
            // a pod's token exchange must not lose to the node's static keys.
            for k in [
                "AWS_PROFILE",
                "AWS_CONFIG_FILE",
                "AWS_SHARED_CREDENTIALS_FILE",
            ] {
                cmd.env_remove(k);
            }
            for k in mount_credential_keys() {
                cmd.env_remove(k);
            }
            if pod_variables {
                // The node's AWS_ENDPOINT_URL would send the token to the S3 endpoint's
                // STS; the mount's S3 endpoint is in its arguments.
                cmd.env_remove("AWS_ENDPOINT_URL");
            }
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
        let exited: ExitFlag = Arc::new(Mutex::new(None));
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
        let mut handle = MounterHandle::new(pid, None, exited);
        handle.log = Some((log, offset));
        Ok(handle)
    }

    fn answered_by(&self, m: &MounterHandle, pong: &str) -> bool {
        pong == format!("OK pid={}", m.pid)
    }

    fn gone(&self, m: &MounterHandle) -> Option<String> {
        if let Some(s) = m.exited.lock().unwrap().as_ref() {
            return Some(format!("{m} exited ({s})"));
        }
        // A child killed a moment ago is a zombie until the reaper task runs: it already
        // serves nothing, and a status probe now would only wait for its replacement.
        (!pid_alive(m.pid)).then(|| format!("{m} is gone"))
    }

    async fn kill(&self, m: &MounterHandle) {
        signal(m.pid, nix::sys::signal::Signal::SIGKILL);
    }

    async fn discard(&self, _m: &MounterHandle) {}

    async fn stop(&self, target: &Path, m: &MounterHandle, deadline: Instant) {
        let pid = m.pid;
        if pid == 0 || !pid_alive(pid) || !is_our_mounter(pid, target) {
            return;
        }
        signal(pid, nix::sys::signal::Signal::SIGTERM);
        while pid_alive(pid) {
            if Instant::now() >= deadline {
                tracing::warn!(pid, "mounter did not stop in time; killing it");
                signal(pid, nix::sys::signal::Signal::SIGKILL);
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn check_start(&self, _m: &MounterHandle) -> Result<(), MountError> {
        Ok(())
    }

    async fn exit_error(&self, m: &MounterHandle, scrub: &[String]) -> MountError {
        MountError::other(last_words(m, scrub))
    }

    fn start_timeout(&self, m: &MounterHandle, waited: Duration, scrub: &[String]) -> String {
        format!(
            "the mounter was not ready within {waited:?}; last mounter message: {}",
            last_words(m, scrub)
        )
    }

    fn adopt(&self, record: &MountRecord) -> (MounterHandle, bool) {
        let pid = record.pid;
        let alive = pid_alive(pid) && is_our_mounter(pid, &record.target);
        let exited = if alive {
            watch_exit(pid)
        } else {
            Arc::new(Mutex::new(Some("gone before it was adopted".into())))
        };
        (MounterHandle::new(pid, None, exited), alive)
    }

    fn replacement_credentials(&self, record: &MountRecord) -> Vec<(&'static str, String)> {
        credentials_of(record.pid)
    }

    async fn release(&self, _target: &Path) {}

    async fn reconcile(&self, _live: &[(PathBuf, MounterHandle)]) -> Result<(), MountError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 40.9: a mounter adopted after a node-service restart is not our child; its
    /// exit must still be seen, or every unpublish after an upgrade waits the whole grace.
    #[tokio::test]
    async fn an_adopted_mounter_is_seen_to_exit() {
        let target = std::env::temp_dir().join(format!("s3csi-adopt-{}", std::process::id()));
        // Looks like a mounter of `target` to `is_our_mounter`: `mount` and the target in
        // its command line.
        // Killed and reaped however the test ends, so no panic leaves it looping.
        struct Reaped(std::process::Child);
        impl Drop for Reaped {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let child = Reaped(
            std::process::Command::new("sh")
                .args(["-c", "while :; do sleep 0.1; done", "mount"])
                .arg(&target)
                .spawn()
                .unwrap(),
        );
        let record = MountRecord {
            volume_id: "adopted".into(),
            target: target.clone(),
            pid: child.0.id(),
            pod: None,
            handoff_dir: target.join("handoff"),
            replacements: 0,
            source: "bucket".into(),
            args: vec![],
        };
        // Its command line reads empty for a moment after spawn (seen under load).
        let settled = Instant::now() + Duration::from_secs(5);
        while !is_our_mounter(record.pid, &target) && Instant::now() < settled {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let backend = ProcessBackend::new("/nonexistent".into(), std::env::temp_dir());
        let (m, alive) = backend.adopt(&record);
        assert!(alive, "a live mounter of this target");
        assert!(!m.has_exited());
        backend
            .stop(&target, &m, Instant::now() + Duration::from_secs(10))
            .await;
        // `stop_and_unmount` gives an exit 5 s to be seen; it must not need them.
        let seen_by = Instant::now() + Duration::from_secs(4);
        while !m.has_exited() && Instant::now() < seen_by {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let seen = m.has_exited();
        drop(child);
        assert!(seen, "the adopted mounter's exit was not seen");
        // A record whose process is gone is adopted as exited.
        let (m, alive) = backend.adopt(&record);
        assert!(!alive && m.has_exited());
    }
}
