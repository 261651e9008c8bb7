//! The CSI driver over its unix socket, called with the generated tonic clients exactly as
//! kubelet and the external-provisioner call it, against the moto S3 server and real FUSE
//! mounts made by real `s3csi mount` children.

use crate::common;

use common::node_service::{mount_cap, publish_req, read, rw, stats_req, CsiServer, Mode, Options};
use common::{
    is_mountpoint, new_bucket, scratch_dir, start_embedded_server, ACCESS_KEY, SECRET_KEY,
};
use s3csi::csi::pb::{self, volume_capability as vc};
use s3csi::s3::aws::AwsClient;
use s3csi::s3::{ListRequest, ObjectClient};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tonic::Code;

/// Options for a server in `dir`, its log named after the test process.
fn csi_in(dir: PathBuf, mode: Mode) -> Options {
    CsiServer::options(dir)
        .mode(mode)
        .log_name(&format!("server-{}.log", std::process::id()))
}

/// A server in a fresh scratch dir with the test process's environment (static test keys
/// in AWS_*).
fn start(mode: Mode) -> CsiServer {
    csi_in(scratch_dir("csi"), mode).start()
}

fn unpublish_req(volume_id: &str, target: &Path) -> pb::NodeUnpublishVolumeRequest {
    pb::NodeUnpublishVolumeRequest {
        volume_id: volume_id.to_string(),
        target_path: target.to_string_lossy().to_string(),
    }
}

async fn s3_client(bucket: &str) -> AwsClient {
    common::set_test_env();
    AwsClient::new(bucket, &common::endpoint()).await
}

/// Waits until `key` exists in S3 (uploads may finish just after close).
async fn wait_for_key(client: &AwsClient, key: &str) -> bytes::Bytes {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(meta) = client.head_object(key).await {
            return client.get_range(key, 0, meta.size).await.unwrap();
        }
        assert!(Instant::now() < deadline, "{key} never appeared in S3");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn keys(client: &AwsClient, prefix: &str) -> Vec<String> {
    let page = client
        .list(ListRequest {
            prefix,
            delimiter: None,
            continuation: None,
            start_after: None,
            max_keys: 1000,
        })
        .await
        .unwrap();
    page.objects.into_iter().map(|o| o.key).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_and_node_info() {
    let server = start(Mode::All);
    let mut id = server.identity().await;
    let info = id
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "s3csi.dev");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    let caps = id
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1, "{caps:?}");
    let probe = id.probe(pb::ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));

    let mut node = server.node().await;
    let info = node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "test-node");
    let caps = node
        .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    use pb::node_service_capability::{rpc::Type, Type as Cap};
    let mut types: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Cap::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    types.sort();
    assert_eq!(
        types,
        vec![
            Type::GetVolumeStats as i32,
            Type::VolumeCondition as i32,
            Type::VolumeMountGroup as i32
        ]
    );
    let mut ctl = server.controller().await;
    let caps = ctl
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
    // Unimplemented RPCs say so.
    let err = ctl
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);

    // The socket is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(server.socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);

    // A node-only server does not claim the controller service, nor serve it.
    let node_only = start(Mode::Node);
    let mut id = node_only.identity().await;
    let caps = id
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.is_empty());
    let mut ctl = node_only.controller().await;
    let err = ctl
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
}

/// One gRPC call as the kubelet of Kubernetes 1.20 (grpc-go 1.27) and grpc-python make it
/// over a unix socket: HTTP/2 by hand, with the socket path as `:authority`. Returns the
/// response's DATA payload, or panics with what the server did instead.
pub(crate) fn raw_grpc_call(socket: &Path, path: &str, authority: &str, message: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    fn int(out: &mut Vec<u8>, prefix_bits: u8, mut n: usize) {
        let max = (1usize << prefix_bits) - 1;
        if n < max {
            out.push(n as u8);
            return;
        }
        out.push(max as u8);
        n -= max;
        while n >= 128 {
            out.push((n % 128 + 128) as u8);
            n /= 128;
        }
        out.push(n as u8);
    }
    // HPACK "literal header field without indexing, new name", no Huffman coding.
    fn header(out: &mut Vec<u8>, name: &str, value: &str) {
        out.push(0);
        int(out, 7, name.len());
        out.extend_from_slice(name.as_bytes());
        int(out, 7, value.len());
        out.extend_from_slice(value.as_bytes());
    }
    fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
    }
    let mut block = Vec::new();
    for (n, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        header(&mut block, n, v);
    }
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(&mut out, 0x4, 0, 0, &[]); // SETTINGS
    frame(&mut out, 0x1, 0x4, 1, &block); // HEADERS, END_HEADERS
    frame(&mut out, 0x0, 0x1, 1, &body); // DATA, END_STREAM
    let mut sock = std::os::unix::net::UnixStream::connect(socket).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    sock.write_all(&out).unwrap();
    let mut data = Vec::new();
    loop {
        let mut head = [0u8; 9];
        sock.read_exact(&mut head)
            .expect("connection closed before an answer");
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        sock.read_exact(&mut payload).unwrap();
        match (kind, stream) {
            (0x4, 0) if flags & 1 == 0 => {
                let mut ack = Vec::new();
                frame(&mut ack, 0x4, 0x1, 0, &[]);
                sock.write_all(&ack).unwrap();
            }
            (0x3, 1) => panic!("the server reset the call: error code {payload:?}"),
            (0x7, _) => panic!("the server closed the connection (GOAWAY {payload:?})"),
            (0x0, 1) => data.extend_from_slice(&payload),
            (0x1, 1) if flags & 0x1 != 0 => return data, // trailers end the call
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_the_socket_path_as_authority_are_answered() {
    let server = start(Mode::Node);
    let socket = server.socket().to_path_buf();
    let authority = socket.to_string_lossy().to_string();
    let answer = tokio::task::spawn_blocking(move || {
        raw_grpc_call(&socket, "/csi.v1.Identity/GetPluginInfo", &authority, &[])
    })
    .await
    .unwrap();
    assert!(answer.len() > 5, "no response message: {answer:?}");
    let info = <pb::GetPluginInfoResponse as prost::Message>::decode(&answer[5..]).unwrap();
    assert_eq!(info.name, "s3csi.dev");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_write_stats_unpublish() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-pub");
    let other = new_bucket("csi-other");
    let mut node = server.node().await;
    let target = server.target("pod1");

    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    assert!(is_mountpoint(&target));
    std::fs::write(target.join("hello.txt"), b"hello through csi").unwrap();
    let client = s3_client(&bucket).await;
    assert_eq!(
        &wait_for_key(&client, "hello.txt").await[..],
        b"hello through csi"
    );

    // Idempotent: the same volume on the same target again.
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    // A different volume on a mounted target.
    let err = node
        .node_publish_volume(publish_req(&other, &target))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");

    let stats = node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: bucket.clone(),
            volume_path: target.to_string_lossy().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let cond = stats.volume_condition.unwrap();
    assert!(!cond.abnormal, "{cond:?}");
    assert_eq!(stats.usage.len(), 2);

    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    assert!(!is_mountpoint(&target));
    assert!(!target.exists(), "target dir must be removed");
    assert!(server.mounter_pids().is_empty());
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    // Stats of a volume that is not published here.
    let err = node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: bucket.clone(),
            volume_path: target.to_string_lossy().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readonly_and_fs_group() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-ro");
    let client = s3_client(&bucket).await;
    client
        .put_object("data.txt", bytes::Bytes::from_static(b"seed"))
        .await
        .unwrap();
    let mut node = server.node().await;

    let ro = server.target("ro");
    let mut req = publish_req(&bucket, &ro);
    req.readonly = true;
    node.node_publish_volume(req).await.unwrap();
    assert_eq!(std::fs::read(ro.join("data.txt")).unwrap(), b"seed");
    assert!(std::fs::write(ro.join("new.txt"), b"x").is_err());
    node.node_unpublish_volume(unpublish_req(&bucket, &ro))
        .await
        .unwrap();

    let grp = server.target("grp");
    let mut req = publish_req(&bucket, &grp);
    req.volume_capability = Some(mount_cap(
        &["metadata-ttl=0s"],
        vc::access_mode::Mode::SingleNodeWriter,
        "4321",
    ));
    node.node_publish_volume(req).await.unwrap();
    let meta = std::fs::metadata(grp.join("data.txt")).unwrap();
    assert_eq!(meta.gid(), 4321);
    assert_eq!(meta.mode() & 0o777, 0o664);
    let root = std::fs::metadata(&grp).unwrap();
    assert_eq!(root.gid(), 4321);
    assert_eq!(root.mode() & 0o777, 0o775);
    node.node_unpublish_volume(unpublish_req(&bucket, &grp))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_credentials_from_secrets_only_by_environment() {
    // The server has no AWS credentials at all: only the Secret can make the mount work.
    let server = csi_in(scratch_dir("csi"), Mode::Node)
        .bare_env()
        .env("RUST_LOG", "debug")
        .start();
    let bucket = new_bucket("csi-sec");
    let mut node = server.node().await;
    let target = server.target("sec");

    let err = node
        .node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_err();
    assert_ne!(err.code(), Code::Ok, "without credentials: {err:?}");
    assert!(!is_mountpoint(&target));

    let mut req = publish_req(&bucket, &target);
    req.secrets = HashMap::from([
        ("accessKeyId".to_string(), ACCESS_KEY.to_string()),
        ("secretAccessKey".to_string(), SECRET_KEY.to_string()),
    ]);
    node.node_publish_volume(req).await.unwrap();
    std::fs::write(target.join("s.txt"), b"secret-backed").unwrap();
    let client = s3_client(&bucket).await;
    assert_eq!(&wait_for_key(&client, "s.txt").await[..], b"secret-backed");

    let pids = server.mounter_pids();
    assert_eq!(pids.len(), 1);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pids[0])).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(
        cmdline.contains("mount") && cmdline.contains("--foreground"),
        "{cmdline}"
    );
    assert!(
        !cmdline.contains(SECRET_KEY) && !cmdline.contains(ACCESS_KEY),
        "{cmdline}"
    );
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    assert!(String::from_utf8_lossy(&environ).contains(SECRET_KEY));

    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    // Never in any log, even at debug level.
    let mut logs = server.log_text();
    for e in std::fs::read_dir(server.dir().join("state").join("logs"))
        .unwrap()
        .flatten()
    {
        logs.push_str(&read(&e.path()));
    }
    assert!(
        logs.contains("NodePublishVolume"),
        "debug request log missing"
    );
    assert!(!logs.contains(SECRET_KEY), "secret leaked into logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mounter_is_replaced_then_unpublishes() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-kill");
    let mut node = server.node().await;
    let target = server.target("k");
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    let pids = server.mounter_pids();
    assert_eq!(pids.len(), 1);
    unsafe {
        libc::kill(pids[0] as i32, libc::SIGKILL);
    }
    let stats_req = pb::NodeGetVolumeStatsRequest {
        volume_id: bucket.clone(),
        volume_path: target.to_string_lossy().to_string(),
        staging_target_path: String::new(),
    };
    // The node service replaces the mounter (tests/it/handoff.rs checks the details).
    let deadline = Instant::now() + Duration::from_secs(20);
    let cond = loop {
        let stats = node
            .node_get_volume_stats(stats_req.clone())
            .await
            .unwrap()
            .into_inner();
        let cond = stats.volume_condition.unwrap();
        if (!cond.abnormal && cond.message.contains("replaced")) || Instant::now() > deadline {
            break cond;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !cond.abnormal && cond.message.contains("replaced 1 time"),
        "{cond:?}"
    );
    assert!(is_mountpoint(&target));
    // Republishing the same volume is a no-op.
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    let stats = node
        .node_get_volume_stats(stats_req)
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.volume_condition.unwrap().abnormal);
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    assert!(!is_mountpoint(&target) && !target.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_service_restart_keeps_and_adopts_mounts() {
    let dir = scratch_dir("csi-restart");
    let mut first = csi_in(dir.clone(), Mode::Node).start();
    let bucket = new_bucket("csi-restart");
    let target = first.target("r");
    first
        .node()
        .await
        .node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    std::fs::write(target.join("before.txt"), b"1").unwrap();
    let pid = first.mounter_pids()[0];
    first.kill9();
    // The mount keeps serving without its node service.
    std::fs::write(target.join("during.txt"), b"2").unwrap();
    assert_eq!(std::fs::read(target.join("before.txt")).unwrap(), b"1");
    let client = s3_client(&bucket).await;
    wait_for_key(&client, "during.txt").await;

    let second = csi_in(dir, Mode::Node).start();
    let mut node = second.node().await;
    // The adopted mount is known: same volume is OK, stats are healthy.
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    assert!(!is_mountpoint(&target));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        let stat = read(Path::new(&format!("/proc/{pid}/stat")));
        if stat.contains(") Z") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "adopted mounter {pid} still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_node_requests_are_rejected_with_the_right_code() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-bad");
    let mut node = server.node().await;
    let target = server.target("bad");
    let base = publish_req(&bucket, &target);
    let block = pb::VolumeCapability {
        access_type: Some(vc::AccessType::Block(vc::BlockVolume {})),
        access_mode: Some(vc::AccessMode {
            mode: vc::access_mode::Mode::SingleNodeWriter as i32,
        }),
    };
    type Edit = Box<dyn Fn(&mut pb::NodePublishVolumeRequest)>;
    let cases: Vec<(&str, Edit, Code, &str)> = vec![
        (
            "no volume id",
            Box::new(|r| r.volume_id.clear()),
            Code::InvalidArgument,
            "volume_id",
        ),
        (
            "no target",
            Box::new(|r| r.target_path.clear()),
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
            "block",
            Box::new(move |r| r.volume_capability = Some(block.clone())),
            Code::InvalidArgument,
            "block",
        ),
        (
            "unknown access mode",
            Box::new(|r| {
                r.volume_capability = Some(mount_cap(&[], vc::access_mode::Mode::Unknown, ""))
            }),
            Code::InvalidArgument,
            "access mode",
        ),
        (
            "traversal",
            Box::new(|r| r.target_path = format!("{}/../../etc/x", r.target_path)),
            Code::InvalidArgument,
            "..",
        ),
        (
            "relative",
            Box::new(|r| r.target_path = "pods/x/mount".into()),
            Code::InvalidArgument,
            "absolute",
        ),
        (
            "unknown mount option",
            Box::new(|r| {
                r.volume_capability = Some(mount_cap(
                    &["allow-other", "frobnicate=1"],
                    vc::access_mode::Mode::SingleNodeWriter,
                    "",
                ))
            }),
            Code::InvalidArgument,
            "frobnicate",
        ),
        (
            "bad handle",
            Box::new(|r| r.volume_id = "Not_A_Bucket!".into()),
            Code::InvalidArgument,
            "Not_A_Bucket",
        ),
        (
            "unknown attribute",
            Box::new(|r| {
                r.volume_context.insert("endpointURL".into(), "x".into());
            }),
            Code::InvalidArgument,
            "endpointURL",
        ),
        (
            "half a secret",
            Box::new(|r| {
                r.secrets.insert("accessKeyId".into(), "AKIDHALF".into());
            }),
            Code::InvalidArgument,
            "secretAccessKey",
        ),
        (
            "missing bucket",
            Box::new(|r| r.volume_id = "no-such-bucket-s3csi".into()),
            Code::NotFound,
            "does not exist",
        ),
    ];
    for (name, edit, code, needle) in cases {
        let mut req = base.clone();
        edit(&mut req);
        let err = node.node_publish_volume(req).await.unwrap_err();
        assert_eq!(err.code(), code, "{name}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{name}: {:?}",
            err.message()
        );
        assert!(!err.message().contains("AKIDHALF"), "{name}");
        assert!(!is_mountpoint(&target), "{name}");
    }
    let err = node
        .node_unpublish_volume(unpublish_req("", &target))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = node
        .node_unpublish_volume(unpublish_req(&bucket, Path::new("rel")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_never_double_mount() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-conc");
    let target = server.target("c");
    let mut tasks = vec![];
    for _ in 0..10 {
        let mut node = server.node().await;
        let req = publish_req(&bucket, &target);
        tasks.push(tokio::spawn(
            async move { node.node_publish_volume(req).await },
        ));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(e.code(), Code::Aborted, "{e:?}"),
        }
    }
    assert!(ok >= 1);
    let target_s = target.to_string_lossy().to_string();
    let mounts = read(Path::new("/proc/self/mountinfo"))
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(target_s.as_str()))
        .count();
    assert_eq!(mounts, 1, "exactly one mount on the target");
    assert_eq!(server.mounter_pids().len(), 1);
    server
        .node()
        .await
        .node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    assert!(!is_mountpoint(&target));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_lifecycle_create_publish_delete() {
    let server = start(Mode::All);
    let bucket = new_bucket("csi-ctl");
    let mut ctl = server.controller().await;
    let create = |name: &str, params: &[(&str, &str)]| pb::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: 5 << 30,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![rw()],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let params = [("bucket", bucket.as_str()), ("basePrefix", "k8s")];
    let vol = ctl
        .create_volume(create("pvc-123", &params))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.volume_id, format!("{bucket}/k8s/pvc-123"));
    assert_eq!(vol.capacity_bytes, 5 << 30);
    assert_eq!(vol.volume_context["prefix"], "k8s/pvc-123/");
    let client = s3_client(&bucket).await;
    assert!(client.head_object("k8s/pvc-123/").await.is_ok(), "marker");
    // Idempotent on the name.
    let again = ctl
        .create_volume(create("pvc-123", &params))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, vol.volume_id);

    // Publish it as kubelet would, with the context CreateVolume returned.
    let mut node = server.node().await;
    let target = server.target("ctl");
    let mut req = publish_req(&vol.volume_id, &target);
    req.volume_context = vol.volume_context.clone();
    node.node_publish_volume(req).await.unwrap();
    std::fs::create_dir(target.join("sub")).unwrap();
    std::fs::write(target.join("sub/f.txt"), b"in the volume").unwrap();
    assert_eq!(
        &wait_for_key(&client, "k8s/pvc-123/sub/f.txt").await[..],
        b"in the volume"
    );
    node.node_unpublish_volume(unpublish_req(&vol.volume_id, &target))
        .await
        .unwrap();

    // Neighbours that must survive the delete.
    for key in ["k8s/pvc-1234/keep.txt", "k8s/other.txt", "top.txt"] {
        client
            .put_object(key, bytes::Bytes::from_static(b"keep"))
            .await
            .unwrap();
    }
    for i in 0..25 {
        client
            .put_object(&format!("k8s/pvc-123/many/{i}"), bytes::Bytes::new())
            .await
            .unwrap();
    }
    let validate = ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: vol.volume_id.clone(),
            volume_capabilities: vec![rw()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(validate.confirmed.is_some());

    ctl.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: HashMap::new(),
    })
    .await
    .unwrap();
    assert!(keys(&client, "k8s/pvc-123/").await.is_empty());
    let mut left = keys(&client, "").await;
    left.sort();
    assert_eq!(
        left,
        vec!["k8s/other.txt", "k8s/pvc-1234/keep.txt", "top.txt"]
    );
    // Idempotent.
    ctl.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: HashMap::new(),
    })
    .await
    .unwrap();

    // Provisioner secrets are used for the S3 calls.
    let with_secret = pb::CreateVolumeRequest {
        secrets: HashMap::from([
            ("accessKeyId".to_string(), ACCESS_KEY.to_string()),
            ("secretAccessKey".to_string(), SECRET_KEY.to_string()),
        ]),
        ..create("pvc-sec", &params)
    };
    ctl.create_volume(with_secret).await.unwrap();
    assert!(client.head_object("k8s/pvc-sec/").await.is_ok());

    // Bad requests.
    for (req, needle) in [
        (create("", &params), "name"),
        (create("pvc-x", &[("basePrefix", "k8s")]), "bucket"),
        (
            create("pvc-x", &[("bucket", bucket.as_str()), ("colour", "blue")]),
            "colour",
        ),
        (
            pb::CreateVolumeRequest {
                volume_capabilities: vec![],
                ..create("pvc-x", &params)
            },
            "volume_capabilities",
        ),
    ] {
        let err = ctl.create_volume(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(needle), "{:?}", err.message());
    }
    // A whole bucket is never a volume CreateVolume made: OK, and nothing is deleted.
    ctl.delete_volume(pb::DeleteVolumeRequest {
        volume_id: bucket.clone(),
        secrets: HashMap::new(),
    })
    .await
    .unwrap();
    assert!(keys(&client, "").await.contains(&"top.txt".to_string()));
    assert!(!server.log_text().contains(SECRET_KEY));
}

// ---- what Kubernetes' csi-sanity asks of the controller and node services -------------

const GIB: i64 = 1 << 30;

/// The volume a CreateVolume that must succeed returns.
async fn created(
    ctl: &mut pb::controller_client::ControllerClient<tonic::transport::Channel>,
    req: pb::CreateVolumeRequest,
) -> pb::Volume {
    ctl.create_volume(req)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

/// A CreateVolume request as the external-provisioner sends it: `required` bytes at least,
/// `limit` bytes at most (0: no bound).
fn create_req(
    name: &str,
    params: &[(&str, &str)],
    required: i64,
    limit: i64,
) -> pb::CreateVolumeRequest {
    pb::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        volume_capabilities: vec![rw()],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn delete_req(volume_id: &str) -> pb::DeleteVolumeRequest {
    pb::DeleteVolumeRequest {
        volume_id: volume_id.to_string(),
        secrets: HashMap::new(),
    }
}

fn validate_req(
    volume_id: &str,
    volume_context: HashMap<String, String>,
) -> pb::ValidateVolumeCapabilitiesRequest {
    pb::ValidateVolumeCapabilitiesRequest {
        volume_id: volume_id.to_string(),
        volume_context,
        volume_capabilities: vec![rw()],
        ..Default::default()
    }
}

async fn sorted_keys(client: &AwsClient) -> Vec<String> {
    let mut all = keys(client, "").await;
    all.sort();
    all
}

/// NodeGetVolumeStats answers NotFound for every path where the asked volume is not
/// published: csi-sanity's relative `some/path`, a missing path, another volume's target,
/// an empty directory, another file system's mount point. Only empty fields are
/// InvalidArgument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_stats_where_the_volume_is_not_published_are_not_found() {
    let started = Instant::now();
    let server = start(Mode::All);
    let bucket = new_bucket("csi-stats");
    let mut node = server.node().await;
    let target = server.target("stats");
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap();
    let target_s = target.to_string_lossy().to_string();
    let idle = server.target("idle");
    std::fs::create_dir(&idle).unwrap();
    let foreign = server.target("foreign");
    std::fs::create_dir(&foreign).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "s3csi-test-tmpfs"])
        .arg(&foreign)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount a tmpfs on {}", foreign.display());
    let cases: Vec<(&str, &str, String, Code)> = vec![
        (
            "relative path (csi-sanity)",
            bucket.as_str(),
            "some/path".into(),
            Code::NotFound,
        ),
        (
            "missing path",
            bucket.as_str(),
            "/nonexistent/s3csi/stats".into(),
            Code::NotFound,
        ),
        (
            "path with ..",
            bucket.as_str(),
            format!("{target_s}/../mount"),
            Code::NotFound,
        ),
        (
            "another volume's target",
            "csi-sanity-id",
            target_s.clone(),
            Code::NotFound,
        ),
        (
            "a directory with nothing mounted",
            bucket.as_str(),
            idle.to_string_lossy().into(),
            Code::NotFound,
        ),
        (
            "another file system's mount point",
            bucket.as_str(),
            foreign.to_string_lossy().into(),
            Code::NotFound,
        ),
        ("no volume id", "", target_s.clone(), Code::InvalidArgument),
        (
            "no volume path",
            bucket.as_str(),
            String::new(),
            Code::InvalidArgument,
        ),
    ];
    for (name, volume_id, volume_path, code) in cases {
        let res = node
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: volume_id.to_string(),
                volume_path,
                staging_target_path: String::new(),
            })
            .await;
        let err = res.expect_err(name);
        assert_eq!(err.code(), code, "{name}: {err:?}");
    }
    // The published volume at its own path still answers.
    let stats = node
        .node_get_volume_stats(stats_req(&bucket, &target))
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.volume_condition.unwrap().abnormal);
    assert_eq!(stats.usage.len(), 2);
    let unmounted = Command::new("umount").arg(&foreign).status().unwrap();
    assert!(unmounted.success());
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    eprintln!(
        "[csi] NodeGetVolumeStats: 6 NotFound and 2 InvalidArgument cases in {:?}",
        started.elapsed()
    );
}

/// CreateVolume records the capacity it gave a volume in S3: the same request again is
/// the same volume, one whose capacity range the volume does not fit is AlreadyExists,
/// also after a restart of the controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_volume_with_an_existing_name_and_another_capacity_is_already_exists() {
    let started = Instant::now();
    let dir = scratch_dir("csi-capacity");
    let mut first = csi_in(dir.clone(), Mode::All).start();
    let bucket = new_bucket("csi-cap");
    let client = s3_client(&bucket).await;
    let params = [("bucket", bucket.as_str()), ("basePrefix", "k8s")];
    let mut ctl = first.controller().await;
    // csi-sanity: 10 GiB (required and limit), then the same name with twice that.
    let vol = created(&mut ctl, create_req("pvc-cap", &params, 10 * GIB, 10 * GIB)).await;
    assert_eq!(vol.capacity_bytes, 10 * GIB);
    let again = created(&mut ctl, create_req("pvc-cap", &params, 10 * GIB, 10 * GIB)).await;
    assert_eq!(again, vol, "the same request is the same volume");
    for (required, limit) in [(20 * GIB, 20 * GIB), (20 * GIB, 0), (0, 5 * GIB)] {
        let err = ctl
            .create_volume(create_req("pvc-cap", &params, required, limit))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::AlreadyExists,
            "{required}..{limit}: {err:?}"
        );
        assert!(err.message().contains("pvc-cap"), "{:?}", err.message());
    }
    // A range that the volume's 10 GiB fit is compatible: the same volume.
    for (required, limit) in [(GIB, 0), (0, 20 * GIB), (0, 0)] {
        let same = created(&mut ctl, create_req("pvc-cap", &params, required, limit)).await;
        assert_eq!(same.capacity_bytes, 10 * GIB, "{required}..{limit}");
    }
    // The record is not in the volume: its prefix holds only its marker.
    assert_eq!(keys(&client, "k8s/pvc-cap/").await, vec!["k8s/pvc-cap/"]);

    // It is in S3, not in the controller's memory.
    first.kill9();
    let second = csi_in(dir, Mode::All).start();
    let mut ctl = second.controller().await;
    let err = ctl
        .create_volume(create_req("pvc-cap", &params, 20 * GIB, 20 * GIB))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "after a restart: {err:?}");
    let after_restart = created(&mut ctl, create_req("pvc-cap", &params, 10 * GIB, 10 * GIB)).await;
    assert_eq!(after_restart, vol);

    // Another name that makes the same prefix ("pvc cap" is sanitised to "pvc-cap") is
    // not this volume.
    let err = ctl
        .create_volume(create_req("pvc cap", &params, 10 * GIB, 10 * GIB))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    // A prefix that holds objects CreateVolume did not write is not taken over.
    client
        .put_object("k8s/taken/data.txt", bytes::Bytes::from_static(b"precious"))
        .await
        .unwrap();
    let err = ctl
        .create_volume(create_req("taken", &params, GIB, 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    // Malformed ranges.
    for (required, limit) in [(-1, 0), (0, -1), (2 * GIB, GIB)] {
        let err = ctl
            .create_volume(create_req("pvc-range", &params, required, limit))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{required}..{limit}: {err:?}"
        );
    }
    assert_eq!(
        keys(&client, "k8s/taken/").await,
        vec!["k8s/taken/data.txt"],
        "the refused CreateVolume wrote nothing"
    );
    assert!(keys(&client, "k8s/pvc-range").await.is_empty());
    drop(first);
    eprintln!(
        "[csi] CreateVolume: capacity recorded, AlreadyExists before and after a restart, in {:?}",
        started.elapsed()
    );
}

/// DeleteVolume of an id CreateVolume did not make (csi-sanity's `fake-vol-id`, a whole
/// bucket, a static PV's prefix, a prefix with data but no record, a missing bucket) is
/// OK and deletes nothing; a volume CreateVolume made is deleted with its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_volume_of_what_create_volume_did_not_make_is_ok_and_deletes_nothing() {
    let started = Instant::now();
    let server = start(Mode::All);
    let bucket = new_bucket("csi-del");
    let client = s3_client(&bucket).await;
    let precious = vec![
        "k8s/pvc-old/",
        "k8s/pvc-old/data.txt",
        "static/keep.txt",
        "top.txt",
    ];
    for key in &precious {
        client
            .put_object(key, bytes::Bytes::from_static(b"keep"))
            .await
            .unwrap();
    }
    let mut ctl = server.controller().await;
    let not_ours = [
        "fake-vol-id".to_string(),
        bucket.clone(),
        format!("{bucket}/static"),
        format!("{bucket}/k8s/pvc-old"),
        format!("{bucket}/k8s"),
        "no-such-bucket-s3csi/some/prefix".to_string(),
    ];
    for id in &not_ours {
        ctl.delete_volume(delete_req(id))
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {id}: {e:?}"));
        assert_eq!(sorted_keys(&client).await, precious, "DeleteVolume {id}");
    }

    let params = [("bucket", bucket.as_str()), ("basePrefix", "k8s")];
    let vol = created(&mut ctl, create_req("pvc-new", &params, GIB, 0)).await;
    client
        .put_object("k8s/pvc-new/a.txt", bytes::Bytes::from_static(b"a"))
        .await
        .unwrap();
    // The directory of records is not a volume either.
    ctl.delete_volume(delete_req(&format!("{bucket}/k8s/.s3csi-volumes")))
        .await
        .unwrap();
    ctl.delete_volume(delete_req(&vol.volume_id)).await.unwrap();
    assert_eq!(
        sorted_keys(&client).await,
        precious,
        "the volume and its record are gone, nothing else"
    );
    // Gone: deleting it again is OK, and so is creating it anew.
    ctl.delete_volume(delete_req(&vol.volume_id)).await.unwrap();
    ctl.create_volume(create_req("pvc-new", &params, 2 * GIB, 0))
        .await
        .unwrap();
    assert_eq!(keys(&client, "k8s/pvc-new/").await, vec!["k8s/pvc-new/"]);
    eprintln!(
        "[csi] DeleteVolume: {} ids that are not volumes deleted nothing; a created one went, in {:?}",
        not_ours.len() + 1,
        started.elapsed()
    );
}

/// ValidateVolumeCapabilities of a volume that does not exist in S3 is NotFound; an
/// endpoint that cannot be reached is Unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_volume_capabilities_of_a_missing_volume_is_not_found() {
    let started = Instant::now();
    let server = start(Mode::All);
    let bucket = new_bucket("csi-val");
    let client = s3_client(&bucket).await;
    client
        .put_object("static/data.txt", bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    let mut ctl = server.controller().await;
    let params = [("bucket", bucket.as_str()), ("basePrefix", "k8s")];
    let vol = created(&mut ctl, create_req("pvc-val", &params, GIB, 0)).await;
    for (id, ctx) in [
        (vol.volume_id.clone(), vol.volume_context.clone()),
        (bucket.clone(), HashMap::new()),
        (format!("{bucket}/static"), HashMap::new()),
    ] {
        let res = ctl
            .validate_volume_capabilities(validate_req(&id, ctx))
            .await
            .unwrap_or_else(|e| panic!("{id}: {e:?}"))
            .into_inner();
        assert!(res.confirmed.is_some(), "{id}: {res:?}");
    }
    let missing = [
        format!("some-vol-id-{}", std::process::id()),
        format!("{bucket}/no/such/prefix"),
    ];
    for id in &missing {
        let err = ctl
            .validate_volume_capabilities(validate_req(id, HashMap::new()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{id}: {err:?}");
    }
    ctl.delete_volume(delete_req(&vol.volume_id)).await.unwrap();
    let err = ctl
        .validate_volume_capabilities(validate_req(&vol.volume_id, vol.volume_context.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "deleted: {err:?}");
    // Other S3 failures keep their own code.
    let unreachable = HashMap::from([
        ("endpointUrl".to_string(), "http://127.0.0.1:1".to_string()),
        ("forcePathStyle".to_string(), "true".to_string()),
    ]);
    let asked = Instant::now();
    let err = ctl
        .validate_volume_capabilities(validate_req(&bucket, unreachable))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    eprintln!(
        "[csi] ValidateVolumeCapabilities: 3 found, 3 NotFound, Unavailable after {:?}; in {:?}",
        asked.elapsed(),
        started.elapsed()
    );
}

/// The controller's S3 records against the embedded S3 server (which checks signatures):
/// create, the same again, an incompatible capacity, validate (PermissionDenied with the
/// wrong keys), delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_volumes_on_the_embedded_s3_server() {
    use s3csi::s3server::{DEMO_ACCESS_KEY, DEMO_SECRET_KEY};
    let started = Instant::now();
    let bucket = "volumes";
    let s3 = start_embedded_server(bucket).await;
    let endpoint = s3.endpoint();
    let server = csi_in(scratch_dir("csi"), Mode::All)
        .without_s3_flags()
        .flags(&["--s3-endpoint-url", &endpoint, "--s3-region", "us-east-1"])
        .flags(&["--s3-force-path-style"])
        .env("AWS_ACCESS_KEY_ID", DEMO_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", DEMO_SECRET_KEY)
        .start();
    let client = AwsClient::with_static_credentials(
        bucket,
        &s3csi::config::Endpoint {
            region: Some("us-east-1".into()),
            endpoint_url: Some(endpoint.clone()),
            force_path_style: true,
        },
        DEMO_ACCESS_KEY,
        DEMO_SECRET_KEY,
        None,
    )
    .await;
    let mut ctl = server.controller().await;
    let params = [("bucket", bucket), ("basePrefix", "k8s")];
    let vol = created(&mut ctl, create_req("pvc-e", &params, 10 * GIB, 10 * GIB)).await;
    let again = created(&mut ctl, create_req("pvc-e", &params, 10 * GIB, 10 * GIB)).await;
    assert_eq!(again, vol);
    let err = ctl
        .create_volume(create_req("pvc-e", &params, 20 * GIB, 20 * GIB))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert_eq!(keys(&client, "k8s/pvc-e/").await, vec!["k8s/pvc-e/"]);

    let found = ctl
        .validate_volume_capabilities(validate_req(&vol.volume_id, vol.volume_context.clone()))
        .await
        .unwrap()
        .into_inner();
    assert!(found.confirmed.is_some(), "{found:?}");
    let mut wrong_keys = validate_req(&vol.volume_id, vol.volume_context.clone());
    wrong_keys.secrets = HashMap::from([
        ("accessKeyId".to_string(), DEMO_ACCESS_KEY.to_string()),
        ("secretAccessKey".to_string(), "not-the-secret".to_string()),
    ]);
    let err = ctl
        .validate_volume_capabilities(wrong_keys)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = ctl
        .validate_volume_capabilities(validate_req("no-such-bucket", HashMap::new()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    client
        .put_object("k8s/pvc-e/f.txt", bytes::Bytes::from_static(b"f"))
        .await
        .unwrap();
    ctl.delete_volume(delete_req(&vol.volume_id)).await.unwrap();
    assert!(
        sorted_keys(&client).await.is_empty(),
        "the volume and its record are deleted"
    );
    ctl.delete_volume(delete_req("fake-vol-id")).await.unwrap();
    drop(server);
    s3.stop().await;
    eprintln!(
        "[csi] embedded S3 server: create, AlreadyExists, validate, PermissionDenied, delete in {:?}",
        started.elapsed()
    );
}

// ---- the node service's rough edges ----------------------------------------------------

/// Soft and hard RLIMIT_NOFILE of a process, from /proc (u64::MAX for "unlimited").
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = read(Path::new(&format!("/proc/{pid}/limits")));
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .unwrap_or_else(|| panic!("no open-file limit in /proc/{pid}/limits: {limits}"));
    let value = |v: &str| match v {
        "unlimited" => u64::MAX,
        n => n.parse().unwrap(),
    };
    let mut fields = line.split_whitespace();
    (value(fields.next().unwrap()), value(fields.next().unwrap()))
}

/// The node service holds one or two descriptors per mount: started with a soft open-file
/// limit of 256 (a container runtime's default may be as low as 1024), it raises it to the
/// hard limit, and the mounters it spawns have the raised limit too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_service_raises_its_open_file_limit_to_the_hard_limit() {
    let started = Instant::now();
    let (_, hard) = open_file_limits(std::process::id());
    assert!(
        hard > 256,
        "the hard limit here is {hard}: nothing to raise"
    );
    let wanted = hard.min(1 << 20);
    let server = csi_in(scratch_dir("csi-nofile"), Mode::Node)
        .open_file_soft_limit(256)
        .start();
    assert_eq!(open_file_limits(server.pid()), (wanted, hard));
    let log = server.log_text();
    assert!(
        log.contains("raised the open-file limit"),
        "the raise is logged: {log}"
    );
    let bucket = new_bucket("csi-nofile");
    let target = server.target("nofile");
    let mut node = server.node().await;
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", server.log_text()));
    assert_eq!(open_file_limits(server.mounter_pid()), (wanted, hard));
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    eprintln!(
        "[csi] open-file limit raised from 256 to {wanted} (node service and mounter) in {:?}",
        started.elapsed()
    );
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
}

/// NodeGetVolumeStats of a volume whose mounter does not answer (stopped: the kernel
/// queues its FUSE requests, so statvfs waits) takes the probe's timeout and reports the
/// volume abnormal; kubelet may send several at once, more than the runtime has workers,
/// and none of them holds up any other request, here another volume's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_stats_of_a_mounter_that_does_not_answer_hold_up_no_other_request() {
    let started = Instant::now();
    let server = start(Mode::Node);
    let (hung, live) = (new_bucket("csi-hung"), new_bucket("csi-live"));
    let (hung_target, live_target) = (server.target("hung"), server.target("live"));
    let mut node = server.node().await;
    node.node_publish_volume(publish_req(&hung, &hung_target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", server.log_text()));
    let hung_pid = server.mounter_pid();
    node.node_publish_volume(publish_req(&live, &live_target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", server.log_text()));
    signal(hung_pid, nix::sys::signal::Signal::SIGSTOP);
    let asked = Instant::now();
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            let mut node = node.clone();
            let req = stats_req(&hung, &hung_target);
            tokio::spawn(async move {
                let res = node.node_get_volume_stats(req).await;
                (res, asked.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let other = Instant::now();
    node.node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap();
    let stats = node
        .node_get_volume_stats(stats_req(&live, &live_target))
        .await
        .unwrap()
        .into_inner();
    let other = other.elapsed();
    assert!(
        !stats.volume_condition.as_ref().unwrap().abnormal,
        "{stats:?}"
    );
    assert_eq!(stats.usage.len(), 2);
    let mut slowest = Duration::ZERO;
    for w in waiting {
        let (res, took) = w.await.unwrap();
        let stats = res
            .expect("stats of a hung volume are an answer")
            .into_inner();
        let condition = stats.volume_condition.unwrap();
        assert!(condition.abnormal, "{condition:?}");
        assert!(stats.usage.is_empty());
        slowest = slowest.max(took);
    }
    signal(hung_pid, nix::sys::signal::Signal::SIGCONT);
    assert!(
        other < Duration::from_secs(2),
        "the other requests waited {other:?} for the hung volume's"
    );
    assert!(slowest < Duration::from_secs(10), "{slowest:?}");
    for (bucket, target) in [(&hung, &hung_target), (&live, &live_target)] {
        node.node_unpublish_volume(unpublish_req(bucket, target))
            .await
            .unwrap();
    }
    eprintln!(
        "[csi] 4 stats of a hung volume took up to {slowest:?}; meanwhile another volume's \
         answered in {other:?}; in {:?}",
        started.elapsed()
    );
}

/// NodeUnpublishVolume of a mount that a workload still holds (an open file, a working
/// directory inside it) does not wait for an unmount nobody else would do: after a short
/// retry it detaches the mount lazily and the target is gone (the unmount timeout, 10 s
/// here, is not waited for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_of_a_busy_mount_detaches_it_without_waiting() {
    let started = Instant::now();
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-busy");
    let target = server.target("busy");
    let mut node = server.node().await;
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", server.log_text()));
    std::fs::write(target.join("held.txt"), b"held").unwrap();
    let held = std::fs::File::open(target.join("held.txt")).unwrap();
    let mut sleeper = Command::new("sleep")
        .arg("60")
        .current_dir(&target)
        .spawn()
        .unwrap();
    let asked = Instant::now();
    let res = node
        .node_unpublish_volume(unpublish_req(&bucket, &target))
        .await;
    let took = asked.elapsed();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    drop(held);
    res.unwrap_or_else(|e| panic!("unpublish: {e:?}\n{}", server.log_text()));
    assert!(
        !is_mountpoint(&target),
        "{} is still mounted",
        target.display()
    );
    assert!(!target.exists(), "the target is removed");
    assert!(
        took < Duration::from_secs(5),
        "unpublish of a busy mount took {took:?} (the unmount timeout is 10 s)"
    );
    eprintln!(
        "[csi] unpublish of a busy mount: detached in {took:?}; in {:?}",
        started.elapsed()
    );
}

/// Bytes of cached blocks under `dir` (any depth), and how many such files.
fn cached_blocks(dir: &Path) -> u64 {
    let mut total = 0;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                total += cached_blocks(&p);
            } else if p.extension().is_some_and(|x| x == "blocks") {
                total += e.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
            }
        }
    }
    total
}

/// `cacheSize` gives a volume a data cache in its mount's directory, deleted at unpublish;
/// with `keepCache` it lives beside the node's state and the next publish reads it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_data_caches_are_sized_by_attribute_and_kept_when_asked() {
    let server = start(Mode::Node);
    let bucket = new_bucket("csi-cache");
    let client = s3_client(&bucket).await;
    let body: Vec<u8> = (0..3 * 1024 * 1024 + 77u32)
        .map(|i| (i % 241) as u8)
        .collect();
    client.put_object("f", body.clone().into()).await.unwrap();
    let mut node = server.node().await;
    let state = server.dir().join("state");
    let publish = |target: &Path, keep: bool| {
        let mut req = publish_req(&bucket, target);
        req.volume_context
            .insert("cacheSize".into(), "64MiB".into());
        if keep {
            req.volume_context.insert("keepCache".into(), "true".into());
        }
        req
    };
    let read_until_cached = |target: &Path, under: &Path| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(std::fs::read(target.join("f")).unwrap() == body);
            if cached_blocks(under) >= body.len() as u64 {
                break;
            }
            assert!(Instant::now() < deadline, "nothing was cached");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    // Without keepCache: cached in the mount's directory, gone with the unpublish.
    let target = server.target("pod1");
    node.node_publish_volume(publish(&target, false))
        .await
        .unwrap();
    read_until_cached(&target, &state.join("handoff"));
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    assert_eq!(cached_blocks(&state), 0, "the cache outlived its volume");
    // With keepCache: kept in STATE/cache/<volume>, and found by the next publish.
    node.node_publish_volume(publish(&target, true))
        .await
        .unwrap();
    read_until_cached(&target, &state.join("cache"));
    node.node_unpublish_volume(unpublish_req(&bucket, &target))
        .await
        .unwrap();
    let kept = cached_blocks(&state.join("cache"));
    assert!(kept >= body.len() as u64, "the kept cache was deleted");
    let target2 = server.target("pod2");
    node.node_publish_volume(publish(&target2, true))
        .await
        .unwrap();
    assert!(std::fs::read(target2.join("f")).unwrap() == body);
    let logs = std::fs::read_dir(state.join("logs"))
        .unwrap()
        .flatten()
        .map(|e| read(&e.path()))
        .collect::<String>();
    assert!(logs.contains("data cache found"), "{logs}");
    node.node_unpublish_volume(unpublish_req(&bucket, &target2))
        .await
        .unwrap();
    assert_eq!(cached_blocks(&state.join("cache")), kept);
    // A bad size is the publish's InvalidArgument.
    let mut bad = publish(&target, false);
    bad.volume_context.insert("cacheSize".into(), "lots".into());
    let err = node.node_publish_volume(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("cacheSize"), "{err:?}");
}

/// Pods of one volume on a node share one mounter: a second publish with the same volume,
/// options and credentials bind-mounts the first one's mount (what one pod writes the
/// other reads at once), a read-only publish gets a mounter of its own. Unpublishing one
/// target leaves the other serving, a kill -9 of the shared mounter heals both targets
/// at once, a restarted node service finds the targets again, and the last unpublish
/// stops the mounter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_one_volume_share_one_mounter() {
    let dir = scratch_dir("csi-share");
    let mut first = csi_in(dir.clone(), Mode::Node).start();
    let bucket = new_bucket("csi-share");
    let mut node = first.node().await;
    let (a, b, c) = (first.target("a"), first.target("b"), first.target("c"));
    for t in [&a, &b] {
        node.node_publish_volume(publish_req(&bucket, t))
            .await
            .unwrap_or_else(|e| panic!("publish: {e}\n{}", first.log_text()));
        assert!(is_mountpoint(t));
    }
    let shared_pid = first.mounter_pid();
    std::fs::write(a.join("from-a.txt"), b"a").unwrap();
    assert_eq!(std::fs::read(b.join("from-a.txt")).unwrap(), b"a");
    std::fs::write(b.join("from-b.txt"), b"b").unwrap();
    assert_eq!(std::fs::read(a.join("from-b.txt")).unwrap(), b"b");

    let mut read_only = publish_req(&bucket, &c);
    read_only.readonly = true;
    node.node_publish_volume(read_only).await.unwrap();
    assert_eq!(
        first.mounter_pids().len(),
        2,
        "read-only is another mounter"
    );
    assert_eq!(std::fs::read(c.join("from-a.txt")).unwrap(), b"a");
    assert!(std::fs::write(c.join("no.txt"), b"x").is_err());

    // One kill heals both targets: they are one FUSE connection.
    unsafe {
        libc::kill(shared_pid as i32, libc::SIGKILL);
    }
    common::node_service::wait_replaced(&mut node, &bucket, &a, 1).await;
    for t in [&a, &b] {
        let cond = node
            .node_get_volume_stats(stats_req(&bucket, t))
            .await
            .unwrap()
            .into_inner()
            .volume_condition
            .unwrap();
        assert!(
            !cond.abnormal && cond.message.contains("replaced 1 time"),
            "{cond:?}"
        );
        assert_eq!(std::fs::read(t.join("from-a.txt")).unwrap(), b"a");
    }

    // One pod goes: the other keeps its mount and its mounter.
    node.node_unpublish_volume(unpublish_req(&bucket, &a))
        .await
        .unwrap();
    assert!(!is_mountpoint(&a) && !a.exists());
    assert_eq!(std::fs::read(b.join("from-b.txt")).unwrap(), b"b");
    assert_eq!(first.mounter_pids().len(), 2);

    // A restarted node service knows which targets each mounter serves.
    first.kill9();
    let second = csi_in(dir, Mode::Node).start();
    let mut node = second.node().await;
    node.node_publish_volume(publish_req(&bucket, &b))
        .await
        .unwrap();
    let stats = node
        .node_get_volume_stats(stats_req(&bucket, &b))
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.volume_condition.unwrap().abnormal);
    // A new pod joins the adopted mounter.
    node.node_publish_volume(publish_req(&bucket, &a))
        .await
        .unwrap();
    assert_eq!(std::fs::read(a.join("from-b.txt")).unwrap(), b"b");
    assert_eq!(second.mounter_pids().len(), 2);
    for t in [&a, &b, &c] {
        node.node_unpublish_volume(unpublish_req(&bucket, t))
            .await
            .unwrap();
        assert!(!is_mountpoint(t));
    }
    assert!(second.mounter_pids().is_empty());
    let shared = second.dir().join("state").join("shared");
    let left: Vec<_> = std::fs::read_dir(&shared).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    drop(first);
}

/// A restarted node service serves its socket before it has adopted the mounts of the one
/// before: a mounter that does not answer (stopped) makes the adoption wait for its
/// descriptor (5 s), while kubelet's registration, probes and capability calls are
/// answered at once; node calls wait for the adoption and then see both mounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_node_service_answers_at_once_while_it_adopts_a_mounter_that_does_not_answer() {
    let dir = scratch_dir("csi-async-recovery");
    let mut first = csi_in(dir.clone(), Mode::Node).start();
    let (hung, live) = (new_bucket("csi-rec-hung"), new_bucket("csi-rec-live"));
    let (hung_target, live_target) = (first.target("hung"), first.target("live"));
    let mut node = first.node().await;
    node.node_publish_volume(publish_req(&hung, &hung_target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", first.log_text()));
    let hung_pid = first.mounter_pid();
    node.node_publish_volume(publish_req(&live, &live_target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", first.log_text()));
    std::fs::write(live_target.join("f.txt"), b"still here").unwrap();
    signal(hung_pid, nix::sys::signal::Signal::SIGSTOP);
    first.kill9();

    let restarted = Instant::now();
    let second = csi_in(dir, Mode::Node).start();
    let serving_after = restarted.elapsed();
    let mut identity = second.identity().await;
    identity
        .probe(pb::ProbeRequest {})
        .await
        .unwrap_or_else(|e| panic!("probe: {e:?}\n{}", second.log_text()));
    identity
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap();
    let mut node = second.node().await;
    node.node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap();
    let answered_after = restarted.elapsed();
    let stats = node
        .node_get_volume_stats(stats_req(&live, &live_target))
        .await
        .unwrap_or_else(|e| panic!("stats: {e:?}\n{}", second.log_text()))
        .into_inner();
    let adopted_after = restarted.elapsed();
    assert!(
        !stats.volume_condition.as_ref().unwrap().abnormal,
        "{stats:?}"
    );
    assert!(
        answered_after < Duration::from_secs(3),
        "identity and capability calls waited {answered_after:?} for the adoption"
    );
    assert!(
        adopted_after > answered_after,
        "the stats call came after the adoption"
    );
    signal(hung_pid, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(
        std::fs::read(live_target.join("f.txt")).unwrap(),
        b"still here"
    );
    for (bucket, target) in [(&hung, &hung_target), (&live, &live_target)] {
        node.node_unpublish_volume(unpublish_req(bucket, target))
            .await
            .unwrap();
        assert!(!is_mountpoint(target));
    }
    eprintln!(
        "[csi] restarted node service: socket serving after {serving_after:?}, identity and \
         capabilities answered after {answered_after:?}, node calls after the adoption at \
         {adopted_after:?} (a stopped mounter's descriptor waited for)"
    );
}
