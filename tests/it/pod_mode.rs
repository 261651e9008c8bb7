//! Pod mode: the node service runs each mounter in a Pod of its own through the Kubernetes
//! API. The API server is a fake one on loopback (tests/it/common/fake_kube.rs) whose fake
//! kubelet runs a created Pod's container as a process on this machine, with only the
//! environment the Pod spec gives it; everything else is real: the `s3csi csi` node service
//! reached over its unix socket as kubelet does, the FUSE mount it makes, the descriptor
//! handed to the mounter over the hostPath socket, the moto S3 server.

use crate::common;

use common::fake_kube::{FakeKube, TEST_IMAGE};
use common::node_service::{publish_req, wait_replaced, CsiServer};
use common::{is_mountpoint, new_bucket, s3_get, s3csi_bin, scratch_dir};
use s3csi::csi::pb;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const NODE: &str = "test-node";
const NAMESPACE: &str = "s3csi-system";
const KEY_ID: &str = "AKIAPODMODETEST0001";
const SECRET: &str = "pod-mode-secret-value-0123456789";

fn start_node_service(dir: &Path, kube: &FakeKube) -> CsiServer {
    start_node_service_with(
        dir,
        kube,
        &[
            "--mounter-image",
            TEST_IMAGE,
            "--mounter-resources",
            r#"{"requests":{"cpu":"50m","memory":"64Mi"},"limits":{"memory":"512Mi"}}"#,
        ],
    )
}

/// A node service in pod mode with `flags` (image, resources, …) added.
fn start_node_service_with(dir: &Path, kube: &FakeKube, flags: &[&str]) -> CsiServer {
    let kubeconfig = kube.kubeconfig.to_string_lossy().to_string();
    let mut all = vec![
        "--mounter",
        "pod",
        "--mounter-namespace",
        NAMESPACE,
        "--mounter-service-account",
        "s3csi-mounter",
        "--mounter-priority-class",
        "system-node-critical",
    ];
    all.extend_from_slice(flags);
    CsiServer::options(dir.to_path_buf())
        .flags(&all)
        .env("KUBECONFIG", &kubeconfig)
        .start()
}

fn with_secrets(mut req: pb::NodePublishVolumeRequest) -> pb::NodePublishVolumeRequest {
    req.secrets.insert("accessKeyId".into(), KEY_ID.into());
    req.secrets.insert("secretAccessKey".into(), SECRET.into());
    req
}

fn pod_names(kube: &FakeKube) -> Vec<String> {
    kube.pods()
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

fn deletes(kube: &FakeKube, kind: &str) -> Vec<(String, Value)> {
    kube.requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && r.uri.contains(&format!("/{kind}/")))
        .map(|r| {
            let path = r.uri.split('?').next().unwrap_or("");
            (path.rsplit('/').next().unwrap_or("").to_string(), r.body)
        })
        .collect()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_for_object(bucket: &str, key: &str) -> Vec<u8> {
    let mut got = None;
    wait_until(&format!("{key} in S3"), || {
        got = s3_get(bucket, key);
        got.is_some()
    });
    got.unwrap()
}

/// Checks the Pod the node service asked for.
fn check_pod(pod: &Value, kube: &FakeKube, handoff_dir: &str) {
    let text = pod.to_string();
    assert!(
        !text.contains(SECRET) && !text.contains(KEY_ID),
        "credentials in the pod: {text}"
    );
    let meta = &pod["metadata"];
    assert_eq!(meta["namespace"], NAMESPACE);
    assert_eq!(meta["labels"]["app.kubernetes.io/managed-by"], "s3csi");
    assert_eq!(meta["labels"]["s3csi.dev/node"], NODE);
    assert!(meta["labels"]["s3csi.dev/mount"].is_string(), "{meta}");
    assert_eq!(
        meta["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": kube.node_uid}])
    );
    let spec = &pod["spec"];
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchFields"][0],
        json!({"key": "metadata.name", "operator": "In", "values": [NODE]})
    );
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["serviceAccountName"], "s3csi-mounter");
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["tolerations"], json!([{"operator": "Exists"}]));
    // No --mounter-host-network: the Pod's own network namespace and the default DNS policy.
    assert!(spec["hostNetwork"].is_null() && spec["dnsPolicy"].is_null());
    assert!(spec["hostPID"].is_null());
    let c = &spec["containers"][0];
    assert_eq!(c["image"], "registry.example/s3csi:test");
    assert_eq!(
        c["securityContext"],
        json!({"privileged": false, "allowPrivilegeEscalation": false,
               "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}})
    );
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    assert_eq!(c["resources"]["requests"]["cpu"], "50m");
    // The only volume is the mount's handoff directory: no /dev/fuse, no kubelet dir.
    assert_eq!(
        spec["volumes"],
        json!([{"name": "handoff", "hostPath": {"path": handoff_dir, "type": "Directory"}}])
    );
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "handoff", "mountPath": handoff_dir}])
    );
    // Credentials only by reference to the Secret.
    for e in c["env"].as_array().unwrap() {
        assert!(e["value"].is_null(), "literal env {e}");
        assert!(e["valueFrom"]["secretKeyRef"]["name"].is_string(), "{e}");
    }
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        &args[..4],
        ["mount", "--foreground", "--handoff-dir", handoff_dir]
    );
}

#[test]
fn pod_mode_mounter_pods_are_created_replaced_adopted_and_deleted() {
    let dir = scratch_dir("pod-mode");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    // Left over from an earlier node service: a Pod and a Secret of a mount that is gone.
    let orphan_labels = json!({"app.kubernetes.io/managed-by": "s3csi",
        "s3csi.dev/node": NODE, "s3csi.dev/mount": "00000000deadbeef"});
    kube.insert_pod(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "s3csi-mounter-00000000deadbeef-0", "namespace": NAMESPACE,
        "labels": orphan_labels}}));
    let mut first = start_node_service(&dir, &kube);
    wait_until("the orphan pod to be deleted", || {
        deletes(&kube, "pods")
            .iter()
            .any(|(n, _)| n == "s3csi-mounter-00000000deadbeef-0")
    });
    assert!(pod_names(&kube).is_empty());

    let bucket = new_bucket("pod-mode");
    let target = first.target("p");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(first.node());
    rt.block_on(node.node_publish_volume(with_secrets(publish_req(&bucket, &target))))
        .unwrap();
    assert!(is_mountpoint(&target));
    let pods = kube.pods();
    assert_eq!(pods.len(), 1, "{pods:?}");
    let pod0 = pods[0]["metadata"]["name"].as_str().unwrap().to_string();
    assert!(
        pod0.starts_with("s3csi-mounter-") && pod0.ends_with("-0"),
        "{pod0}"
    );
    let handoff_dir = pods[0]["spec"]["volumes"][0]["hostPath"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        handoff_dir.starts_with(dir.join("state").to_str().unwrap()),
        "{handoff_dir}"
    );
    check_pod(&pods[0], &kube, &handoff_dir);
    eprintln!("[pod mode] published {bucket}: mounter pod {pod0} serves the node's mount");
    // The credentials went to a Secret of the mount, labelled like its Pods.
    let secrets = kube.secrets();
    assert_eq!(secrets.len(), 1, "{secrets:?}");
    assert_eq!(secrets[0]["stringData"]["AWS_ACCESS_KEY_ID"], KEY_ID);
    assert_eq!(secrets[0]["stringData"]["AWS_SECRET_ACCESS_KEY"], SECRET);
    assert_eq!(
        secrets[0]["metadata"]["labels"]["s3csi.dev/mount"],
        pods[0]["metadata"]["labels"]["s3csi.dev/mount"]
    );
    assert!(!first.log_text().contains(SECRET));

    // The workload, served by the mounter Pod (which got its keys from the Secret only).
    std::fs::write(target.join("before.txt"), b"written before").unwrap();
    assert_eq!(wait_for_object(&bucket, "before.txt"), b"written before");
    eprintln!("[pod mode] wrote before.txt through the mount; it is in S3");

    // The mounter Pod's process dies: a replacement Pod gets the same descriptor.
    let pid0 = kube.pid_of(&pod0).expect("the mounter pod runs");
    let killed = Instant::now();
    unsafe {
        libc::kill(pid0 as i32, libc::SIGKILL);
    }
    let abnormal = rt.block_on(wait_replaced(&mut node, &bucket, &target, 1));
    eprintln!(
        "[pod mode] kill -9 of the mounter pod's process {pid0}: serving again after {} ms; \
         NodeGetVolumeStats on the way: {abnormal:?}",
        killed.elapsed().as_millis()
    );
    let log = first.log_text();
    assert!(
        log.contains("mounter died; starting a replacement")
            && log.contains(&format!("the mounter pod {pod0} stopped")),
        "{log}"
    );
    assert!(deletes(&kube, "pods").iter().any(|(n, _)| *n == pod0));
    let names = pod_names(&kube);
    assert_eq!(names.len(), 1, "{names:?}");
    let pod1 = names[0].clone();
    assert!(pod1.ends_with("-1"), "{pod1}");
    let p1 = &kube.pods()[0];
    check_pod(p1, &kube, &handoff_dir);
    assert!(p1["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .contains(&json!("--recover")));
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(
        std::fs::read(target.join("before.txt")).unwrap(),
        b"written before"
    );
    std::fs::write(target.join("after-crash.txt"), b"2").unwrap();
    assert_eq!(wait_for_object(&bucket, "after-crash.txt"), b"2");
    eprintln!(
        "[pod mode] replacement pod {pod1} (--recover): before.txt reads back, after-crash.txt written and in S3"
    );

    // The node service dies (its Pod restarted or upgraded): the mounter Pod serves on.
    first.kill9();
    std::fs::write(target.join("during.txt"), b"3").unwrap();
    assert_eq!(wait_for_object(&bucket, "during.txt"), b"3");
    eprintln!("[pod mode] kill -9 of the node service: during.txt written with no node service running; in S3");
    let second = start_node_service(&dir, &kube);
    let log = second.log_text();
    assert!(
        log.contains("adopted mount") && log.contains(&pod1) && log.contains("descriptor=true"),
        "{log}"
    );
    let mut node = rt.block_on(second.node());
    eprintln!("[pod mode] new node service adopted {pod1} and collected its descriptor");
    // The adopted mount's Pod stays; nothing else was deleted at this start.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pod_names(&kube), vec![pod1.clone()]);
    assert!(!deletes(&kube, "pods").iter().any(|(n, _)| *n == pod1));
    // ... and the new node service can replace it too.
    let pid1 = kube.pid_of(&pod1).expect("the replacement pod runs");
    unsafe {
        libc::kill(pid1 as i32, libc::SIGKILL);
    }
    rt.block_on(wait_replaced(&mut node, &bucket, &target, 2));
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(std::fs::read(target.join("during.txt")).unwrap(), b"3");
    let pod2 = pod_names(&kube)[0].clone();
    assert!(pod2.ends_with("-2"), "{pod2}");
    eprintln!("[pod mode] kill -9 of {pod1}: the new node service replaced it with {pod2}; during.txt reads back");

    // Unpublish: the Pod is deleted with a grace period (the mounter completes uploads
    // on SIGTERM), then its Secret; the target is unmounted.
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(!is_mountpoint(&target));
    let pod_deletes = deletes(&kube, "pods");
    let (_, body) = pod_deletes.iter().find(|(n, _)| *n == pod2).unwrap();
    assert!(
        body["gracePeriodSeconds"].as_u64().unwrap_or(0) > 0,
        "{body}"
    );
    assert!(kube.pods().is_empty() && kube.secrets().is_empty());
    wait_until("the mounter pod's process to exit", || {
        kube.pid_of(&pod2).is_none()
    });
    let log = second.log_text();
    assert!(!log.contains(SECRET), "{log}");
    eprintln!(
        "[pod mode] unpublished: {pod2} deleted with a {}s grace period, its Secret deleted, target unmounted",
        body["gracePeriodSeconds"]
    );
    drop(second);
    drop(first);
}

/// Files held open across `kill -9` of the mounter Pod's process, then a kill while a
/// close waits for S3: see [`common::crash::files_open_across_mounter_kills`].
#[test]
fn pod_mode_files_open_across_mounter_kills_answer_every_call() {
    let dir = scratch_dir("pod-files");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let server = start_node_service(&dir, &kube);
    let bucket = new_bucket("pod-files");
    let target = server.target("files");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    common::crash::files_open_across_mounter_kills(&rt, &mut node, &bucket, &target, || {
        // The newest generation (`-N`) is the one serving.
        let pod = pod_names(&kube)
            .into_iter()
            .max_by_key(|n| n.rsplit('-').next().and_then(|g| g.parse::<u32>().ok()))
            .expect("a mounter pod");
        let pid = kube.pid_of(&pod).expect("the mounter pod runs");
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
        common::crash::wait_dead(pid);
    });
    drop(server);
}

#[test]
fn pod_mode_reports_why_a_mounter_pod_failed() {
    let dir = scratch_dir("pod-mode-fail");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let server = start_node_service(&dir, &kube);
    let target = server.target("f");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    let err = rt
        .block_on(node.node_publish_volume(with_secrets(publish_req(
            "no-such-bucket-pod-mode",
            &target,
        ))))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains("no-such-bucket-pod-mode"), "{err:?}");
    assert!(!err.message().contains(SECRET));
    assert!(!is_mountpoint(&target));
    // The failed Pod and its Secret are gone.
    assert!(kube.pods().is_empty(), "{:?}", kube.pods());
    assert!(kube.secrets().is_empty(), "{:?}", kube.secrets());
    drop(server);
}

#[test]
fn pod_mode_hands_the_node_services_own_keys_to_mounters() {
    // A volume without secrets: a child process would inherit the node service's static
    // keys (the chart's awsCredentials), so a mounter Pod gets them through its Secret.
    let dir = scratch_dir("pod-mode-own-keys");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let server = start_node_service(&dir, &kube);
    let bucket = new_bucket("pod-mode-own-keys");
    let target = server.target("k");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    rt.block_on(node.node_publish_volume(publish_req(&bucket, &target)))
        .unwrap();
    let secrets = kube.secrets();
    assert_eq!(secrets.len(), 1, "{secrets:?}");
    assert_eq!(
        secrets[0]["stringData"]["AWS_ACCESS_KEY_ID"],
        common::ACCESS_KEY
    );
    assert!(!kube.pods()[0].to_string().contains(common::SECRET_KEY));
    std::fs::write(target.join("k.txt"), b"keys from the node").unwrap();
    assert_eq!(wait_for_object(&bucket, "k.txt"), b"keys from the node");
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(kube.pods().is_empty() && kube.secrets().is_empty());
    drop(server);
}

#[test]
fn pod_mode_mounter_pods_can_use_the_host_network() {
    // --mounter-host-network (the chart's mounter.hostNetwork, which follows node.hostNetwork
    // by default): the Pod asks for the node's network namespace, with cluster DNS from there,
    // and nothing else about it changes.
    let dir = scratch_dir("pod-mode-host-network");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let kubeconfig = kube.kubeconfig.to_string_lossy().to_string();
    let server = CsiServer::options(dir.to_path_buf())
        .flags(&[
            "--mounter",
            "pod",
            "--mounter-image",
            "registry.example/s3csi:test",
            "--mounter-namespace",
            NAMESPACE,
            "--mounter-host-network",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .start();
    let bucket = new_bucket("pod-mode-host-network");
    let target = server.target("h");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    rt.block_on(node.node_publish_volume(publish_req(&bucket, &target)))
        .unwrap();
    let pods = kube.pods();
    assert_eq!(pods.len(), 1, "{pods:?}");
    let spec = &pods[0]["spec"];
    assert_eq!(spec["hostNetwork"], true, "{spec}");
    assert_eq!(spec["dnsPolicy"], "ClusterFirstWithHostNet", "{spec}");
    assert!(
        spec["hostPID"].is_null() && spec["hostIPC"].is_null(),
        "{spec}"
    );
    let c = &spec["containers"][0];
    assert_eq!(
        c["securityContext"],
        json!({"privileged": false, "allowPrivilegeEscalation": false,
               "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}})
    );
    assert!(c["ports"].is_null(), "a mounter opens no port: {c}");
    std::fs::write(target.join("h.txt"), b"host network").unwrap();
    assert_eq!(wait_for_object(&bucket, "h.txt"), b"host network");
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(kube.pods().is_empty() && kube.secrets().is_empty());
    drop(server);
}

/// Publishes a volume whose mounter Pod will not serve (`what`, for the printed figure);
/// returns the error and how long NodePublishVolume took to give it. Checks that nothing is
/// left: no mount, no mounter Pod, no Secret, no credentials in the message.
fn publish_fails(
    server: &CsiServer,
    kube: &FakeKube,
    leaf: &str,
    what: &str,
) -> (tonic::Status, Duration) {
    let target = server.target(leaf);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    let started = Instant::now();
    let err = rt
        .block_on(node.node_publish_volume(with_secrets(publish_req("pod-never-serves", &target))))
        .unwrap_err();
    let took = started.elapsed();
    eprintln!(
        "[pod mode] {what}: NodePublishVolume failed after {} ms: {:?} {}",
        took.as_millis(),
        err.code(),
        err.message()
    );
    assert!(!is_mountpoint(&target));
    let msg = err.message();
    assert!(!msg.contains(SECRET) && !msg.contains(KEY_ID), "{msg}");
    assert!(!server.log_text().contains(SECRET));
    let mounters: Vec<String> = pod_names(kube)
        .into_iter()
        .filter(|n| n.starts_with("s3csi-mounter-"))
        .collect();
    assert!(mounters.is_empty(), "{mounters:?}");
    assert!(kube.secrets().is_empty(), "{:?}", kube.secrets());
    // The Pod was deleted at once (there is nothing to flush) and its status was read.
    let deleted = deletes(kube, "pods");
    let (name, body) = deleted.last().expect("the mounter pod was deleted");
    assert_eq!(body["gracePeriodSeconds"], 0, "{body}");
    assert!(msg.contains(name.as_str()), "{msg}");
    assert!(
        kube.requests()
            .iter()
            .any(|r| r.method == "GET" && r.uri.ends_with(&format!("/pods/{name}"))),
        "the node service never read the pod"
    );
    (err, took)
}

/// The Events list requests the node service made for Pod `name`.
/// A publish whose mounter Pod is stuck (the scheduler or kubelet keeps retrying): it
/// fails with Internal after the 10 s grace, well before the 60 s mount timeout, from what
/// the node service read in the Pod's status and Events. Returns the message.
fn fails_after_the_stuck_grace(
    server: &CsiServer,
    kube: &FakeKube,
    leaf: &str,
    what: &str,
) -> String {
    let (err, took) = publish_fails(server, kube, leaf, what);
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");
    let msg = err.message().to_string();
    assert!(msg.contains("did not start within 10s"), "{msg}");
    assert!(
        took >= Duration::from_secs(10) && took < Duration::from_secs(20),
        "{took:?}"
    );
    assert!(event_reads(kube) > 0);
    msg
}

fn event_reads(kube: &FakeKube) -> usize {
    kube.requests()
        .iter()
        .filter(|r| {
            r.method == "GET"
                && r.uri.starts_with(&format!("/api/v1/namespaces/{NAMESPACE}/events?"))
                && r.uri.contains("fieldSelector=involvedObject.kind%3DPod%2CinvolvedObject.name%3Ds3csi-mounter-")
        })
        .count()
}

#[test]
fn pod_mode_fails_fast_when_the_mounter_pod_cannot_be_scheduled() {
    let dir = scratch_dir("pod-mode-unschedulable");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    // Another workload's Pod takes nearly all of the node's memory.
    kube.insert_pod(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "memory-hog", "namespace": "default", "uid": "hog-uid",
                     "labels": {"app": "hog"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "hog", "image": "hog:1",
            "resources": {"requests": {"memory": "8180Mi"}}}]},
        "status": {"phase": "Running"}}));
    let server = start_node_service(&dir, &kube);
    let msg = fails_after_the_stuck_grace(&server, &kube, "u", "unschedulable mounter pod");
    assert!(
        msg.contains("Unschedulable: 0/1 nodes are available: 1 Insufficient memory.")
            && msg.contains("(condition PodScheduled)"),
        "{msg}"
    );
    // The Pod's real reason is also in the scheduler's Events (still there, as in a real
    // cluster).
    assert!(kube
        .events()
        .iter()
        .any(|e| e["reason"] == "FailedScheduling" && e["type"] == "Warning"));

    // Once the node has room, kubelet's retry of the publish works (its new Pod has the
    // same name; the old one's Events do not count against it).
    kube.remove_pod("memory-hog");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let bucket = new_bucket("pod-mode-unsched");
    let target = server.target("u");
    let mut node = rt.block_on(server.node());
    rt.block_on(node.node_publish_volume(with_secrets(publish_req(&bucket, &target))))
        .unwrap();
    assert!(is_mountpoint(&target));
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    drop(server);
}

#[test]
fn pod_mode_fails_fast_when_the_mounter_pod_gets_no_sandbox() {
    let dir = scratch_dir("pod-mode-sandbox");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let cni = "rpc error: code = Unknown desc = failed to setup network for sandbox \
               \"4f1c9e\": plugin type=\"bridge\" name=\"cbr0\" failed (add): failed to \
               allocate for range 0: no IP addresses available in range set: \
               10.88.0.1-10.88.255.254";
    kube.break_sandboxes(Some(cni));
    let server = start_node_service(&dir, &kube);
    let msg = fails_after_the_stuck_grace(&server, &kube, "s", "mounter pod without a sandbox");
    assert!(
        msg.contains("FailedCreatePodSandBox: Failed to create pod sandbox: ")
            && msg.contains("no IP addresses available in range set")
            && msg.contains("Warning event from kubelet"),
        "{msg}"
    );
    drop(server);
}

#[test]
fn pod_mode_fails_fast_on_image_errors_and_times_out_with_the_last_reason() {
    let dir = scratch_dir("pod-mode-image");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let missing = "registry.example/s3csi:no-such-tag";
    let cases = [
        // Not in the registry: ErrImagePull, then ImagePullBackOff.
        (
            "pull",
            "IfNotPresent",
            missing,
            &["ErrImagePull", "ImagePullBackOff"][..],
        ),
        // Not on the node, and not to be pulled.
        ("never", "Never", missing, &["ErrImageNeverPull"][..]),
    ];
    for (leaf, policy, image, reasons) in cases {
        let sub = dir.join(leaf);
        std::fs::create_dir_all(&sub).unwrap();
        let server = start_node_service_with(
            &sub,
            &kube,
            &[
                "--mounter-image",
                image,
                "--mounter-image-pull-policy",
                policy,
            ],
        );
        let what = format!("image {image} with imagePullPolicy {policy}");
        let (err, took) = publish_fails(&server, &kube, leaf, &what);
        let msg = err.message();
        assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");
        assert!(msg.contains("cannot run: "), "{msg}");
        assert!(
            reasons.iter().any(|r| msg.contains(&format!("{r}: "))),
            "{reasons:?}: {msg}"
        );
        assert!(msg.contains(image), "{msg}");
        assert!(msg.contains("(container mounter waiting)"), "{msg}");
        if policy == "Never" {
            assert!(
                msg.contains("is not present with pull policy of Never"),
                "{msg}"
            );
        } else {
            assert!(msg.contains("not found"), "{msg}");
        }
        assert!(took < Duration::from_secs(5), "{took:?}");
        drop(server);
    }

    // A pull that never ends is no failure of its own: the mount timeout says what the
    // Pod was doing.
    kube.stall_pulls(true);
    let sub = dir.join("stall");
    std::fs::create_dir_all(&sub).unwrap();
    let server = start_node_service_with(
        &sub,
        &kube,
        &[
            "--mounter-image",
            TEST_IMAGE,
            "--mounter-image-pull-policy",
            "Always",
            "--mount-timeout",
            "3",
        ],
    );
    let what = "image pull that never ends, --mount-timeout 3";
    let (err, took) = publish_fails(&server, &kube, "stall", what);
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(
        err.message().contains(&format!(
            "was not ready within 3s; last seen: Pulling: Pulling image \"{TEST_IMAGE}\" \
             (Normal event from kubelet)"
        )),
        "{}",
        err.message()
    );
    assert!(took < Duration::from_secs(6), "{took:?}");
    drop(server);
}

/// Pods of one volume with the same options and credentials share one mounter Pod (and
/// one Secret); other credentials get a mounter Pod of their own, never the first one's.
/// The mounter Pod goes with the last target that uses it.
#[test]
fn pod_mode_pods_of_one_volume_share_a_mounter_pod_per_credentials() {
    let dir = scratch_dir("pod-share");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    let server = start_node_service(&dir, &kube);
    let bucket = new_bucket("pod-share");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    let (a, b, c) = (server.target("a"), server.target("b"), server.target("c"));
    for t in [&a, &b] {
        rt.block_on(node.node_publish_volume(with_secrets(publish_req(&bucket, t))))
            .unwrap();
    }
    assert_eq!(pod_names(&kube).len(), 1, "{:?}", pod_names(&kube));
    assert_eq!(kube.secrets().len(), 1);
    std::fs::write(a.join("shared.txt"), b"one mounter").unwrap();
    assert_eq!(std::fs::read(b.join("shared.txt")).unwrap(), b"one mounter");

    // Another tenant's keys (the same ones here, named by another key id: the server
    // accepts any): a second mounter Pod and Secret.
    let mut other = publish_req(&bucket, &c);
    other
        .secrets
        .insert("accessKeyId".into(), "AKIAPODMODETEST0002".into());
    other
        .secrets
        .insert("secretAccessKey".into(), SECRET.into());
    rt.block_on(node.node_publish_volume(other)).unwrap();
    assert_eq!(pod_names(&kube).len(), 2);
    let secrets = kube.secrets();
    assert_eq!(secrets.len(), 2);
    let ids: Vec<_> = secrets
        .iter()
        .map(|s| {
            s["stringData"]["AWS_ACCESS_KEY_ID"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(ids.contains(&KEY_ID.to_string()) && ids.contains(&"AKIAPODMODETEST0002".to_string()));

    let unpublish = |t: &Path| pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: t.to_string_lossy().to_string(),
    };
    rt.block_on(node.node_unpublish_volume(unpublish(&a)))
        .unwrap();
    assert_eq!(
        pod_names(&kube).len(),
        2,
        "b still uses the first mounter pod"
    );
    assert_eq!(std::fs::read(b.join("shared.txt")).unwrap(), b"one mounter");
    for t in [&b, &c] {
        rt.block_on(node.node_unpublish_volume(unpublish(t)))
            .unwrap();
    }
    assert!(kube.pods().is_empty() && kube.secrets().is_empty());
    assert!(!server.log_text().contains(SECRET));
}

#[test]
fn pod_mode_pod_credentials_give_each_service_account_its_own_mounter_pod() {
    use crate::credentials::{
        files_named, pod_publish_req, role_proxy, ROLE_ANNOTATION, ROLE_READER, ROLE_WRITER,
    };
    let dir = scratch_dir("pod-mode-pod-credentials");
    let kube = FakeKube::start(&dir, NODE, s3csi_bin());
    kube.insert_service_account("team-a", "reader", &[(ROLE_ANNOTATION, ROLE_READER)]);
    kube.insert_service_account("team-b", "writer", &[(ROLE_ANNOTATION, ROLE_WRITER)]);
    let (proxy, seen) = role_proxy();
    let endpoint = proxy.endpoint();
    let server = start_node_service(&dir, &kube);
    let bucket = new_bucket("pod-mode-pod-credentials");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    let pid = std::process::id();
    let token = |who: &str| format!("eyJ-pod-mode-{who}-{pid}");
    let publish = |pod: &str, ns: &str, sa: &str, tok: &str| {
        pod_publish_req(
            &bucket,
            &server.target(pod),
            &endpoint,
            (pod, ns, sa),
            Some(tok),
        )
    };
    for (pod, ns, sa) in [
        ("reader-0", "team-a", "reader"),
        ("reader-1", "team-a", "reader"),
        ("writer-0", "team-b", "writer"),
    ] {
        rt.block_on(node.node_publish_volume(publish(pod, ns, sa, &token(pod))))
            .unwrap_or_else(|e| panic!("publish {pod}: {e}\n{}", server.log_text()));
    }
    assert_eq!(
        pod_names(&kube).len(),
        2,
        "one mounter Pod per service account"
    );
    std::fs::write(server.target("reader-0").join("a.txt"), b"team a").unwrap();
    assert_eq!(
        std::fs::read(server.target("reader-1").join("a.txt")).unwrap(),
        b"team a"
    );
    assert_eq!(
        std::fs::read(server.target("writer-0").join("a.txt")).unwrap(),
        b"team a"
    );

    // Each Pod's Secret names its role and the token's file, and holds no token or key.
    let secrets = kube.secrets();
    let mut roles: Vec<&str> = secrets
        .iter()
        .map(|s| s["stringData"]["AWS_ROLE_ARN"].as_str().unwrap())
        .collect();
    roles.sort();
    assert_eq!(roles, [ROLE_READER, ROLE_WRITER]);
    for s in &secrets {
        let file = s["stringData"]["AWS_WEB_IDENTITY_TOKEN_FILE"]
            .as_str()
            .unwrap();
        assert!(file.ends_with("/pod-token"), "{file}");
        assert!(s["stringData"].get("AWS_ACCESS_KEY_ID").is_none(), "{s}");
    }
    let objects = format!("{:?}{:?}", kube.pods(), secrets);
    for pod in ["reader-0", "reader-1", "writer-0"] {
        assert!(
            !objects.contains(&token(pod)),
            "a token in a Kubernetes object"
        );
    }
    {
        let s = seen.lock().unwrap();
        assert!(
            !s.s3_roles.is_empty()
                && s.s3_roles
                    .iter()
                    .all(|r| r == ROLE_READER || r == ROLE_WRITER),
            "{:?}",
            s.s3_roles
        );
    }

    // A republish rewrites the token the mounter Pod reads through its hostPath.
    let fresh = token("reader-1-refreshed");
    rt.block_on(node.node_publish_volume(publish("reader-1", "team-a", "reader", &fresh)))
        .unwrap();
    let files = files_named(&dir, "pod-token");
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(
        files
            .iter()
            .any(|f| std::fs::read_to_string(f).unwrap() == fresh),
        "no token file holds the republished token"
    );

    for pod in ["reader-0", "reader-1", "writer-0"] {
        rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: bucket.clone(),
            target_path: server.target(pod).to_string_lossy().to_string(),
        }))
        .unwrap();
    }
    assert!(kube.pods().is_empty() && kube.secrets().is_empty());
    assert!(files_named(&dir, "pod-token").is_empty());
    let log = server.log_text();
    assert!(!log.contains(&fresh) && !log.contains(&token("reader-0")));
    drop(proxy);
}
