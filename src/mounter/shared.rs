//! One mounter per volume per node. Publishes whose [`MountRequest::share_key`] is the same
//! share one FUSE mount: the first one mounts it at `SHARED_DIR/<key>/mount` (a directory of the
//! node's, not of any pod), and each publish bind-mounts that onto its own target; the last
//! unpublish unmounts it and stops its mounter. Every bind is the same FUSE connection, so
//! when a mounter dies the replacement the [`MountManager`] starts heals every target at once.
//! The targets of each shared mount are recorded in `STATE_DIR/shares/<key>.json`, so a
//! restarted node service finds them again ([`SharedMounts::recover`]).
//!
//! Shared inside NodePublishVolume rather than at NodeStageVolume: kubelet stages a volume
//! once per node whatever the pods, but the key also holds what differs per pod (read-only,
//! the fsGroup's gid, credentials), so two pods of one volume may need two mounters.

use super::kernel::{ProbeError, Usage};
use super::{
    blocking, write_private, MountError, MountManager, MountRequest, MountStatus, Mounter,
};
use async_trait::async_trait;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Share {
    volume_id: String,
    targets: BTreeSet<PathBuf>,
}

#[derive(Default)]
struct Table {
    shares: HashMap<String, Share>,
    by_target: HashMap<PathBuf, String>,
}

pub struct SharedMounts {
    inner: Arc<MountManager>,
    /// Where the shared FUSE mounts are made (on the node, and visible to the host).
    mounts_dir: PathBuf,
    /// Where their targets are recorded.
    records_dir: PathBuf,
    table: Mutex<Table>,
    /// One publish or unpublish at a time per shared mount.
    ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl SharedMounts {
    pub fn new(
        inner: Arc<MountManager>,
        mounts_dir: PathBuf,
        records_dir: PathBuf,
    ) -> std::io::Result<Self> {
        // Root's only: the shared mounts are reached through the pods' binds, not here.
        super::manager::private_dir(&mounts_dir)?;
        super::manager::private_dir(&records_dir)?;
        Ok(Self {
            inner,
            mounts_dir,
            records_dir,
            table: Mutex::new(Table::default()),
            ops: Mutex::new(HashMap::new()),
        })
    }

    /// Mounters running for this node's volumes (each may serve several targets).
    pub fn mounter_count(&self) -> usize {
        self.inner.mount_count()
    }

    /// Targets published on this node.
    pub fn target_count(&self) -> usize {
        let shared = self.table.lock().unwrap().by_target.len();
        let unshared = self
            .inner
            .tracked_targets()
            .iter()
            .filter(|t| !t.starts_with(&self.mounts_dir))
            .count();
        shared + unshared
    }

    fn op_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.ops
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default()
            .clone()
    }

    /// Where the shared mount of `key` is: `SHARED_DIR/<key>/mount` (a short last name:
    /// the mount's handoff directory is named after it, and holds a unix socket).
    fn primary(&self, key: &str) -> PathBuf {
        self.mounts_dir.join(key).join("mount")
    }

    /// Removes the shared mount's directories once it is unmounted.
    fn remove_primary(primary: &Path) {
        let _ = std::fs::remove_dir(primary);
        if let Some(parent) = primary.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }

    fn record_file(&self, key: &str) -> PathBuf {
        self.records_dir.join(format!("{key}.json"))
    }

    /// Writes (or, with no targets left, removes) the record of `key`.
    fn write_record(&self, key: &str) {
        let share = self.table.lock().unwrap().shares.get(key).cloned();
        let path = self.record_file(key);
        let Some(share) = share else {
            let _ = std::fs::remove_file(&path);
            return;
        };
        let text = serde_json::to_vec_pretty(&share).expect("a share always serialises");
        if let Err(e) = write_private(&path, &text) {
            tracing::warn!(error = %e, "cannot record the shared mount's targets");
        }
    }

    /// The shared mount `target` is bound to, if it is one.
    fn share_of(&self, target: &Path) -> Option<(String, Share)> {
        let table = self.table.lock().unwrap();
        let key = table.by_target.get(target)?;
        Some((key.clone(), table.shares.get(key)?.clone()))
    }

    /// Reads the records an earlier node service left (after [`MountManager::recover`]):
    /// targets that are still mounted are kept. Returns how many targets were found.
    pub fn recover(&self) -> usize {
        let Ok(dir) = std::fs::read_dir(&self.records_dir) else {
            return 0;
        };
        let mounted = self.inner.kernel.mounts();
        let mut table = self.table.lock().unwrap();
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let Some(key) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .map(str::to_string)
            else {
                continue;
            };
            let share: Share = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(record = %path.display(), error = e,
                        "dropping a shared-mount record");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let mut share = share;
            share
                .targets
                .retain(|t| super::mountinfo::topmost(&mounted, t).is_some_and(|e| e.is_fuse()));
            for t in &share.targets {
                table.by_target.insert(t.clone(), key.clone());
            }
            table.shares.insert(key, share);
        }
        table.by_target.len()
    }

    /// After [`Self::recover`] and [`MountManager::recover`]: stops the shared mounts no
    /// target uses any more (their last unpublish came while no node service ran, or the
    /// node service died between mounting and recording), then reconciles the backend.
    pub async fn reconcile(&self) -> Result<(), MountError> {
        let unused: Vec<PathBuf> = {
            let table = self.table.lock().unwrap();
            self.inner
                .tracked_targets()
                .into_iter()
                .filter(|p| p.starts_with(&self.mounts_dir))
                .filter(|p| {
                    let key = p
                        .parent()
                        .and_then(|k| k.file_name())
                        .and_then(|n| n.to_str())
                        .unwrap_or_default();
                    table.shares.get(key).is_none_or(|s| s.targets.is_empty())
                })
                .collect()
        };
        for primary in unused {
            tracing::info!(mount = %primary.display(), "stopping a shared mount no pod uses");
            if let Err(e) = self.inner.unmount(&primary).await {
                tracing::warn!(error = %e, "cannot stop an unused shared mount");
            }
            Self::remove_primary(&primary);
        }
        let empty: Vec<String> = {
            let mut table = self.table.lock().unwrap();
            let keys: Vec<String> = table
                .shares
                .iter()
                .filter(|(_, s)| s.targets.is_empty())
                .map(|(k, _)| k.clone())
                .collect();
            for k in &keys {
                table.shares.remove(k);
            }
            keys
        };
        for k in empty {
            self.write_record(&k);
        }
        self.inner.reconcile().await
    }

    /// Is the shared mount at `primary` serving (or being healed by a replacement)?
    async fn serves(&self, primary: &Path) -> bool {
        let (inner, p) = (self.inner.clone(), primary.to_path_buf());
        let st = blocking(move || inner.status(&p)).await;
        st.volume_id.is_some() && st.mounted.is_some() && (st.problem.is_none() || st.recoverable)
    }
}

#[async_trait]
impl Mounter for SharedMounts {
    async fn mount(&self, req: MountRequest) -> Result<(), MountError> {
        let key = req.share_key();
        let op = self.op_lock(&key);
        let _op = op.lock().await;
        let primary = self.primary(&key);
        let known = self.table.lock().unwrap().shares.contains_key(&key);
        if !(known && self.serves(&primary).await) {
            // None yet, or a dead one (its targets are rebound by their own republish).
            if self.inner.tracks(&primary) {
                self.inner.unmount(&primary).await?;
            }
            std::fs::create_dir_all(&primary).map_err(|e| {
                MountError::other(format!("cannot create {}: {e}", primary.display()))
            })?;
            let mut first = req.clone();
            first.target = primary.clone();
            if let Err(e) = self.inner.mount(first).await {
                Self::remove_primary(&primary);
                return Err(e);
            }
            tracing::info!(volume_id = req.volume_id, mount = %primary.display(),
                "started a mounter for the volume on this node");
            let mut table = self.table.lock().unwrap();
            table.shares.entry(key.clone()).or_insert_with(|| Share {
                volume_id: req.volume_id.clone(),
                targets: BTreeSet::new(),
            });
        } else if req.pod_credentials.is_some() {
            // Another pod of the same service account: its token is the newer one.
            let mut newer = req.clone();
            newer.target = primary.clone();
            self.inner.refresh(&newer).await?;
        }
        if let Err(e) = self.inner.kernel.bind(&primary, &req.target) {
            let unused = self
                .table
                .lock()
                .unwrap()
                .shares
                .get(&key)
                .is_none_or(|s| s.targets.is_empty());
            if unused {
                let _ = self.inner.unmount(&primary).await;
                self.table.lock().unwrap().shares.remove(&key);
                Self::remove_primary(&primary);
            }
            return Err(MountError::other(format!(
                "cannot bind the volume's mount onto {}: {e}",
                req.target.display()
            )));
        }
        {
            let mut table = self.table.lock().unwrap();
            if let Some(s) = table.shares.get_mut(&key) {
                s.targets.insert(req.target.clone());
            }
            table.by_target.insert(req.target.clone(), key.clone());
        }
        self.write_record(&key);
        Ok(())
    }

    async fn unmount(&self, target: &Path) -> Result<(), MountError> {
        let Some((key, _)) = self.share_of(target) else {
            // Not bound: a mount an earlier version made on the target itself, or nothing.
            return self.inner.unmount(target).await;
        };
        let op = self.op_lock(&key);
        let _op = op.lock().await;
        if self.inner.kernel.find(target).is_some() {
            self.inner.unmount_or_detach(target).await?;
        }
        let last = {
            let mut table = self.table.lock().unwrap();
            table.by_target.remove(target);
            let share = table.shares.get_mut(&key);
            let last = share.is_none_or(|s| {
                s.targets.remove(target);
                s.targets.is_empty()
            });
            if last {
                table.shares.remove(&key);
            }
            last
        };
        if last {
            let primary = self.primary(&key);
            self.inner.unmount(&primary).await?;
            Self::remove_primary(&primary);
            tracing::info!(mount = %primary.display(), "the volume's last target on this node is gone; its mounter stopped");
        }
        self.write_record(&key);
        Ok(())
    }

    fn status(&self, target: &Path) -> MountStatus {
        let Some((key, share)) = self.share_of(target) else {
            return self.inner.status(target);
        };
        let mut st = self.inner.status(&self.primary(&key));
        st.mounted = self.inner.kernel.find(target);
        if st.volume_id.is_none() {
            st.volume_id = Some(share.volume_id);
            st.problem = Some("the volume's shared mount on this node is gone".into());
            st.recoverable = false;
        } else if st.mounted.is_none() && st.problem.is_none() {
            st.problem = Some(format!("{} is no longer mounted", target.display()));
        }
        st
    }

    fn usage(&self, target: &Path) -> Result<Usage, ProbeError> {
        self.inner.usage(target)
    }

    async fn refresh(&self, req: &MountRequest) -> Result<(), MountError> {
        let Some((key, _)) = self.share_of(&req.target) else {
            return self.inner.refresh(req).await;
        };
        if key != req.share_key() {
            // Its service account's role (or the volume's options) changed since it was
            // mounted: this mounter's credentials are not the pod's any more.
            return Err(MountError::other(format!(
                "{} is served by a mounter started for other credentials or options than \
                 this publish has; it keeps them until the pod restarts",
                req.target.display()
            )));
        }
        let op = self.op_lock(&key);
        let _op = op.lock().await;
        let mut primary = req.clone();
        primary.target = self.primary(&key);
        self.inner.refresh(&primary).await
    }
}
