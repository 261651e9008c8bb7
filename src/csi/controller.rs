//! CSI Controller service: dynamic provisioning. Each PVC gets its own prefix in the
//! StorageClass's bucket (`bucket/basePrefix/<PV name>`), and a record of it beside the
//! prefix ([`volume_record`]); DeleteVolume removes every object under a prefix that has
//! such a record, then the record, and nothing else: any other id (a whole bucket, a static
//! PV's prefix, an id it never made) is a volume that does not exist, which is OK.
//!
//! DeleteVolume receives only the volume id and the provisioner secrets, so the S3
//! endpoint and region it uses are the driver's defaults (`--s3-endpoint-url`,
//! `--s3-region`, `--s3-force-path-style`); a StorageClass's own `endpointUrl`/`region`
//! apply to CreateVolume and to the node.

use super::error::{CsiError, Result};
use super::node::check_capability;
use super::pb::{self, controller_server::Controller};
use super::volume_record::{self, Recorded, VolumeRecord, RECORDS_DIR};
use super::InFlight;
use crate::config::volume::{
    Credentials, StorageClassParams, VolumeContext, VolumeHandle, KEY_BUCKET, KEY_ENDPOINT_URL,
    KEY_FORCE_PATH_STYLE, KEY_PREFIX, KEY_REGION,
};
use crate::config::Endpoint;
use crate::s3::aws::AwsClient;
use crate::s3::{ListRequest, ObjectClient, S3Error};
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
                start_after: None,
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

/// A CreateVolume capacity range, validated: at least `required` bytes, at most `limit`
/// (0: no bound). Buckets have no size, so a capacity is only recorded, never enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RequestedCapacity {
    required: i64,
    limit: i64,
}

impl RequestedCapacity {
    fn parse(range: Option<&pb::CapacityRange>) -> Result<Self> {
        let Some(range) = range else {
            return Ok(Self {
                required: 0,
                limit: 0,
            });
        };
        let (required, limit) = (range.required_bytes, range.limit_bytes);
        if required < 0 || limit < 0 {
            return Err(CsiError::invalid(format!(
                "capacity_range {required}..{limit}: bytes cannot be negative"
            )));
        }
        if limit > 0 && required > limit {
            return Err(CsiError::invalid(format!(
                "capacity_range: required_bytes {required} exceeds limit_bytes {limit}"
            )));
        }
        Ok(Self { required, limit })
    }

    /// The capacity a new volume gets: the required bytes, else the limit, else 0 (none
    /// asked for).
    fn capacity(&self) -> i64 {
        if self.required > 0 {
            self.required
        } else {
            self.limit
        }
    }

    /// Whether a volume of `capacity` bytes is within this range (the CSI spec's
    /// "compatible with the specified capacity_range").
    fn admits(&self, capacity: i64) -> bool {
        (self.required == 0 || capacity >= self.required)
            && (self.limit == 0 || capacity <= self.limit)
    }
}

impl std::fmt::Display for RequestedCapacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.required, self.limit) {
            (0, 0) => write!(f, "any capacity"),
            (r, 0) => write!(f, "at least {r} bytes"),
            (0, l) => write!(f, "at most {l} bytes"),
            (r, l) => write!(f, "{r} to {l} bytes"),
        }
    }
}

/// A record at a volume's record key that we did not write, or a damaged one: nothing is
/// decided on it (neither taking the prefix over nor deleting it).
fn unreadable_record(why: String) -> CsiError {
    CsiError::Internal(format!(
        "{why}; refusing to act on it: remove or repair it by hand"
    ))
}

/// Refuses a prefix that holds objects CreateVolume did not write: as a volume's, they
/// would go with its DeleteVolume. The prefix's marker alone (an empty directory, or a
/// volume made before records existed and never written to) is taken over.
async fn ensure_unclaimed(
    client: &dyn ObjectClient,
    handle: &VolumeHandle,
    name: &str,
) -> Result<()> {
    let page = client
        .list(ListRequest {
            prefix: &handle.prefix,
            delimiter: None,
            continuation: None,
            start_after: None,
            max_keys: 2,
        })
        .await?;
    if page.objects.iter().any(|o| o.key != handle.prefix) {
        return Err(CsiError::AlreadyExists(format!(
            "prefix {:?} of bucket {:?} already holds objects that CreateVolume did not write; \
             refusing to make volume {name:?} of it",
            handle.prefix, handle.bucket
        )));
    }
    Ok(())
}

/// NotFound unless the volume exists in S3: its bucket, and for a prefix, at least one
/// object under it (the marker of a volume CreateVolume made, or any data).
async fn ensure_exists(
    client: &dyn ObjectClient,
    volume_id: &str,
    bucket: &str,
    prefix: &str,
) -> Result<()> {
    let page = match client
        .list(ListRequest {
            prefix,
            delimiter: None,
            continuation: None,
            start_after: None,
            max_keys: 1,
        })
        .await
    {
        Ok(page) => page,
        Err(S3Error::NoSuchBucket | S3Error::NotFound) => {
            return Err(CsiError::NotFound(format!(
                "volume {volume_id:?} does not exist: there is no bucket {bucket:?}"
            )))
        }
        Err(e) => return Err(e.into()),
    };
    if !prefix.is_empty() && page.objects.is_empty() {
        return Err(CsiError::NotFound(format!(
            "volume {volume_id:?} does not exist: nothing is under prefix {prefix:?} of bucket {bucket:?}"
        )));
    }
    Ok(())
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
        let capacity = RequestedCapacity::parse(req.capacity_range.as_ref())?;
        let params = StorageClassParams::parse(&req.parameters)?;
        let handle = params.volume_for(&req.name)?;
        let record_key = volume_record::record_key(&handle.prefix).ok_or_else(|| {
            CsiError::invalid(format!(
                "volume name {:?} cannot name a prefix: {RECORDS_DIR} holds the volume records",
                req.name
            ))
        })?;
        let volume_id = handle.id();
        Span::current().record("volume_id", volume_id.as_str());
        let _guard = self
            .in_flight
            .try_begin(Path::new(&format!("volume:{volume_id}")))?;
        let endpoint = params.location.or(&self.defaults);
        let client = client_for(&handle.bucket, &endpoint, &req.secrets).await?;
        let record = match volume_record::read(&client, &record_key).await? {
            Recorded::Volume(existing) => {
                if existing.name != req.name {
                    return Err(CsiError::AlreadyExists(format!(
                        "prefix {:?} of bucket {:?} is volume {:?}, not {:?}",
                        handle.prefix, handle.bucket, existing.name, req.name
                    )));
                }
                if !capacity.admits(existing.capacity_bytes) {
                    return Err(CsiError::AlreadyExists(format!(
                        "volume {:?} exists with a capacity of {} bytes, not {capacity}",
                        existing.name, existing.capacity_bytes
                    )));
                }
                existing
            }
            Recorded::Nothing => {
                ensure_unclaimed(&client, &handle, &req.name).await?;
                let record = VolumeRecord {
                    name: req.name.clone(),
                    capacity_bytes: capacity.capacity(),
                };
                volume_record::write(&client, &record_key, &record).await?;
                record
            }
            Recorded::Unreadable(why) => return Err(unreadable_record(why)),
        };
        // The marker makes the prefix exist (and show as a directory). It is written after
        // the record, and again on a repeated request, so that the retry of a CreateVolume
        // interrupted between the two finishes it.
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
        ctx.extend(params.cache.context());
        ctx.extend(params.auth.context());
        tracing::info!(
            volume_id,
            capacity_bytes = record.capacity_bytes,
            "volume created"
        );
        Ok(pb::Volume {
            capacity_bytes: record.capacity_bytes,
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
        let Some(record_key) = volume_record::record_key(&handle.prefix) else {
            // Neither is ever a volume CreateVolume made.
            tracing::warn!(
                "DeleteVolume for a whole bucket or a records directory: nothing deleted"
            );
            return Ok(());
        };
        let _guard = self
            .in_flight
            .try_begin(Path::new(&format!("volume:{}", req.volume_id)))?;
        let client = client_for(&handle.bucket, &self.defaults, &req.secrets).await?;
        match volume_record::read(&client, &record_key).await {
            Ok(Recorded::Volume(_)) => {}
            Ok(Recorded::Nothing) | Err(CsiError::NotFound(_)) => {
                tracing::info!(
                    "no volume that CreateVolume made is there (any more): nothing deleted"
                );
                return Ok(());
            }
            Ok(Recorded::Unreadable(why)) => return Err(unreadable_record(why)),
            Err(e) => return Err(e),
        }
        let deleted = match delete_prefix(&client, &handle.prefix).await {
            Ok(n) => n,
            Err(CsiError::NotFound(_)) => 0,
            Err(e) => return Err(e),
        };
        // The record goes last: until then, the retry of an interrupted DeleteVolume still
        // knows that what is left under the prefix is a volume's.
        match client.delete_object(&record_key).await {
            Ok(()) | Err(S3Error::NotFound) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(deleted, "volume deleted");
        Ok(())
    }

    async fn validate(
        &self,
        req: pb::ValidateVolumeCapabilitiesRequest,
    ) -> Result<pb::ValidateVolumeCapabilitiesResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::invalid("volume_id is required"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::invalid("volume_capabilities is required"));
        }
        let handle =
            VolumeHandle::parse(&req.volume_id).map_err(|e| CsiError::NotFound(e.to_string()))?;
        // Where the node would mount it: the context may name the prefix and the endpoint.
        let context = VolumeContext::parse(&req.volume_context)?;
        if let Some(bucket) = context.bucket.as_ref().filter(|b| **b != handle.bucket) {
            return Err(CsiError::invalid(format!(
                "volume attribute bucket {bucket:?} differs from the volume id's bucket {:?}",
                handle.bucket
            )));
        }
        let prefix = context.prefix.as_deref().unwrap_or(&handle.prefix);
        let endpoint = context.location.or(&self.defaults);
        let client = client_for(&handle.bucket, &endpoint, &req.secrets).await?;
        ensure_exists(&client, &req.volume_id, &handle.bucket, prefix).await?;
        for cap in &req.volume_capabilities {
            if let Err(e) = check_capability(Some(cap)) {
                return Ok(pb::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: e.to_string(),
                });
            }
        }
        Ok(pb::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        })
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
        Ok(Response::new(self.validate(req).await?))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn range(required_bytes: i64, limit_bytes: i64) -> Result<RequestedCapacity> {
        RequestedCapacity::parse(Some(&pb::CapacityRange {
            required_bytes,
            limit_bytes,
        }))
    }

    #[test]
    fn capacity_ranges() {
        const GIB: i64 = 1 << 30;
        assert_eq!(RequestedCapacity::parse(None).unwrap().capacity(), 0);
        assert_eq!(range(10 * GIB, 10 * GIB).unwrap().capacity(), 10 * GIB);
        assert_eq!(range(0, 5 * GIB).unwrap().capacity(), 5 * GIB);
        for (required, limit) in [(-1, 0), (0, -1), (2, 1)] {
            assert!(
                matches!(range(required, limit), Err(CsiError::InvalidArgument(_))),
                "{required}..{limit}"
            );
        }
        // csi-sanity's "different capacity": 10 GiB exists, 20 GiB is asked for.
        assert!(!range(20 * GIB, 20 * GIB).unwrap().admits(10 * GIB));
        assert!(range(10 * GIB, 10 * GIB).unwrap().admits(10 * GIB));
        assert!(range(GIB, 0).unwrap().admits(10 * GIB));
        assert!(!range(0, 5 * GIB).unwrap().admits(10 * GIB));
        assert!(RequestedCapacity::parse(None).unwrap().admits(10 * GIB));
        // A volume made without a capacity has none to satisfy a requirement with.
        assert!(!range(GIB, 0).unwrap().admits(0));
    }
}
