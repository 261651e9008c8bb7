//! CSI Controller service: dynamic provisioning. Each PVC gets its own prefix in the
//! StorageClass's bucket (`bucket/basePrefix/<PV name>`); DeleteVolume removes every object
//! under that prefix and nothing outside it.
//!
//! DeleteVolume receives only the volume id and the provisioner secrets, so the S3
//! endpoint and region it uses are the driver's defaults (`--s3-endpoint-url`,
//! `--s3-region`, `--s3-force-path-style`); a StorageClass's own `endpointUrl`/`region`
//! apply to CreateVolume and to the node.

use super::error::{CsiError, Result};
use super::node::check_capability;
use super::pb::{self, controller_server::Controller};
use super::InFlight;
use crate::config::volume::{
    Credentials, StorageClassParams, VolumeHandle, KEY_BUCKET, KEY_ENDPOINT_URL,
    KEY_FORCE_PATH_STYLE, KEY_PREFIX, KEY_REGION,
};
use crate::s3::{ListRequest, ObjectClient};
use crate::{config::Endpoint, s3::aws::AwsClient};
use bytes::Bytes;
use std::collections::HashMap;
use std::path::Path;
use tonic::{Request, Response, Status};
use tracing::{instrument, Span};

pub struct ControllerService {
    pub defaults: Endpoint,
    pub in_flight: InFlight,
}

async fn client_for(
    bucket: &str,
    endpoint: &Endpoint,
    secrets: &HashMap<String, String>,
) -> Result<AwsClient> {
    Ok(match Credentials::from_secrets(secrets)? {
        Some(c) => {
            AwsClient::with_static_credentials(
                bucket,
                endpoint,
                c.access_key_id(),
                c.secret_access_key(),
                c.session_token(),
            )
            .await
        }
        None => AwsClient::new(bucket, endpoint).await,
    })
}

/// Deletes every object under `prefix` (which must not be empty); returns how many.
pub async fn delete_prefix(client: &dyn ObjectClient, prefix: &str) -> Result<usize> {
    assert!(!prefix.is_empty(), "refusing to delete a whole bucket");
    let mut deleted = 0;
    loop {
        // Always list from the start: the keys of the previous page are gone.
        let page = client
            .list(ListRequest {
                prefix,
                delimiter: None,
                continuation: None,
                max_keys: 1000,
            })
            .await?;
        let keys: Vec<String> = page
            .objects
            .into_iter()
            .map(|o| o.key)
            .filter(|k| k.starts_with(prefix))
            .collect();
        if keys.is_empty() {
            return Ok(deleted);
        }
        deleted += client.delete_objects(keys).await?;
    }
}

impl ControllerService {
    async fn create(&self, req: pb::CreateVolumeRequest) -> Result<pb::Volume> {
        if req.name.is_empty() {
            return Err(CsiError::invalid("name is required"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::invalid("volume_capabilities is required"));
        }
        for cap in &req.volume_capabilities {
            check_capability(Some(cap))?;
        }
        if req.volume_content_source.is_some() {
            return Err(CsiError::invalid(
                "creating a volume from a snapshot or another volume is not supported",
            ));
        }
        let params = StorageClassParams::parse(&req.parameters)?;
        let handle = params.volume_for(&req.name)?;
        let volume_id = handle.id();
        Span::current().record("volume_id", volume_id.as_str());
        let _guard = self
            .in_flight
            .try_begin(Path::new(&format!("volume:{volume_id}")))?;
        let endpoint = params.location.or(&self.defaults);
        let client = client_for(&handle.bucket, &endpoint, &req.secrets).await?;
        // The marker makes the prefix exist (and show as a directory); writing it again is
        // harmless, which makes CreateVolume idempotent.
        client.put_object(&handle.prefix, Bytes::new()).await?;
        let mut ctx = HashMap::from([
            (KEY_BUCKET.to_string(), handle.bucket.clone()),
            (KEY_PREFIX.to_string(), handle.prefix.clone()),
        ]);
        if let Some(r) = &params.location.region {
            ctx.insert(KEY_REGION.into(), r.clone());
        }
        if let Some(u) = &params.location.endpoint_url {
            ctx.insert(KEY_ENDPOINT_URL.into(), u.clone());
        }
        if let Some(f) = params.location.force_path_style {
            ctx.insert(KEY_FORCE_PATH_STYLE.into(), f.to_string());
        }
        let capacity = req
            .capacity_range
            .as_ref()
            .map(|c| {
                if c.required_bytes > 0 {
                    c.required_bytes
                } else {
                    c.limit_bytes
                }
            })
            .unwrap_or(0)
            .max(0);
        tracing::info!(volume_id, "volume created");
        Ok(pb::Volume {
            capacity_bytes: capacity,
            volume_id,
            volume_context: ctx,
            content_source: None,
            accessible_topology: vec![],
        })
    }

    async fn delete(&self, req: pb::DeleteVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required"));
        }
        let handle = match VolumeHandle::parse(&req.volume_id) {
            Ok(h) => h,
            Err(e) => {
                // Not one of ours: nothing of it exists here.
                tracing::warn!(error = %e, "DeleteVolume for an unparseable volume id");
                return Ok(());
            }
        };
        if handle.prefix.is_empty() {
            return Err(CsiError::invalid(
                "refusing to delete a volume that is a whole bucket; only prefixes made by CreateVolume are deleted",
            ));
        }
        let _guard = self
            .in_flight
            .try_begin(Path::new(&format!("volume:{}", req.volume_id)))?;
        let client = client_for(&handle.bucket, &self.defaults, &req.secrets).await?;
        match delete_prefix(&client, &handle.prefix).await {
            Ok(n) => {
                tracing::info!(deleted = n, "volume deleted");
                Ok(())
            }
            Err(CsiError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    #[instrument(skip_all, fields(volume_id))]
    async fn create_volume(
        &self,
        request: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        tracing::debug!(request = ?req, "CreateVolume");
        let volume = self.create(req).await?;
        Ok(Response::new(pb::CreateVolumeResponse {
            volume: Some(volume),
        }))
    }

    #[instrument(skip_all, fields(volume_id))]
    async fn delete_volume(
        &self,
        request: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        Span::current().record("volume_id", req.volume_id.as_str());
        tracing::debug!(request = ?req, "DeleteVolume");
        self.delete(req).await?;
        Ok(Response::new(pb::DeleteVolumeResponse {}))
    }

    #[instrument(skip_all, fields(volume_id))]
    async fn validate_volume_capabilities(
        &self,
        request: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        Span::current().record("volume_id", req.volume_id.as_str());
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required").into());
        }
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::invalid("volume_capabilities is required").into());
        }
        if let Err(e) = VolumeHandle::parse(&req.volume_id) {
            return Err(CsiError::NotFound(e.to_string()).into());
        }
        for cap in &req.volume_capabilities {
            if let Err(e) = check_capability(Some(cap)) {
                return Ok(Response::new(pb::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: e.to_string(),
                }));
            }
        }
        Ok(Response::new(pb::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        use pb::controller_service_capability::{rpc::Type, Rpc, Type as Cap};
        Ok(Response::new(pb::ControllerGetCapabilitiesResponse {
            capabilities: vec![pb::ControllerServiceCapability {
                r#type: Some(Cap::Rpc(Rpc {
                    r#type: Type::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }
}
