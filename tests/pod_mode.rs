//! Pod mode: the node service runs each mounter in a Pod of its own through the Kubernetes
//! API. The API server is a fake one on loopback (tests/common/fake_kube.rs) whose fake
//! kubelet runs a created Pod's container as a process on this machine, with only the
//! environment the Pod spec gives it; everything else is real: the `s3csi csi` node service
//! reached over its unix socket as kubelet does, the FUSE mount it makes, the descriptor
//! handed to the mounter over the hostPath socket, the moto S3 server.

mod common;

use common::fake_kube::FakeKube;
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
    let kubeconfig = kube.kubeconfig.to_string_lossy().to_string();
    CsiServer::options(dir.to_path_buf())
        .flags(&[
            "--mounter",
            "pod",
            "--mounter-image",
            "registry.example/s3csi:test",
            "--mounter-namespace",
            NAMESPACE,
            "--mounter-service-account",
            "s3csi-mounter",
            "--mounter-priority-class",
            "system-node-critical",
            "--mounter-resources",
            r#"{"requests":{"cpu":"50m","memory":"64Mi"},"limits":{"memory":"512Mi"}}"#,
        ])
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
    assert!(spec["hostNetwork"].is_null() && spec["hostPID"].is_null());
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
