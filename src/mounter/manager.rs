//! The mounts of this node: publish (start a mounter, mount, hand over), unpublish, status
//! and adoption of what an earlier node service left. Where mounters run is the backend's
//! business, the syscalls the kernel seam's.

use super::backend::{MounterBackend, MounterHandle};
use super::handoff;
use super::kernel::{Kernel, ProbeError, Usage, PROBE_TIMEOUT};
use super::state::MountRecord;
use super::{
    blocking, key_for, FailureKind, MountError, MountRequest, MountStatus, Mounter, Timeouts,
};
use async_trait::async_trait;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a busy mount is tried again before it is detached lazily.
const BUSY_RETRY_FOR: Duration = Duration::from_secs(1);

/// How often a starting mounter's backend is asked whether it will ever start.
const CHECK_START_EVERY: Duration = Duration::from_secs(1);

pub(super) struct Tracked {
    pub volume_id: String,
    pub mounter: MounterHandle,
    /// Our duplicate of the mount's /dev/fuse descriptor.
    pub fuse_fd: Option<Arc<OwnedFd>>,
    pub handoff_dir: PathBuf,
    /// What a replacement is started with; None when it could not be recovered.
    pub request: Option<MountRequest>,
    /// Unmount in progress (or not serving yet): do not replace.
    pub stopping: bool,
    /// A replacement is starting, for this reason.
    pub replacing: Option<String>,
    pub replacements: u32,
    pub last_replacement: Option<String>,
    /// Failed replacement attempts in a row, and when to try again.
    pub failures: u32,
    pub retry_at: Option<Instant>,
}

impl Tracked {
    fn new(volume_id: String, mounter: MounterHandle, handoff_dir: PathBuf) -> Self {
        Tracked {
            volume_id,
            mounter,
            fuse_fd: None,
            handoff_dir,
            request: None,
            stopping: false,
            replacing: None,
            replacements: 0,
            last_replacement: None,
            failures: 0,
            retry_at: None,
        }
    }
}

/// Creates `dir` (and its parents), readable by its owner only: mount records and mounter
/// logs name volumes, buckets and paths.
pub(super) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// The file in a kept cache's volume directory whose mtime is the cache's last use.
pub(super) const LAST_USED: &str = "last-used";

fn mark_used(volume_dir: &Path) {
    let _ = std::fs::write(volume_dir.join(LAST_USED), b"");
}

/// Bytes the files below `dir` take on disk.
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => dirs.push(entry.path()),
                Ok(m) => total += m.blocks() * 512,
                Err(_) => {}
            }
        }
    }
    total
}

pub struct MountManager {
    pub(super) kernel: Arc<dyn Kernel>,
    pub(super) backend: Arc<dyn MounterBackend>,
    state_dir: PathBuf,
    pub(super) timeouts: Timeouts,
    pub(super) mounts: Mutex<HashMap<PathBuf, Tracked>>,
    /// One mount, unmount or replacement at a time per target.
    ops: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    pub(super) replacements_total: AtomicU64,
    /// Linking a kept cache to a new mount and collecting idle ones exclude each other.
    kept_caches: Mutex<()>,
}

impl MountManager {
    /// Creates the state directory, private to its owner (see `private_dir`).
    pub fn new(
        kernel: Arc<dyn Kernel>,
        backend: Arc<dyn MounterBackend>,
        state_dir: PathBuf,
        timeouts: Timeouts,
    ) -> std::io::Result<Self> {
        for dir in [
            state_dir.clone(),
            state_dir.join("mounts"),
            state_dir.join("handoff"),
        ] {
            private_dir(&dir)?;
        }
        Ok(Self {
            kernel,
            backend,
            state_dir,
            timeouts,
            mounts: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            replacements_total: AtomicU64::new(0),
            kept_caches: Mutex::new(()),
        })
    }

    /// The directory mounter logs go to (process mode).
    pub fn logs_dir(state_dir: &Path) -> std::io::Result<PathBuf> {
        let dir = state_dir.join("logs");
        private_dir(&dir)?;
        Ok(dir)
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

    /// Removes a mount's handoff directory. Edits its mounters could not commit (their
    /// `cache/lost+found`, see `fs::staging`) are moved to `STATE_DIR/lost+found/` first:
    /// they outlive the mount, and the log says where they are.
    fn remove_handoff_dir(&self, dir: &Path) {
        // Edits a dead mounter kept for upload (`--write-back`) cannot be uploaded from
        // here: they join lost+found (opening the area moves the other uncommitted ones).
        let cache = dir.join("cache");
        if cache.is_dir() {
            if let Ok(area) = crate::fs::staging::StagingArea::open(&cache, u64::MAX) {
                for mut kept in area.take_recovered() {
                    kept.keep_lost("the volume was unpublished before its upload");
                }
            }
        }
        let lost = cache.join(crate::fs::staging::LOST_FOUND);
        let has_any = std::fs::read_dir(&lost).is_ok_and(|mut d| d.next().is_some());
        if has_any {
            let name = dir
                .file_name()
                .map(|n| n.to_os_string())
                .unwrap_or_default();
            let keep = self.state_dir.join(crate::fs::staging::LOST_FOUND);
            let mut to = keep.join(&name);
            let mut n = 1;
            while to.exists() {
                to = keep.join(format!("{}.{n}", name.to_string_lossy()));
                n += 1;
            }
            match std::fs::create_dir_all(&keep).and_then(|_| std::fs::rename(&lost, &to)) {
                Ok(()) => tracing::warn!(kept = %to.display(),
                    "edits the mount could not commit to S3 are kept on the node"),
                Err(e) => tracing::warn!(error = %e, lost = %lost.display(),
                    "cannot keep the mount's uncommitted edits"),
            }
        }
        // A kept cache's idle time starts when its last mount goes (see
        // `collect_kept_caches`).
        if let Ok(kept) = std::fs::read_link(cache.join("data")) {
            if let Some(volume_dir) = kept.parent() {
                mark_used(volume_dir);
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Where the data cache of a volume published with `keepCache` lives:
    /// `STATE_DIR/cache/<volume>/data`, which the mount's `cache/data` links to. Removing the
    /// handoff directory at unpublish removes the link, not what it points to, so the next
    /// publish of the volume on this node (and its pod-mode mounter, which gets that
    /// directory as a hostPath of its own) finds the data again.
    fn keep_cache(&self, volume_id: &str, handoff: &Path) -> Result<(), MountError> {
        let volume_dir = self.kept_caches_dir().join(key_for(Path::new(volume_id)));
        let kept = volume_dir.join("data");
        let cache = handoff.join("cache");
        let _collecting = self.kept_caches.lock().unwrap();
        let made = private_dir(&kept)
            .and_then(|_| private_dir(&cache))
            .and_then(|_| std::os::unix::fs::symlink(&kept, cache.join("data")));
        mark_used(&volume_dir);
        made.map_err(|e| {
            MountError::other(format!(
                "cannot keep the data cache in {}: {e}",
                kept.display()
            ))
        })
    }

    fn kept_caches_dir(&self) -> PathBuf {
        self.state_dir.join("cache")
    }

    /// Removes the kept data caches (`keepCache`) that no mount on this node links to and
    /// whose last mount went more than `max_idle` ago: a volume deleted, or no longer used
    /// on this node, would otherwise hold its cache's disk for ever. Returns the bytes
    /// freed. Run at start and then hourly by the node service (`--kept-cache-max-idle`).
    pub fn collect_kept_caches(&self, max_idle: Duration) -> u64 {
        let root = self.kept_caches_dir();
        let Ok(volumes) = std::fs::read_dir(&root) else {
            return 0;
        };
        let _linking = self.kept_caches.lock().unwrap();
        let in_use: HashSet<PathBuf> = std::fs::read_dir(self.state_dir.join("handoff"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|d| std::fs::read_link(d.path().join("cache").join("data")).ok())
            .collect();
        let mut freed = 0;
        for volume in volumes.flatten() {
            let dir = volume.path();
            if in_use.contains(&dir.join("data")) {
                continue;
            }
            let idle = std::fs::metadata(dir.join(LAST_USED))
                .or_else(|_| std::fs::metadata(&dir))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok());
            if idle.is_none_or(|idle| idle < max_idle) {
                continue;
            }
            let bytes = disk_usage(&dir);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    freed += bytes;
                    tracing::info!(cache = %dir.display(), bytes, idle_s = idle.map(|d| d.as_secs()),
                        "removed a kept data cache no mount used for --kept-cache-max-idle");
                }
                Err(e) => tracing::warn!(cache = %dir.display(), error = %e,
                    "cannot remove an idle kept data cache"),
            }
        }
        freed
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

    /// Whether a mount on `target` is tracked (starting, serving, replaced or stopping).
    pub fn tracks(&self, target: &Path) -> bool {
        self.mounts.lock().unwrap().contains_key(target)
    }

    /// Where the tracked mounts are.
    pub fn tracked_targets(&self) -> Vec<PathBuf> {
        self.mounts.lock().unwrap().keys().cloned().collect()
    }

    /// (volume ID, handoff directory) of every mount whose mounter serves (not starting,
    /// being replaced or unmounted): where the metrics endpoint asks for mounter metrics.
    pub fn mounter_endpoints(&self) -> Vec<(String, PathBuf)> {
        let mounts = self.mounts.lock().unwrap();
        mounts
            .values()
            .filter(|t| !t.stopping && t.replacing.is_none())
            .map(|t| (t.volume_id.clone(), t.handoff_dir.clone()))
            .collect()
    }

    pub(super) fn op_lock(&self, target: &Path) -> Arc<tokio::sync::Mutex<()>> {
        self.ops
            .lock()
            .unwrap()
            .entry(target.to_path_buf())
            .or_default()
            .clone()
    }

    pub(super) fn write_state(&self, target: &Path) {
        let record = {
            let mounts = self.mounts.lock().unwrap();
            let Some(t) = mounts.get(target) else {
                return;
            };
            let Some(req) = &t.request else { return };
            MountRecord {
                volume_id: t.volume_id.clone(),
                target: target.to_path_buf(),
                pid: t.mounter.pid,
                pod: t.mounter.pod.clone(),
                handoff_dir: t.handoff_dir.clone(),
                replacements: t.replacements,
                source: req.source.clone(),
                args: req.args.clone(),
            }
        };
        let path = self.state_file(target);
        if let Err(e) = super::write_private(&path, record.to_json().as_bytes()) {
            tracing::warn!(error = %e, "cannot record the mount in the state directory");
        }
    }

    fn remove_state(&self, target: &Path) {
        let _ = std::fs::remove_file(self.state_file(target));
        self.remove_handoff_dir(&self.handoff_dir(target));
    }

    /// Adopts the mounts an earlier node service left running (records whose target is
    /// still mounted or whose mounter still answers); forgets the others. Serving
    /// mounters give their descriptor back over their control socket, so they can be
    /// replaced later. Returns how many were adopted.
    pub fn recover(&self) -> usize {
        let Ok(dir) = std::fs::read_dir(self.state_dir.join("mounts")) else {
            return 0;
        };
        let mounted = self.kernel.mounts();
        let mut adopted = Vec::new();
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("state") {
                continue;
            }
            let record = match MountRecord::read(&path) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "dropping a mount record");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let is_mounted =
                super::mountinfo::topmost(&mounted, &record.target).is_some_and(|e| e.is_fuse());
            let (mounter, alive) = self.backend.adopt(&record);
            if !is_mounted && !alive {
                tracing::info!(volume_id = record.volume_id, target = %record.target.display(),
                    "forgetting a mount that is gone");
                let _ = std::fs::remove_file(&path);
                self.remove_handoff_dir(&self.handoff_dir(&record.target));
                continue;
            }
            adopted.push((record, mounter, alive));
        }
        // Each mounter may take seconds to answer: ask them all at once, a batch at a time.
        let mut descriptors = Vec::with_capacity(adopted.len());
        for batch in adopted.chunks(64) {
            std::thread::scope(|scope| {
                let asks: Vec<_> = batch
                    .iter()
                    .map(|(record, _, alive)| {
                        let dir = &record.handoff_dir;
                        scope.spawn(move || {
                            alive.then(|| handoff::collect_fd(dir, Duration::from_secs(5)))
                        })
                    })
                    .collect();
                descriptors.extend(asks.into_iter().map(|a| a.join().ok().flatten()));
            });
        }
        let count = adopted.len();
        for ((record, mounter, _), descriptor) in adopted.into_iter().zip(descriptors) {
            let target = record.target.clone();
            let volume_id = record.volume_id.as_str();
            let mut t = Tracked::new(
                record.volume_id.clone(),
                mounter,
                record.handoff_dir.clone(),
            );
            t.replacements = record.replacements;
            match descriptor {
                Some(Ok(fd)) => t.fuse_fd = Some(Arc::new(fd)),
                Some(Err(e)) => tracing::warn!(volume_id, target = %target.display(), error = %e,
                    "cannot collect the FUSE descriptor; this mounter cannot be replaced if it dies"),
                None => {}
            }
            let env = self.backend.replacement_credentials(&record);
            t.request = Some(MountRequest {
                volume_id: record.volume_id.clone(),
                target: target.clone(),
                source: record.source.clone(),
                args: record.args.clone(),
                scrub: env
                    .iter()
                    .filter(|(k, _)| *k != "AWS_ACCESS_KEY_ID")
                    .map(|(_, v)| v.clone())
                    .collect(),
                env,
                kernel: handoff::KernelMount::default(),
                // The link to a kept cache is in the handoff directory already.
                keep_cache: false,
                // Its token is in the handoff directory, its variables in `env`.
                pod_credentials: None,
            });
            tracing::info!(
                volume_id,
                target = %target.display(),
                pid = record.pid,
                pod = record.pod.as_deref().unwrap_or(""),
                descriptor = t.fuse_fd.is_some(),
                "adopted mount"
            );
            self.mounts.lock().unwrap().insert(target, t);
        }
        count
    }

    /// After [`Self::recover`]: lets the backend delete mounter objects that belong to no
    /// mount any more (left by a node service that died between creating and recording
    /// them, or by a mount that is gone), and reports mounts whose mounter vanished while
    /// no node service held their descriptor.
    pub async fn reconcile(&self) -> Result<(), MountError> {
        let (live, orphaned): (Vec<(PathBuf, MounterHandle)>, Vec<String>) = {
            let mounts = self.mounts.lock().unwrap();
            let live = mounts
                .iter()
                .map(|(p, t)| (p.clone(), t.mounter.clone()))
                .collect();
            let orphaned = mounts
                .iter()
                .filter(|(_, t)| t.mounter.pod.is_some() && t.fuse_fd.is_none())
                .map(|(p, t)| format!("{} ({})", p.display(), t.volume_id))
                .collect();
            (live, orphaned)
        };
        self.backend.reconcile(&live).await?;
        for m in orphaned {
            tracing::error!(
                mount = m,
                "this mount lost its mounter pod while no node service held its descriptor; \
                it reports abnormal until the volume is unpublished and published again"
            );
        }
        Ok(())
    }

    /// Starts a mounter for `req` (a replacement when `recover`) and waits until it
    /// listens on its control socket (it checked the bucket first).
    pub(super) async fn start_mounter(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
        generation: u32,
    ) -> Result<MounterHandle, MountError> {
        // A failure left by an earlier mounter of this directory is not this one's.
        handoff::clear_failure(dir);
        let m = self.backend.start(req, dir, recover, generation).await?;
        if let Err(e) = self.wait_listening(&m, dir, &req.scrub).await {
            self.backend.kill(&m).await;
            return Err(e);
        }
        Ok(m)
    }

    async fn wait_listening(
        &self,
        m: &MounterHandle,
        dir: &Path,
        scrub: &[String],
    ) -> Result<(), MountError> {
        let deadline = Instant::now() + self.timeouts.mount;
        let mut next_check = Instant::now() + CHECK_START_EVERY;
        loop {
            let d = dir.to_path_buf();
            let pong = blocking(move || -> std::io::Result<String> {
                let s = handoff::connect(&d, Duration::from_secs(2))?;
                handoff::send(&s, "PING", None)?;
                Ok(handoff::recv(&s)?.0)
            })
            .await;
            if pong.is_ok_and(|l| self.backend.answered_by(m, &l)) {
                return Ok(());
            }
            if m.has_exited() {
                return Err(match handoff::read_failure(dir) {
                    Some(f) => f.into(),
                    None => self.backend.exit_error(m, scrub).await,
                });
            }
            if Instant::now() >= next_check {
                if let Err(e) = self.backend.check_start(m).await {
                    // A mounter that ran and gave up said why, better than its Pod does.
                    return Err(handoff::read_failure(dir).map_or(e, Into::into));
                }
                next_check = Instant::now() + CHECK_START_EVERY;
            }
            if Instant::now() >= deadline {
                let message = match handoff::read_failure(dir) {
                    Some(f) => format!(
                        "the mounter was not ready within {:?}; last mounter message: {f}",
                        self.timeouts.mount
                    ),
                    None => self.backend.start_timeout(m, self.timeouts.mount, scrub),
                };
                return Err(MountError {
                    kind: FailureKind::Timeout,
                    message,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Hands `fd` to the (listening) mounter and waits until it serves.
    pub(super) async fn hand_over(
        &self,
        m: &MounterHandle,
        dir: &Path,
        fd: &Arc<OwnedFd>,
    ) -> Result<(), MountError> {
        let d = dir.to_path_buf();
        let f = fd.clone();
        let timeout = self.timeouts.mount;
        let refused = match blocking(move || handoff::serve_fd(&d, f.as_raw_fd(), timeout)).await {
            Ok(()) => return Ok(()),
            Err(refused) => refused,
        };
        // If it died instead of answering, the failure it recorded says more.
        tokio::time::sleep(Duration::from_millis(100)).await;
        Err(match (m.has_exited(), handoff::read_failure(dir)) {
            (true, Some(f)) => f.into(),
            _ => refused.into(),
        })
    }

    /// Stops the mounter, unmounts, and waits a moment for our child to be reaped.
    async fn stop_and_unmount(
        &self,
        target: &Path,
        mounter: Option<&MounterHandle>,
    ) -> Result<(), MountError> {
        let deadline = Instant::now() + self.timeouts.unmount;
        if let Some(m) = mounter {
            self.backend.stop(target, m, deadline).await;
            self.backend.release(target).await;
        }
        if self.kernel.find(target).is_some() {
            self.unmount_or_detach(target).await?;
        }
        if let Some(m) = mounter {
            let grace = Instant::now() + Duration::from_secs(5);
            while !m.has_exited() && Instant::now() < grace {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// `umount2`; while the mount is busy (a workload still has files open) it is tried
    /// again for [`BUSY_RETRY_FOR`], then detached lazily: its mounter is already gone, so
    /// nobody else would ever unmount it, and kubelet waits for us.
    pub(super) async fn unmount_or_detach(&self, target: &Path) -> Result<(), MountError> {
        let until = Instant::now() + BUSY_RETRY_FOR;
        loop {
            match self.kernel.unmount(target, false) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) if self.kernel.find(target).is_none() => {
                    tracing::debug!(error = %e, "unmounted meanwhile");
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "unmount failed; detaching lazily");
                    return self.kernel.unmount(target, true).map_err(|e| {
                        MountError::other(format!("cannot unmount {}: {e}", target.display()))
                    });
                }
            }
        }
    }
}

#[async_trait]
impl Mounter for MountManager {
    async fn mount(&self, req: MountRequest) -> Result<(), MountError> {
        let op = self.op_lock(&req.target);
        let _op = op.lock().await;
        let dir = self.handoff_dir(&req.target);
        self.remove_handoff_dir(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| MountError::other(format!("cannot create {}: {e}", dir.display())))?;
        if req.keep_cache {
            self.keep_cache(&req.volume_id, &dir)?;
        }
        let mut req = req;
        if let Some(c) = &req.pod_credentials {
            let env = c.install(&dir).map_err(|e| {
                MountError::other(format!(
                    "cannot write the pod's token into {}: {e}",
                    dir.display()
                ))
            })?;
            req.env.extend(env);
        }
        handoff::clear_failure(&dir);
        let m = match self.backend.start(&req, &dir, false, 0).await {
            Ok(m) => m,
            Err(e) => {
                self.backend.release(&req.target).await;
                self.remove_handoff_dir(&dir);
                return Err(e);
            }
        };
        let mut tracked = Tracked::new(req.volume_id.clone(), m.clone(), dir.clone());
        tracked.stopping = true; // not replaceable until it serves
        self.mounts
            .lock()
            .unwrap()
            .insert(req.target.clone(), tracked);
        let result = async {
            self.wait_listening(&m, &dir, &req.scrub).await?;
            let fd = self
                .kernel
                .mount_fuse(&req.target, &req.kernel)
                .map_err(|e| MountError {
                    kind: if e.raw_os_error() == Some(libc::EPERM) {
                        FailureKind::PermissionDenied
                    } else {
                        FailureKind::Other
                    },
                    message: format!("cannot mount on {}: {e}", req.target.display()),
                })?;
            let fd = Arc::new(fd);
            if let Err(e) = self.hand_over(&m, &dir, &fd).await {
                let _ = self.kernel.unmount(&req.target, true);
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
                self.backend.kill(&m).await;
                self.backend.release(&req.target).await;
                self.mounts.lock().unwrap().remove(&req.target);
                self.remove_handoff_dir(&dir);
                Err(e)
            }
        }
    }

    async fn unmount(&self, target: &Path) -> Result<(), MountError> {
        let op = self.op_lock(target);
        let _op = op.lock().await;
        let mounter = {
            let mut mounts = self.mounts.lock().unwrap();
            mounts.get_mut(target).map(|t| {
                t.stopping = true;
                t.mounter.clone()
            })
        };
        self.stop_and_unmount(target, mounter.as_ref()).await?;
        // Dropping our descriptor closes the connection for good.
        self.mounts.lock().unwrap().remove(target);
        self.remove_state(target);
        Ok(())
    }

    fn usage(&self, target: &Path) -> Result<Usage, ProbeError> {
        self.kernel.usage_within(target, PROBE_TIMEOUT)
    }

    async fn refresh(&self, req: &MountRequest) -> Result<(), MountError> {
        let Some(c) = &req.pod_credentials else {
            return Ok(());
        };
        let (dir, started_with) = match self.mounts.lock().unwrap().get(&req.target) {
            Some(t) => (
                t.handoff_dir.clone(),
                t.request.as_ref().and_then(|r| r.pod_credentials.clone()),
            ),
            None => return Ok(()),
        };
        if started_with.is_some_and(|s| s.identity() != c.identity()) {
            return Err(MountError::other(format!(
                "the mount on {} was made for other credentials than {} has now",
                req.target.display(),
                c.service_account
            )));
        }
        c.write_token(&dir).map_err(|e| {
            MountError::other(format!(
                "cannot write the pod's token into {}: {e}",
                dir.display()
            ))
        })
    }

    fn status(&self, target: &Path) -> MountStatus {
        let mounted = self.kernel.find(target);
        let mounts = self.mounts.lock().unwrap();
        let Some(t) = mounts.get(target) else {
            drop(mounts);
            return MountStatus {
                problem: mounted.as_ref().and_then(|_| self.kernel.probe(target)),
                mounted,
                ..Default::default()
            };
        };
        let dead = self.backend.gone(&t.mounter);
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
            pid: Some(t.mounter.pid),
            mounted,
            problem,
            recoverable,
            slow: false,
            replacements: t.replacements,
            last_replacement: t.last_replacement.clone(),
        };
        drop(mounts);
        if status.problem.is_none() {
            // Only now: a probe of a mount without a live mounter would wait.
            let probed = self.kernel.usage_within(target, PROBE_TIMEOUT).err();
            return MountStatus {
                slow: matches!(probed, Some(ProbeError::NoAnswer(..))),
                problem: probed.map(|e| e.to_string()),
                ..status
            };
        }
        status
    }
}
