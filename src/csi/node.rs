//! CSI Node service: publish (mount), unpublish, stats and health of volumes on this node.
//!
//! Every request is validated in full before anything touches the system; one in-flight
//! operation per target path (a second concurrent one gets ABORTED); the mount itself is
//! the [`Mounter`]'s business.

use super::error::{CsiError, Result};
use super::pb::{self, node_server::Node};
use super::InFlight;
use crate::config::volume::{PublishInput, PublishSpec};
use crate::config::Endpoint;
use crate::mounter::{MountRequest, Mounter};
use pb::volume_capability::access_mode::Mode;
use pb::volume_capability::AccessType;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use tonic::{Request, Response, Status};
use tracing::{instrument, Span};

pub struct NodeService {
    pub node_id: String,
    pub mounter: Arc<dyn Mounter>,
    /// When set, every target path must be below it (kubelet's root dir).
    pub kubelet_dir: Option<PathBuf>,
    /// S3 location used when the volume context says nothing.
    pub defaults: Endpoint,
    pub in_flight: InFlight,
    /// For `authenticationSource: pod`.
    pub service_accounts: super::pod_identity::ServiceAccounts,
    /// Set once the mounts of an earlier node service are adopted: node calls wait for it.
    pub recovered: tokio::sync::watch::Receiver<bool>,
}

/// Checks a path kubelet hands us: absolute, no `..`, no control characters, under the
/// kubelet root if one is configured.
fn checked_path(field: &str, path: &str, root: Option<&Path>) -> Result<PathBuf> {
    if path.is_empty() {
        return Err(CsiError::invalid(format!("{field} is required")));
    }
    if path.chars().any(|c| c.is_control()) {
        return Err(CsiError::invalid(format!(
            "{field} contains control characters"
        )));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(CsiError::invalid(format!(
            "{field} {path:?} is not absolute"
        )));
    }
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(CsiError::invalid(format!("{field} {path:?} contains '..'")));
    }
    let clean: PathBuf = p.components().collect();
    if let Some(root) = root {
        if !clean.starts_with(root) || clean == root {
            return Err(CsiError::invalid(format!(
                "{field} {path:?} is not below the kubelet directory {}",
                root.display()
            )));
        }
    }
    Ok(clean)
}

/// The path NodeGetVolumeStats asks about. Volumes are published only at paths that
/// [`checked_path`] accepts, so no volume is at any other path: that is NotFound (the CSI
/// spec's "volume not found at that path"; csi-sanity sends the relative `some/path`), and
/// InvalidArgument is kept for an empty path. Such a path is never looked at: a relative
/// one would name something under our own working directory.
fn stats_path(volume_path: &str) -> Result<PathBuf> {
    if volume_path.is_empty() {
        return Err(CsiError::invalid("volume_path is required"));
    }
    checked_path("volume_path", volume_path, None)
        .map_err(|e| CsiError::NotFound(format!("no volume is published there: {e}")))
}

/// Validates a volume capability for a mount; returns whether its access mode is read-only.
pub(crate) fn check_capability(cap: Option<&pb::VolumeCapability>) -> Result<bool> {
    let cap = cap.ok_or_else(|| CsiError::invalid("volume_capability is required"))?;
    match &cap.access_type {
        Some(AccessType::Mount(m)) => {
            if !m.fs_type.is_empty() && m.fs_type != "s3csi" && m.fs_type != "fuse" {
                return Err(CsiError::invalid(format!(
                    "fs_type {:?} is not supported (leave it empty)",
                    m.fs_type
                )));
            }
        }
        Some(AccessType::Block(_)) => {
            return Err(CsiError::invalid(
                "block access is not supported: S3 volumes are file systems",
            ))
        }
        None => {
            return Err(CsiError::invalid(
                "volume_capability.access_type is required",
            ))
        }
    }
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode)
        .ok_or_else(|| CsiError::invalid("volume_capability.access_mode is required"))?;
    match Mode::try_from(mode) {
        Ok(Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly) => Ok(true),
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter
            | Mode::MultiNodeSingleWriter
            | Mode::MultiNodeMultiWriter,
        ) => Ok(false),
        _ => Err(CsiError::invalid(format!("unsupported access mode {mode}"))),
    }
}

impl NodeService {
    /// Waits until start-up recovery is done: before, a target's mount may not be known yet.
    async fn recovered(&self) {
        let mut r = self.recovered.clone();
        let _ = r.wait_for(|done| *done).await;
    }

    async fn publish(&self, req: pb::NodePublishVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required"));
        }
        let target = checked_path("target_path", &req.target_path, self.kubelet_dir.as_deref())?;
        let mode_read_only = check_capability(req.volume_capability.as_ref())?;
        let (mount_flags, mount_group) = match req
            .volume_capability
            .as_ref()
            .and_then(|c| c.access_type.as_ref())
        {
            Some(AccessType::Mount(m)) => (m.mount_flags.clone(), m.volume_mount_group.clone()),
            _ => (Vec::new(), String::new()),
        };
        let spec = PublishSpec::parse(PublishInput {
            volume_id: &req.volume_id,
            volume_context: &req.volume_context,
            publish_context: &req.publish_context,
            secrets: &req.secrets,
            mount_flags: &mount_flags,
            volume_mount_group: &mount_group,
            read_only: req.readonly || mode_read_only,
            defaults: &self.defaults,
        })?;

        let _guard = self.in_flight.try_begin(&target)?;
        let pod_credentials = match &spec.pod_auth {
            Some(auth) => Some(self.service_accounts.credentials(auth).await?),
            None => None,
        };
        let credentials = spec.credentials.clone();
        let request = MountRequest {
            volume_id: spec.volume_id.clone(),
            target: target.clone(),
            source: spec.source_arg(),
            args: spec.mount_args(),
            env: credentials.as_ref().map(|c| c.env()).unwrap_or_default(),
            scrub: credentials
                .as_ref()
                .map(|c| {
                    let mut v = vec![c.secret_access_key().to_string()];
                    v.extend(c.session_token().map(str::to_string));
                    v
                })
                .unwrap_or_default(),
            kernel: crate::mounter::handoff::KernelMount {
                fsname: format!("s3csi:{}", spec.source.bucket),
                read_only: spec.read_only || spec.config.read_only,
                allow_other: spec.config.allow_other || spec.config.allow_root,
                no_default_permissions: spec.config.no_default_permissions,
            },
            keep_cache: spec.keep_cache,
            pod_credentials,
        };
        // status() may probe the mount, which waits while a mounter is being replaced:
        // keep it off the async workers' queues.
        let status = tokio::task::block_in_place(|| self.mounter.status(&target));
        match (&status.volume_id, &status.mounted) {
            (Some(v), Some(_))
                if *v == req.volume_id
                    && (status.problem.is_none() || status.recoverable || status.slow) =>
            {
                // Published already (kubelet republishes every minute or so with
                // `requiresRepublish`): a mount whose mounter is being replaced, or is
                // too busy to answer the probe, stays as it is. A republish brings the
                // pod's fresh token.
                if let Some(c) = &request.pod_credentials {
                    self.mounter.refresh(&request).await?;
                    tracing::debug!(
                        service_account = c.service_account,
                        "refreshed the pod's token"
                    );
                } else {
                    tracing::debug!(problem = ?status.problem, "already published");
                }
                return Ok(());
            }
            (Some(v), Some(_)) if *v != req.volume_id => {
                return Err(CsiError::AlreadyExists(format!(
                    "target path already has volume {v:?} mounted"
                )));
            }
            (None, Some(entry)) if status.problem.is_none() => {
                return Err(CsiError::AlreadyExists(format!(
                    "target path is already a mount point ({} {})",
                    entry.fs_type, entry.source
                )));
            }
            (Some(_), _) | (None, Some(_)) => {
                // Ours but dead (mounter exited, ENOTCONN) or a stale leftover: clear it and
                // mount again.
                tracing::warn!(problem = ?status.problem, "replacing a broken mount");
                self.mounter.unmount(&target).await?;
            }
            (None, None) => {}
        }

        std::fs::create_dir_all(&target)
            .map_err(|e| CsiError::Internal(format!("cannot create {}: {e}", target.display())))?;
        tracing::info!(
            source = %request.source,
            args = ?request.args,
            static_credentials = credentials.is_some(),
            pod_credentials = ?request.pod_credentials,
            "mounting"
        );
        if let Err(e) = self.mounter.mount(request).await {
            let _ = std::fs::remove_dir(&target);
            tracing::warn!(error = %e, "mount failed");
            return Err(e.into());
        }
        tracing::info!("published");
        Ok(())
    }

    async fn unpublish(&self, req: pb::NodeUnpublishVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required"));
        }
        let target = checked_path("target_path", &req.target_path, self.kubelet_dir.as_deref())?;
        let _guard = self.in_flight.try_begin(&target)?;
        self.mounter.unmount(&target).await?;
        match std::fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(CsiError::Internal(format!(
                    "cannot remove {}: {e}",
                    target.display()
                )))
            }
        }
        tracing::info!("unpublished");
        Ok(())
    }

    async fn stats(
        &self,
        req: pb::NodeGetVolumeStatsRequest,
    ) -> Result<pb::NodeGetVolumeStatsResponse> {
        use pb::volume_usage::Unit;
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required"));
        }
        let path = stats_path(&req.volume_path)?;
        // status() may probe the mount, which waits while a mounter is being replaced:
        // keep it off the async workers' queues.
        let status = tokio::task::block_in_place(|| self.mounter.status(&path));
        let Some(published) = &status.volume_id else {
            return Err(CsiError::NotFound(if status.mounted.is_some() {
                // Another file system's mount point: its usage is not the volume's.
                format!(
                    "{} is a mount point, but not of a volume this node published",
                    path.display()
                )
            } else if std::fs::symlink_metadata(&path).is_err() {
                format!("{} does not exist", path.display())
            } else {
                format!("no volume is published at {}", path.display())
            }));
        };
        if *published != req.volume_id {
            return Err(CsiError::NotFound(format!(
                "{} holds volume {published:?}, not {:?}",
                path.display(),
                req.volume_id
            )));
        }
        let condition = |abnormal: bool, message: String| pb::VolumeCondition { abnormal, message };
        if let Some(problem) = status.problem {
            return Ok(pb::NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(condition(true, problem)),
            });
        }
        let serving = match status.replacements {
            0 => "mounted and serving".to_string(),
            n => format!(
                "mounted and serving; the mounter was replaced {n} time(s), last because {}",
                status.last_replacement.as_deref().unwrap_or("it died")
            ),
        };
        // statvfs waits (up to the timeout) on a mount whose mounter does not answer: a
        // blocking call, kept off the async workers.
        let mounter = self.mounter.clone();
        let usage = tokio::task::spawn_blocking(move || mounter.usage(&path))
            .await
            .map_err(|e| CsiError::Internal(format!("the statvfs task failed: {e}")))?;
        let signed = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        match usage {
            Ok(u) => {
                let (total, free) = (signed(u.total_bytes), signed(u.free_bytes));
                let (itotal, ifree) = (signed(u.total_inodes), signed(u.free_inodes));
                Ok(pb::NodeGetVolumeStatsResponse {
                    usage: vec![
                        pb::VolumeUsage {
                            available: signed(u.available_bytes),
                            total,
                            used: (total - free).max(0),
                            unit: Unit::Bytes as i32,
                        },
                        pb::VolumeUsage {
                            available: ifree,
                            total: itotal,
                            used: (itotal - ifree).max(0),
                            unit: Unit::Inodes as i32,
                        },
                    ],
                    volume_condition: Some(condition(false, serving)),
                })
            }
            Err(e) => Ok(pb::NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(condition(true, e.to_string())),
            }),
        }
    }
}

fn record(volume_id: &str, path: &str) {
    let span = Span::current();
    span.record("volume_id", volume_id);
    span.record("target_path", path);
}

#[tonic::async_trait]
impl Node for NodeService {
    #[instrument(skip_all, fields(volume_id, target_path))]
    async fn node_publish_volume(
        &self,
        request: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        record(&req.volume_id, &req.target_path);
        tracing::debug!(request = ?req, "NodePublishVolume");
        self.recovered().await;
        self.publish(req).await?;
        Ok(Response::new(pb::NodePublishVolumeResponse {}))
    }

    #[instrument(skip_all, fields(volume_id, target_path))]
    async fn node_unpublish_volume(
        &self,
        request: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        record(&req.volume_id, &req.target_path);
        tracing::debug!(request = ?req, "NodeUnpublishVolume");
        self.recovered().await;
        self.unpublish(req).await?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    #[instrument(skip_all, fields(volume_id, target_path))]
    async fn node_get_volume_stats(
        &self,
        request: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        record(&req.volume_id, &req.volume_path);
        self.recovered().await;
        Ok(Response::new(self.stats(req).await?))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        use pb::node_service_capability::{rpc::Type, Rpc, Type as Cap};
        let capabilities = [
            Type::GetVolumeStats,
            Type::VolumeCondition,
            Type::VolumeMountGroup,
        ]
        .into_iter()
        .map(|t| pb::NodeServiceCapability {
            r#type: Some(Cap::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect();
        Ok(Response::new(pb::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_paths() {
        let root = Path::new("/var/lib/kubelet");
        assert!(checked_path("t", "/var/lib/kubelet/pods/x/mount", Some(root)).is_ok());
        for bad in [
            "",
            "relative/x",
            "/var/lib/kubelet/../etc",
            "/etc/x",
            "/var/lib/kubelet",
        ] {
            assert!(checked_path("t", bad, Some(root)).is_err(), "{bad}");
        }
        assert!(checked_path("t", "/a/\n", None).is_err());
    }

    #[test]
    fn stats_paths_that_cannot_hold_a_volume_are_not_found() {
        assert!(matches!(stats_path(""), Err(CsiError::InvalidArgument(_))));
        for nowhere in ["some/path", "/a/../b", "/a/\n"] {
            assert!(
                matches!(stats_path(nowhere), Err(CsiError::NotFound(_))),
                "{nowhere:?}"
            );
        }
        assert_eq!(
            stats_path("/var/lib/kubelet/pods/x/").unwrap(),
            Path::new("/var/lib/kubelet/pods/x")
        );
    }
}
