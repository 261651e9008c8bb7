//! CSI Identity service: name, version, capabilities, readiness.

use super::pb::{self, identity_server::Identity};
use tonic::{Request, Response, Status};

pub struct IdentityService {
    pub driver_name: String,
    pub controller: bool,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: self.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        use pb::plugin_capability::{service::Type, Service, Type as Cap};
        let mut capabilities = Vec::new();
        if self.controller {
            capabilities.push(pb::PluginCapability {
                r#type: Some(Cap::Service(Service {
                    r#type: Type::ControllerService as i32,
                })),
            });
        }
        Ok(Response::new(pb::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        Ok(Response::new(pb::ProbeResponse { ready: Some(true) }))
    }
}
