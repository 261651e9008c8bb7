//! Compiles proto/csi.proto (the CSI spec) and proto/pluginregistration.proto (the kubelet's
//! plugin-registration API) with protox, a pure-Rust protobuf compiler, so building needs no
//! system `protoc`. Generates both the servers (ours) and the clients (used by the
//! integration tests and `s3csi demo`; for registration, the tests play the kubelet).

/// Request messages carrying a `secrets` map (`[(csi_secret) = true]` in the spec). Their
/// `Debug` is not derived; src/csi/pb.rs implements one that prints secret keys only.
const SECRET_BEARING: &[&str] = &[
    "csi.v1.CreateVolumeRequest",
    "csi.v1.DeleteVolumeRequest",
    "csi.v1.ControllerPublishVolumeRequest",
    "csi.v1.ControllerUnpublishVolumeRequest",
    "csi.v1.ValidateVolumeCapabilitiesRequest",
    "csi.v1.ControllerModifyVolumeRequest",
    "csi.v1.CreateSnapshotRequest",
    "csi.v1.DeleteSnapshotRequest",
    "csi.v1.ListSnapshotsRequest",
    "csi.v1.ControllerExpandVolumeRequest",
    "csi.v1.NodeStageVolumeRequest",
    "csi.v1.NodePublishVolumeRequest",
    "csi.v1.NodeExpandVolumeRequest",
    "csi.v1.CreateVolumeGroupSnapshotRequest",
    "csi.v1.DeleteVolumeGroupSnapshotRequest",
    "csi.v1.GetVolumeGroupSnapshotRequest",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    println!("cargo:rerun-if-changed=proto/pluginregistration.proto");
    let fds = protox::compile(["csi.proto", "pluginregistration.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .generate_default_stubs(true)
        .skip_debug(SECRET_BEARING.iter().map(|m| format!(".{m}")))
        .compile_fds(fds)?;
    Ok(())
}
