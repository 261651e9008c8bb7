//! Built-in kubelet plugin registration (`s3csi csi --register-with-kubelet DIR`): the part
//! of the node-driver-registrar sidecar that the kubelet talks to, served by the node plugin
//! itself.
//!
//! The kubelet watches its `plugins_registry` directory; for a new socket there it calls
//! `GetInfo` (we answer: a CSI plugin, our driver name, the CSI socket's path on the node and
//! the CSI versions we speak), then calls `NodeGetInfo` on that CSI socket, records the node
//! in the CSINode object, and tells us the outcome with `NotifyRegistrationStatus`. Removing
//! the socket (we do at shutdown) unregisters the driver; the next start registers again.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// The messages and the service generated from proto/pluginregistration.proto.
#[allow(clippy::all, missing_docs, rustdoc::all)]
pub mod pb {
    tonic::include_proto!("pluginregistration");
}

use pb::registration_server::{Registration, RegistrationServer};

/// The CSI versions we tell the kubelet we support.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// `DIR/<driver>-reg.sock`, the name the kubelet's docs (and node-driver-registrar) use.
pub fn socket_in(dir: &Path, driver_name: &str) -> PathBuf {
    dir.join(format!("{driver_name}-reg.sock"))
}

/// What the kubelet said last: None before it answered, else whether it registered us and
/// its error otherwise.
pub type LastStatus = Arc<Mutex<Option<Result<(), String>>>>;

pub struct RegistrationService {
    info: pb::PluginInfo,
    status: LastStatus,
}

impl RegistrationService {
    /// `endpoint` is the CSI socket's path as the kubelet (on the node) reaches it.
    pub fn new(driver_name: &str, endpoint: &Path) -> Self {
        RegistrationService {
            info: pb::PluginInfo {
                r#type: "CSIPlugin".to_string(),
                name: driver_name.to_string(),
                endpoint: endpoint.to_string_lossy().into_owned(),
                supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
            },
            status: LastStatus::default(),
        }
    }

    pub fn status(&self) -> LastStatus {
        self.status.clone()
    }

    pub fn into_server(self) -> RegistrationServer<Self> {
        RegistrationServer::new(self)
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::PluginInfo>, Status> {
        tracing::info!(endpoint = %self.info.endpoint, "the kubelet asked for our registration");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pb::RegistrationStatus>,
    ) -> Result<Response<pb::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.info.name, "registered with the kubelet");
            *self.status.lock().unwrap() = Some(Ok(()));
        } else {
            tracing::error!(
                driver = %self.info.name,
                error = %status.error,
                "the kubelet refused our registration"
            );
            *self.status.lock().unwrap() = Some(Err(status.error));
        }
        Ok(Response::new(pb::RegistrationStatusResponse {}))
    }
}
