//! Malformed CSI requests against a real `s3csi csi` server (node + controller, with
//! `--kubelet-dir` set): every field missing, empty, oversized or odd, path traversal in
//! volume ids and target paths, targets outside the kubelet directory, unknown options.
//! Each gets the right gRPC code and a message naming the field; nothing is mounted or
//! deleted; the server never panics and still serves afterwards. Also: secrets stay out of
//! argv, logs and errors, and the socket and state files are private.

use crate::common;

use common::node_service::{mount_cap, rw, CsiServer, Mode};
use common::{is_mountpoint, new_bucket, scratch_dir};
use s3csi::csi::pb::{self, volume_capability as vc};
use s3csi::s3::ObjectClient;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::Code;

const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYBADINPUTKEY";
const AKID: &str = "AKIDBADINPUT";

/// Node and controller in one process, with `--kubelet-dir` set and debug logs.
fn start() -> CsiServer {
    CsiServer::options(scratch_dir("badcsi"))
        .mode(Mode::All)
        .node_id("bad-node")
        .kubelet_dir()
        .env("RUST_LOG", "debug")
        .start()
}

/// Still alive and answering.
async fn assert_serving(server: &mut CsiServer) {
    assert!(server.is_running(), "the server exited");
    let mut id = server.identity().await;
    let probe = id.probe(pb::ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    assert!(
        !server.log_text().contains("panicked"),
        "{}",
        server.log_text()
    );
}

type Edit = Box<dyn Fn(&mut pb::NodePublishVolumeRequest)>;

fn big(n: usize) -> String {
    "a".repeat(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_node_requests_get_the_right_code_and_never_panic() {
    let mut server = start();
    let bucket = new_bucket("badnode");
    let mut node = server.node().await;
    let target = server.target("p1");
    let t = target.to_string_lossy().to_string();
    let kubelet = server.kubelet_dir().unwrap().to_string_lossy().to_string();
    let base = pb::NodePublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: t.clone(),
        volume_capability: Some(rw()),
        volume_context: HashMap::new(),
        ..Default::default()
    };
    let mib = big(1 << 20);
    let with_flags = |flags: &'static [&'static str]| -> Edit {
        Box::new(move |r| {
            r.volume_capability = Some(mount_cap(
                flags,
                vc::access_mode::Mode::SingleNodeWriter,
                "",
            ))
        })
    };
    let ctx = |k: &'static str, v: String| -> Edit {
        Box::new(move |r| {
            r.volume_context.insert(k.to_string(), v.clone());
        })
    };
    let mib2 = mib.clone();
    let mib3 = mib.clone();
    let t2 = t.clone();
    let k2 = kubelet.clone();
    let k3 = kubelet.clone();
    let cases: Vec<(&str, Edit, Code, &str)> = vec![
        (
            "empty volume id",
            Box::new(|r| r.volume_id.clear()),
            Code::InvalidArgument,
            "volume_id",
        ),
        (
            "1 MiB volume id",
            Box::new(move |r| r.volume_id = mib2.clone()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "1 MiB prefix in id",
            Box::new(move |r| r.volume_id = format!("b-k-t/{mib3}")),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "traversal in id",
            Box::new(|r| r.volume_id = "bkt/../../etc".into()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "dot in id",
            Box::new(|r| r.volume_id = "bkt/./x".into()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "empty component in id",
            Box::new(|r| r.volume_id = "bkt/a//b".into()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "newline in id",
            Box::new(|r| r.volume_id = "bkt/a\nb".into()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "NUL in id",
            Box::new(|r| r.volume_id = "bkt/a\0b".into()),
            Code::InvalidArgument,
            "volume handle",
        ),
        (
            "uppercase bucket",
            Box::new(|r| r.volume_id = "BUCKET".into()),
            Code::InvalidArgument,
            "BUCKET",
        ),
        (
            "empty target",
            Box::new(|r| r.target_path.clear()),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "relative target",
            Box::new(|r| r.target_path = "pods/x".into()),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "traversal in target",
            Box::new(move |r| r.target_path = format!("{k2}/pods/../../../etc/x")),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "target outside kubelet dir",
            Box::new(|r| r.target_path = "/etc/s3csi-x".into()),
            Code::InvalidArgument,
            "kubelet",
        ),
        (
            "kubelet dir itself",
            Box::new(move |r| r.target_path = k3.clone()),
            Code::InvalidArgument,
            "kubelet",
        ),
        (
            "kubelet dir prefix trick",
            Box::new(move |r| {
                r.target_path = format!("{}-evil/x", t2.split("/pods/").next().unwrap())
            }),
            Code::InvalidArgument,
            "kubelet",
        ),
        (
            "NUL in target",
            Box::new(|r| r.target_path.push('\0')),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "newline in target",
            Box::new(|r| r.target_path.push('\n')),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "1 MiB target",
            Box::new(move |r| r.target_path = format!("/{mib}")),
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "no capability",
            Box::new(|r| r.volume_capability = None),
            Code::InvalidArgument,
            "volume_capability",
        ),
        (
            "no access type",
            Box::new(|r| r.volume_capability.as_mut().unwrap().access_type = None),
            Code::InvalidArgument,
            "access_type",
        ),
        (
            "no access mode",
            Box::new(|r| r.volume_capability.as_mut().unwrap().access_mode = None),
            Code::InvalidArgument,
            "access_mode",
        ),
        (
            "access mode 999",
            Box::new(|r| {
                r.volume_capability.as_mut().unwrap().access_mode =
                    Some(vc::AccessMode { mode: 999 })
            }),
            Code::InvalidArgument,
            "access mode",
        ),
        (
            "fs type ext4",
            Box::new(|r| {
                r.volume_capability = Some(pb::VolumeCapability {
                    access_type: Some(vc::AccessType::Mount(vc::MountVolume {
                        fs_type: "ext4".into(),
                        ..Default::default()
                    })),
                    access_mode: Some(vc::AccessMode {
                        mode: vc::access_mode::Mode::SingleNodeWriter as i32,
                    }),
                })
            }),
            Code::InvalidArgument,
            "fs_type",
        ),
        (
            "unknown mount option",
            with_flags(&["allow-other", "frobnicate"]),
            Code::InvalidArgument,
            "frobnicate",
        ),
        (
            "argv injection in option",
            with_flags(&["--endpoint-url=http://evil"]),
            Code::InvalidArgument,
            "--endpoint-url",
        ),
        (
            "bad uid",
            with_flags(&["uid=-1"]),
            Code::InvalidArgument,
            "uid",
        ),
        (
            "bad mode",
            with_flags(&["file-mode=7777"]),
            Code::InvalidArgument,
            "file-mode",
        ),
        (
            "huge part size",
            with_flags(&["part-size=99999999999999999999G"]),
            Code::InvalidArgument,
            "part-size",
        ),
        (
            "comma in endpoint attribute (would smuggle an option)",
            ctx("endpointUrl", "http://a,uid=0".into()),
            Code::InvalidArgument,
            "endpoint-url",
        ),
        (
            "bad gid group",
            Box::new(|r| {
                r.volume_capability = Some(mount_cap(
                    &[],
                    vc::access_mode::Mode::SingleNodeWriter,
                    "wheel",
                ))
            }),
            Code::InvalidArgument,
            "volume_mount_group",
        ),
        (
            "unknown attribute",
            ctx("colour", "red".into()),
            Code::InvalidArgument,
            "colour",
        ),
        (
            "bad endpoint attribute",
            ctx("endpointUrl", "file:///etc/passwd".into()),
            Code::InvalidArgument,
            "endpoint-url",
        ),
        (
            "traversal in prefix attribute",
            ctx("prefix", "a/../../b".into()),
            Code::InvalidArgument,
            "prefix",
        ),
        (
            "bucket attribute differs",
            ctx("bucket", "other-bucket".into()),
            Code::InvalidArgument,
            "bucket",
        ),
        (
            "bad forcePathStyle",
            ctx("forcePathStyle", "sometimes".into()),
            Code::InvalidArgument,
            "forcePathStyle",
        ),
        (
            "10 000 unknown attributes",
            Box::new(|r| {
                for i in 0..10_000 {
                    r.volume_context.insert(format!("k{i:05}"), "v".into());
                }
            }),
            Code::InvalidArgument,
            "k00000",
        ),
        (
            "secret without id",
            Box::new(|r| {
                r.secrets.insert("secretAccessKey".into(), SECRET.into());
            }),
            Code::InvalidArgument,
            "accessKeyId",
        ),
        (
            "id without secret",
            Box::new(|r| {
                r.secrets.insert("accessKeyId".into(), AKID.into());
            }),
            Code::InvalidArgument,
            "secretAccessKey",
        ),
    ];
    let n = cases.len();
    for (name, edit, code, needle) in cases {
        let mut req = base.clone();
        edit(&mut req);
        let start = Instant::now();
        let err = node.node_publish_volume(req).await.unwrap_err();
        assert_eq!(
            err.code(),
            code,
            "{name}: {:?}",
            err.message().chars().take(300).collect::<String>()
        );
        assert!(
            err.message().contains(needle),
            "{name}: {:?}",
            err.message().chars().take(300).collect::<String>()
        );
        assert!(
            err.message().len() < 4096,
            "{name}: a {} byte message",
            err.message().len()
        );
        assert!(
            !err.message().contains(SECRET) && !err.message().contains(AKID),
            "{name}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{name}: {:?}",
            start.elapsed()
        );
        assert!(!is_mountpoint(&target), "{name}: mounted anyway");
    }
    assert!(!Path::new("/etc/s3csi-x").exists());

    // Above gRPC's 4 MiB message limit: refused by the transport, the server lives on.
    let mut huge = base.clone();
    huge.volume_context
        .insert("csi.storage.k8s.io/pod.name".into(), big(5 << 20));
    let err = node.node_publish_volume(huge).await.unwrap_err();
    assert!(
        matches!(
            err.code(),
            Code::ResourceExhausted | Code::OutOfRange | Code::InvalidArgument
        ),
        "{err:?}"
    );

    // Unpublish and stats validate the same way.
    let bad_unpublish = [
        ("", t.as_str(), Code::InvalidArgument, "volume_id"),
        (bucket.as_str(), "", Code::InvalidArgument, "target_path"),
        (
            bucket.as_str(),
            "rel/x",
            Code::InvalidArgument,
            "target_path",
        ),
        (
            bucket.as_str(),
            "/etc/passwd",
            Code::InvalidArgument,
            "kubelet",
        ),
        (
            bucket.as_str(),
            &format!("{kubelet}/pods/../../x"),
            Code::InvalidArgument,
            "..",
        ),
    ];
    for (id, path, code, needle) in bad_unpublish {
        let err = node
            .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: id.into(),
                target_path: path.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "unpublish {id:?} {path:?}: {err:?}");
        assert!(err.message().contains(needle), "{err:?}");
    }
    assert!(Path::new("/etc/passwd").exists());
    // Unpublishing what was never published is fine (idempotent).
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: server.target("never").to_string_lossy().into(),
    })
    .await
    .unwrap();
    for (id, path, code) in [
        ("", t.as_str(), Code::InvalidArgument),
        (bucket.as_str(), "", Code::InvalidArgument),
        (bucket.as_str(), "/nonexistent/s3csi", Code::NotFound),
        (bucket.as_str(), t.as_str(), Code::NotFound),
    ] {
        let err = node
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: id.into(),
                volume_path: path.into(),
                staging_target_path: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "stats {id:?} {path:?}: {err:?}");
    }
    assert_serving(&mut server).await;
    eprintln!(
        "bad node requests: {n} publish cases, 5 unpublish, 4 stats, 1 oversized: all refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_controller_requests_get_the_right_code_and_delete_nothing() {
    let mut server = start();
    let bucket = new_bucket("badctl");
    common::set_test_env();
    let c = s3csi::s3::aws::AwsClient::new(&bucket, &common::endpoint()).await;
    c.put_object("keep/me", bytes::Bytes::from_static(b"precious"))
        .await
        .unwrap();
    c.put_object("vol/a", bytes::Bytes::from_static(b"a"))
        .await
        .unwrap();
    let mut ctl = server.controller().await;
    let params = HashMap::from([("bucket".to_string(), bucket.clone())]);
    let base = pb::CreateVolumeRequest {
        name: "pvc-1".into(),
        volume_capabilities: vec![rw()],
        parameters: params.clone(),
        ..Default::default()
    };
    type CEdit = Box<dyn Fn(&mut pb::CreateVolumeRequest)>;
    let cases: Vec<(&str, CEdit, &str)> = vec![
        ("empty name", Box::new(|r| r.name.clear()), "name"),
        (
            "1 MiB name",
            Box::new(|r| r.name = big(1 << 20)),
            "volume name",
        ),
        (
            "dot-dot name",
            Box::new(|r| r.name = "..".into()),
            "volume name",
        ),
        (
            "no capabilities",
            Box::new(|r| r.volume_capabilities.clear()),
            "volume_capabilities",
        ),
        (
            "block capability",
            Box::new(|r| {
                r.volume_capabilities = vec![pb::VolumeCapability {
                    access_type: Some(vc::AccessType::Block(vc::BlockVolume {})),
                    access_mode: Some(vc::AccessMode { mode: 1 }),
                }]
            }),
            "block",
        ),
        (
            "no bucket parameter",
            Box::new(|r| r.parameters.clear()),
            "bucket",
        ),
        (
            "bad bucket parameter",
            Box::new(|r| {
                r.parameters.insert("bucket".into(), "../etc".into());
            }),
            "bucket",
        ),
        (
            "traversal in basePrefix",
            Box::new(|r| {
                r.parameters.insert("basePrefix".into(), "a/../..".into());
            }),
            "basePrefix",
        ),
        (
            "unknown parameter",
            Box::new(|r| {
                r.parameters.insert("colour".into(), "red".into());
            }),
            "colour",
        ),
        (
            "10 000 unknown parameters",
            Box::new(|r| {
                for i in 0..10_000 {
                    r.parameters.insert(format!("p{i:05}"), "v".into());
                }
            }),
            "p00000",
        ),
        (
            "half a secret",
            Box::new(|r| {
                r.secrets.insert("accessKeyId".into(), AKID.into());
            }),
            "secretAccessKey",
        ),
    ];
    for (name, edit, needle) in cases {
        let mut req = base.clone();
        edit(&mut req);
        let err = ctl.create_volume(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{name}: {:?}",
            err.message()
        );
        assert!(!err.message().contains(AKID), "{name}");
    }
    // DeleteVolume: traversal and whole-bucket ids delete nothing.
    for id in [
        format!("{bucket}/vol/.."),
        format!("{bucket}/../{bucket}"),
        format!("{bucket}//"),
        format!("{bucket}/"),
        bucket.clone(),
        format!("{bucket}/keep/../vol"),
    ] {
        let res = ctl
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: id.clone(),
                secrets: HashMap::new(),
            })
            .await;
        if let Err(e) = &res {
            assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
        }
        assert!(
            c.head_object("keep/me").await.is_ok() && c.head_object("vol/a").await.is_ok(),
            "DeleteVolume {id:?} deleted something"
        );
    }
    let err = ctl
        .delete_volume(pb::DeleteVolumeRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: "../x".into(),
            volume_capabilities: vec![rw()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_serving(&mut server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_argv_logs_and_errors_and_state_is_private() {
    let mut server = start();
    let bucket = new_bucket("secrets");
    let mut node = server.node().await;
    // A failing mount with secrets: the error and the logs do not carry them.
    let secrets = HashMap::from([
        ("accessKeyId".to_string(), common::ACCESS_KEY.to_string()),
        (
            "secretAccessKey".to_string(),
            common::SECRET_KEY.to_string(),
        ),
        (
            "sessionToken".to_string(),
            "session-token-s3csi-test".to_string(),
        ),
    ]);
    let target = server.target("s1");
    let err = node
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: "no-such-bucket-s3csi-secrets".into(),
            target_path: target.to_string_lossy().into(),
            volume_capability: Some(rw()),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(!err.message().contains(common::SECRET_KEY), "{err:?}");
    assert!(
        !err.message().contains("session-token-s3csi-test"),
        "{err:?}"
    );
    // A working one.
    node.node_publish_volume(pb::NodePublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().into(),
        volume_capability: Some(rw()),
        secrets: secrets.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    std::fs::write(target.join("x"), b"x").unwrap();
    // No secret in any process's argv: the mounters, the server.
    let mut checked = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline);
        if text.contains("s3csi") {
            checked += 1;
            for s in [common::SECRET_KEY, "session-token-s3csi-test"] {
                assert!(!text.contains(s), "secret in argv: {text}");
            }
        }
    }
    assert!(checked >= 2, "found {checked} s3csi processes");
    // Private state: the state directory 0700 (nothing below it is reachable by others),
    // records and logs 0600 themselves; the socket 0600.
    let state = server.dir().join("state");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state) & 0o077, 0, "state dir is {:o}", mode(&state));
    let mut files = 0;
    let mut stack = vec![state.clone()];
    while let Some(p) = stack.pop() {
        let meta = std::fs::symlink_metadata(&p).unwrap();
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        } else if meta.is_file() {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            assert!(
                !text.contains(common::SECRET_KEY),
                "secret in {}",
                p.display()
            );
            let parent = p.parent().unwrap().file_name().unwrap();
            if parent == "mounts" || parent == "logs" {
                files += 1;
                assert_eq!(mode(&p) & 0o077, 0, "{} is {:o}", p.display(), mode(&p));
            }
        }
    }
    assert!(files >= 2, "state and log files: {files}");
    let sock = std::fs::metadata(server.socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(sock, 0o600);
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().into(),
    })
    .await
    .unwrap();
    let log = server.log_text();
    assert!(!log.contains(common::SECRET_KEY) && !log.contains("session-token-s3csi-test"));
    assert!(
        log.contains("static_credentials=true"),
        "debug log shows the flag only"
    );
    assert_serving(&mut server).await;
    eprintln!("secrets: {checked} s3csi argv checked, {files} state files private, logs clean");
}
