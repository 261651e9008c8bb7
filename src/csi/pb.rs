//! The CSI v1 messages and services generated from proto/csi.proto by build.rs.
//!
//! Requests that carry secrets (`[(csi_secret) = true]`) do not derive `Debug`; the impls
//! below print every field but show only the keys of `secrets`, so logging a request with
//! `?request` can never leak a credential.
#![allow(clippy::all, missing_docs, rustdoc::all)]

tonic::include_proto!("csi.v1");

/// Shows a secrets map as its keys only.
struct Redacted<'a>(&'a std::collections::HashMap<String, String>);

impl std::fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.0.keys().collect();
        keys.sort();
        f.debug_map()
            .entries(keys.into_iter().map(|k| (k, "<redacted>")))
            .finish()
    }
}

macro_rules! redacted_debug {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {$(
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($ty))
                    $(.field(stringify!($field), &self.$field))*
                    .field("secrets", &Redacted(&self.secrets))
                    .finish()
            }
        }
    )*};
}

redacted_debug! {
    CreateVolumeRequest { name, capacity_range, volume_capabilities, parameters,
        volume_content_source, accessibility_requirements, mutable_parameters }
    DeleteVolumeRequest { volume_id }
    ControllerPublishVolumeRequest { volume_id, node_id, volume_capability, readonly, volume_context }
    ControllerUnpublishVolumeRequest { volume_id, node_id }
    ValidateVolumeCapabilitiesRequest { volume_id, volume_context, volume_capabilities,
        parameters, mutable_parameters }
    ControllerModifyVolumeRequest { volume_id, mutable_parameters }
    CreateSnapshotRequest { source_volume_id, name, parameters }
    DeleteSnapshotRequest { snapshot_id }
    ListSnapshotsRequest { max_entries, starting_token, source_volume_id, snapshot_id }
    ControllerExpandVolumeRequest { volume_id, capacity_range, volume_capability }
    NodeStageVolumeRequest { volume_id, publish_context, staging_target_path,
        volume_capability, volume_context }
    NodeExpandVolumeRequest { volume_id, volume_path, capacity_range, staging_target_path,
        volume_capability }
    CreateVolumeGroupSnapshotRequest { name, source_volume_ids, parameters }
    DeleteVolumeGroupSnapshotRequest { group_snapshot_id, snapshot_ids }
    GetVolumeGroupSnapshotRequest { group_snapshot_id, snapshot_ids }
}

/// A volume context with kubelet's service-account tokens replaced by their audiences.
struct Context<'a>(&'a std::collections::HashMap<String, String>);

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::config::volume::CTX_TOKENS;
        let mut keys: Vec<&String> = self.0.keys().collect();
        keys.sort();
        let mut m = f.debug_map();
        for k in keys {
            if k == CTX_TOKENS {
                m.entry(k, &"<redacted>");
            } else {
                m.entry(k, &self.0[k]);
            }
        }
        m.finish()
    }
}

impl std::fmt::Debug for NodePublishVolumeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePublishVolumeRequest")
            .field("volume_id", &self.volume_id)
            .field("publish_context", &self.publish_context)
            .field("staging_target_path", &self.staging_target_path)
            .field("target_path", &self.target_path)
            .field("volume_capability", &self.volume_capability)
            .field("readonly", &self.readonly)
            .field("volume_context", &Context(&self.volume_context))
            .field("secrets", &Redacted(&self.secrets))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show_in_debug() {
        let req = NodePublishVolumeRequest {
            volume_id: "bkt".into(),
            secrets: [("secretAccessKey".to_string(), "s3cr3t-value".to_string())].into(),
            volume_context: [(
                crate::config::volume::CTX_TOKENS.to_string(),
                r#"{"sts.amazonaws.com":{"token":"eyJhbGciOi-jwt"}}"#.to_string(),
            )]
            .into(),
            ..Default::default()
        };
        let text = format!("{req:?}");
        assert!(
            text.contains("secretAccessKey") && !text.contains("s3cr3t-value"),
            "{text}"
        );
        assert!(
            text.contains("serviceAccount.tokens") && !text.contains("eyJhbGciOi"),
            "{text}"
        );
    }
}
