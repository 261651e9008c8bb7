//! Replacing mounters that die while their mount is held: every [`SUPERVISE_EVERY`] the
//! supervisor looks for dead ones, starts `s3csi mount --recover` through the backend and
//! hands it the same descriptor. Every replacement is logged and counted; a failed one is
//! retried with a growing pause (2 s … 32 s).

use super::manager::MountManager;
use super::SUPERVISE_EVERY;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl MountManager {
    /// Starts the supervisor task; it ends when the manager is dropped.
    pub fn start_supervisor(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SUPERVISE_EVERY).await;
                let Some(me) = me.upgrade() else { return };
                for target in me.due_for_replacement() {
                    me.replace(&target).await;
                }
            }
        });
    }

    fn due_for_replacement(&self) -> Vec<PathBuf> {
        let now = Instant::now();
        self.mounts
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, t)| {
                t.fuse_fd.is_some()
                    && !t.stopping
                    && t.replacing.is_none()
                    && t.retry_at.is_none_or(|r| r <= now)
                    && self.backend.gone(&t.mounter).is_some()
            })
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Starts a replacement for the dead mounter of `target` and hands it the descriptor.
    pub(super) async fn replace(&self, target: &Path) {
        let op = self.op_lock(target);
        let _op = op.lock().await;
        let (volume_id, old, reason, fd, req, dir, n) = {
            let mut mounts = self.mounts.lock().unwrap();
            let Some(t) = mounts.get_mut(target) else {
                return;
            };
            let Some(reason) = self.backend.gone(&t.mounter) else {
                return;
            };
            let Some(fd) = t.fuse_fd.clone() else { return };
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
                t.mounter.clone(),
                reason,
                fd,
                req,
                t.handoff_dir.clone(),
                t.replacements + 1,
            )
        };
        let started = Instant::now();
        tracing::warn!(
            volume_id,
            target = %target.display(),
            old_pid = old.pid,
            %reason,
            replacement = n,
            "mounter died; starting a replacement with the same FUSE descriptor"
        );
        let result = async {
            self.backend.discard(&old).await;
            // The dead one's socket goes too, or the new one's watch would take it for a
            // dead mounter.
            let _ = std::fs::remove_file(super::handoff::control_socket(&dir));
            let m = self.start_mounter(&req, &dir, true, n).await?;
            if let Err(e) = self.hand_over(&m, &dir, &fd).await {
                self.backend.kill(&m).await;
                return Err(e);
            }
            Ok(m)
        }
        .await;
        let mut mounts = self.mounts.lock().unwrap();
        let Some(t) = mounts.get_mut(target) else {
            return;
        };
        t.replacing = None;
        match result {
            Ok(m) => {
                let total = self.replacements_total.fetch_add(1, Ordering::Relaxed) + 1;
                t.mounter = m.clone();
                t.replacements = n;
                t.failures = 0;
                t.retry_at = None;
                t.last_replacement = Some(reason.clone());
                drop(mounts);
                self.write_state(target);
                tracing::warn!(
                    volume_id,
                    target = %target.display(),
                    pid = m.pid,
                    pod = m.pod.as_deref().unwrap_or(""),
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
}
