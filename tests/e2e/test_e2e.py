"""The scenarios of issue 19 on a real one-node Kubernetes v1.20.2 (tests/e2e/run.sh brings it
up): the chart installed with the built-in kubelet registration, the embedded S3 server,
static and dynamic volumes, pod-mode mounters and every crash story. Each prints its timings
(`[e2e] ...: N s`). They run in file order and share the install: scenario 2's workload pod is
the one scenarios 4-6 crash things under.

Scenario 8 (two pods on one PVC share one mounter) and 8b (pod-level credentials: kubelet's
service-account tokens, exchanged at moto's STS for the role annotated on each pod's
ServiceAccount) close the issue's list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import csi_client
import kube
from conftest import BUCKET, DRIVER, SECRET_KEY, S3, Release, e2e_values, timing
from kube import NODE, NS, exec_in, get, kubectl, wait_for

BUSYBOX = "local/busybox:1"
# A workload that exits promptly on SIGTERM (a shell as pid 1 ignores it otherwise).
IDLE = "trap 'exit 0' TERM; while true; do sleep 1; done"
STATIC_PV = "e2e-static"
STATIC_PREFIX = "static/app/"


def workload(name: str, claim: str, script: str, security: dict[str, Any] | None = None,
             grace: int = 10) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "terminationGracePeriodSeconds": grace,
        "containers": [{"name": "app", "image": BUSYBOX, "imagePullPolicy": "Never",
                        "command": ["sh", "-c", script],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
    }
    if security:
        spec["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def claim(name: str, storage_class: str, volume: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"storageClassName": storage_class, "accessModes": ["ReadWriteMany"],
                            "resources": {"requests": {"storage": "1Gi"}}}
    if volume:
        spec["volumeName"] = volume
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def running(name: str, timeout: float = 120) -> float:
    def ok() -> bool:
        pod = get("pod", name, "default")
        if pod and pod["status"].get("phase") in ("Failed", "Succeeded"):
            raise AssertionError(f"{name} ended: {json.dumps(pod['status'])}")
        return kube.pod_ready(pod)
    try:
        took = wait_for(ok, timeout, f"pod {name} Running")
    except AssertionError:
        print(kubectl("describe", "pod", name, "-n", "default", check=False))
        raise
    # Where the time went, from the Pod's own timestamps (whole seconds).
    pod = get("pod", name, "default")
    created = _ts(pod["metadata"]["creationTimestamp"])
    steps = {c["type"]: _ts(c["lastTransitionTime"]) - created
             for c in pod["status"].get("conditions", [])}
    print(f"[e2e]    {name}: " + ", ".join(f"{k} +{v:.0f} s" for k, v in sorted(
        steps.items(), key=lambda kv: kv[1])), flush=True)
    return took


def _ts(text: str) -> float:
    import datetime
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def mounter_pods() -> list[dict[str, Any]]:
    """Mounter Pods that are not being deleted and have not ended."""
    pods = get("pods", ns=NS, selector="app.kubernetes.io/name=s3csi-mounter")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") not in ("Failed", "Succeeded")]


def any_mounter_pods() -> list[str]:
    """Every mounter Pod object, terminating and ended ones too."""
    return [p["metadata"]["name"]
            for p in get("pods", ns=NS, selector="app.kubernetes.io/name=s3csi-mounter")]


def node_socket() -> Path:
    return kube.KUBELET_DIR / "plugins" / DRIVER / "csi.sock"


def volume_condition(volume_id: str, target: Path) -> Any:
    pb = csi_client.pb
    stats = csi_client.node(node_socket()).NodeGetVolumeStats(
        pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(target)), timeout=30)
    return stats.volume_condition


def csinode_drivers() -> list[str]:
    node = get("csinode", NODE)
    return [d["name"] for d in (node or {}).get("spec", {}).get("drivers") or []]


def node_logs(pod: dict[str, Any], previous: bool = False) -> str:
    args = ["logs", "-n", NS, pod["metadata"]["name"], "-c", "s3csi"]
    return kubectl(*args, *(["--previous"] if previous else []), check=False)


# --- 1 ---------------------------------------------------------------------------------------
def test_1_node_plugin_registers_and_controller_is_ready(release: Release) -> None:
    wait_for(lambda: kube.pod_ready(release.node_pod()), 120, "the node plugin Running")
    timing("1. node plugin Running, from kubectl apply of the chart",
           time.monotonic() - release.installed_at)
    wait_for(lambda: DRIVER in csinode_drivers(), 60, f"CSINode {NODE} lists {DRIVER}")
    node = release.node_pod()
    wait_for(lambda: "registered with the kubelet" in node_logs(node), 30,
             "the kubelet's NotifyRegistrationStatus")
    timing("1. registered: CSINode lists s3csi.dev, from kubectl apply",
           time.monotonic() - release.installed_at)
    assert [c["name"] for c in node["spec"]["containers"]] == ["s3csi"], "no sidecar"
    wait_for(lambda: kube.pod_ready(release.controller_pod()), 120, "the controller Ready")
    timing("1. controller Ready, from kubectl apply", time.monotonic() - release.installed_at)
    csinode = get("csinode", NODE)
    entry = next(d for d in csinode["spec"]["drivers"] if d["name"] == DRIVER)
    assert entry["nodeID"] == NODE


# --- 2 ---------------------------------------------------------------------------------------
def test_2_static_volume_pod_writes_and_reads(release: Release, s3: S3) -> None:
    s3.client.put_object(Bucket=BUCKET, Key=STATIC_PREFIX + "existing.txt", Body=b"was here\n")
    # The PV first, as an admin makes it: a claim created in the same breath waits for the PV
    # controller's next resync (15 s) to bind.
    kube.apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": STATIC_PV},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "claimRef": {"namespace": "default", "name": "static"},
                  "csi": {"driver": DRIVER, "volumeHandle": f"{BUCKET}/{STATIC_PREFIX.rstrip('/')}",
                          "volumeAttributes": {"forcePathStyle": "true"}}}}])
    wait_for(lambda: get("pv", STATIC_PV)["status"].get("phase") == "Available", 30,
             "the static PV Available")
    kube.apply([claim("static", "", STATIC_PV)])
    # And the pod once the claim is bound (else the scheduler backs off for ~10 s).
    wait_for(lambda: get("pvc", "static", "default")["status"].get("phase") == "Bound", 30,
             "the static claim Bound")
    kube.apply([
        workload("w1", "static",
                 "cat /data/existing.txt && echo hello from w1 > /data/hello.txt && "
                 f"cat /data/hello.txt && {IDLE}"),
    ])
    t0 = time.monotonic()
    timing("2. static PV: pod Running after apply", running("w1"))
    assert "hello from w1" in kubectl("logs", "w1", "-n", "default")
    wait_for(lambda: s3.read(STATIC_PREFIX + "hello.txt") == b"hello from w1\n", 30,
             "hello.txt in S3")
    timing("2. static PV: hello.txt in S3 under its prefix", time.monotonic() - t0)
    assert "was here" in kubectl("logs", "w1", "-n", "default")


def test_2b_no_secret_in_argv_logs_or_pod_objects(release: Release) -> None:
    pods = kubectl("get", "pods", "--all-namespaces", "-o", "json")
    assert SECRET_KEY not in pods
    for pod in get("pods", ns=NS):
        for c in pod["spec"]["containers"]:
            log = kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", c["name"], check=False)
            assert SECRET_KEY not in log, pod["metadata"]["name"]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert SECRET_KEY.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            pass
    assert mounter_pods(), "the static volume has a mounter pod"


def test_2c_failed_publish_reaches_the_pod_events(release: Release) -> None:
    """A volume whose bucket does not exist: NodePublishVolume fails with the mounter's own
    reason, the kubelet shows it in a FailedMount event of the pod, retries, and the pod can
    still be deleted at once; no mounter Pod is left for it."""
    before = sorted(any_mounter_pods())
    kube.apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "e2e-missing"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "claimRef": {"namespace": "default", "name": "missing"},
                  "csi": {"driver": DRIVER, "volumeHandle": "no-such-bucket/x",
                          "volumeAttributes": {"forcePathStyle": "true"}}}}])
    wait_for(lambda: get("pv", "e2e-missing")["status"].get("phase") == "Available", 30,
             "the PV Available")
    kube.apply([claim("missing", "", "e2e-missing")])
    wait_for(lambda: get("pvc", "missing", "default")["status"].get("phase") == "Bound", 30,
             "the claim Bound")
    kube.apply([workload("missing", "missing", IDLE)])
    t0 = time.monotonic()

    def failed_mount() -> str:
        events = get("events", ns="default") or []
        return next((e["message"] for e in events
                     if e["involvedObject"].get("name") == "missing"
                     and e.get("reason") == "FailedMount" and "no-such-bucket" in e["message"]), "")
    wait_for(failed_mount, 90, "a FailedMount event naming the bucket")
    timing("2c. missing bucket: FailedMount event on the pod", time.monotonic() - t0)
    print(f"[e2e] 2c. {failed_mount()[:300]}")
    assert get("pod", "missing", "default")["status"]["phase"] == "Pending"
    timing("2c. the pod that never mounted deleted", gone_after_delete("missing", 10))
    kube.delete("pvc", "missing", "default", wait=True)
    kube.delete("pv", "e2e-missing", wait=True)
    wait_for(lambda: sorted(any_mounter_pods()) == before, 60, "no mounter pod left for it")


# --- 3 ---------------------------------------------------------------------------------------
def test_3_dynamic_volumes_delete_and_retain(release: Release, s3: S3, provisioner: Any) -> None:
    kube.apply([claim("dyn-delete", "e2e-delete"), claim("dyn-retain", "e2e-retain")])
    t0 = time.monotonic()
    for name in ("dyn-delete", "dyn-retain"):
        wait_for(lambda n=name: get("pvc", n, "default")["status"].get("phase") == "Bound", 60,
                 f"{name} Bound")
    timing("3. two PVCs Bound (CreateVolume, PV, binding)", time.monotonic() - t0)
    pv_of = {n: get("pvc", n, "default")["spec"]["volumeName"] for n in ("dyn-delete", "dyn-retain")}
    prefix = {"dyn-delete": f"dyn/{pv_of['dyn-delete']}/", "dyn-retain": f"kept/{pv_of['dyn-retain']}/"}
    for name in pv_of:
        pv = get("pv", pv_of[name])
        assert pv["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] == DRIVER
        assert pv["spec"]["csi"]["volumeHandle"] == f"{BUCKET}/{prefix[name].rstrip('/')}"
        kube.apply([workload(f"p-{name}", name, f"echo {name} > /data/f.txt && {IDLE}")])
    t0 = time.monotonic()
    for name in pv_of:
        running(f"p-{name}")
        wait_for(lambda n=name: s3.read(prefix[n] + "f.txt") == f"{n}\n".encode(), 30,
                 f"{prefix[name]}f.txt in S3")
    timing("3. pods Running and their files in S3 under their own prefixes", time.monotonic() - t0)

    for name in pv_of:
        kube.delete("pod", f"p-{name}", "default", wait=True)
        kube.delete("pvc", name, "default", wait=True)
    t0 = time.monotonic()
    wait_for(lambda: get("pv", pv_of["dyn-delete"]) is None and not s3.keys(prefix["dyn-delete"]),
             60, "reclaimPolicy Delete: the PV and its prefix gone")
    timing("3. Delete: PV and prefix gone after the PVC's deletion", time.monotonic() - t0)
    assert not s3.keys(f"dyn/.s3csi-volumes/{pv_of['dyn-delete']}")
    wait_for(lambda: get("pv", pv_of["dyn-retain"])["status"]["phase"] == "Released", 30,
             "reclaimPolicy Retain: the PV Released")
    assert s3.keys(prefix["dyn-retain"]) == [prefix["dyn-retain"], prefix["dyn-retain"] + "f.txt"]
    kube.delete("pv", pv_of["dyn-retain"], wait=True)
    assert s3.read(prefix["dyn-retain"] + "f.txt") == b"dyn-retain\n", "Retain keeps the data"


# --- 4 ---------------------------------------------------------------------------------------
def test_4_mounter_pod_killed_workload_carries_on(release: Release, s3: S3) -> None:
    w1 = get("pod", "w1", "default")
    target = kube.csi_target(w1, STATIC_PV)
    volume_id = f"{BUCKET}/{STATIC_PREFIX.rstrip('/')}"
    (mounter,) = mounter_pods()
    spec = mounter["spec"]
    for c in spec["containers"]:
        sc = c.get("securityContext", {})
        assert not sc.get("privileged"), "mounter pods are unprivileged"
        assert sc.get("allowPrivilegeEscalation") is False
        assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    assert spec["nodeName"] == NODE
    assert not volume_condition(volume_id, target).abnormal

    pid = kube.container_pid(mounter, spec["containers"][0]["name"])
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    out = exec_in("w1", "cat /data/hello.txt && echo after-kill > /data/after-kill.txt && "
                  "cat /data/after-kill.txt")
    timing("4. kill -9 of the mounter: the workload's next read and write answered after",
           time.monotonic() - t0)
    assert out == "hello from w1\nafter-kill\n"
    old = mounter["metadata"]["name"]
    wait_for(lambda: [p for p in mounter_pods()
                      if p["metadata"]["name"] != old and kube.pod_ready(p)], 60,
             "the replacement mounter pod Running")
    timing("4. replacement mounter pod Running", time.monotonic() - t0)
    wait_for(lambda: not volume_condition(volume_id, target).abnormal, 30,
             "the volume condition normal again")
    timing("4. volume condition normal again", time.monotonic() - t0)
    print(f"[e2e] 4. {volume_condition(volume_id, target).message}")
    assert kube.restarts(get("pod", "w1", "default")) == 0
    wait_for(lambda: s3.read(STATIC_PREFIX + "after-kill.txt") == b"after-kill\n", 30,
             "after-kill.txt in S3")
    wait_for(lambda: get("pod", old, NS) is None, 60, f"the dead mounter pod {old} deleted")
    timing("4. the dead mounter pod's object deleted by the node plugin", time.monotonic() - t0)


# --- 5 ---------------------------------------------------------------------------------------
def restart_node_plugin_and_check(release: Release, s3: S3, what: str, action: Any,
                                  image: str | None = None) -> None:
    before = release.node_pod()
    mounters = sorted(p["metadata"]["name"] for p in mounter_pods())
    t0 = time.monotonic()
    action(before)
    wait_for(lambda: get("pod", before["metadata"]["name"], NS) is None, 120,
             "the old node plugin pod gone")
    timing(f"5. {what}: old node plugin pod gone", time.monotonic() - t0)

    def new_pod_ready() -> bool:
        pod = release.node_pod()
        return bool(pod and pod["metadata"]["uid"] != before["metadata"]["uid"]
                    and kube.pod_ready(pod)
                    and (image is None or pod["spec"]["containers"][0]["image"] == image))
    wait_for(new_pod_ready, 120, f"a new node plugin pod ({what})")
    timing(f"5. {what}: new node plugin pod Running", time.monotonic() - t0)
    wait_for(lambda: DRIVER in csinode_drivers(), 60, "registered again")
    timing(f"5. {what}: registered with the kubelet again", time.monotonic() - t0)
    new = release.node_pod()
    wait_for(lambda: "adopted" in node_logs(new), 30, "the new node plugin adopting the mount")
    key = what.split(":")[0].replace(" ", "-")
    out = exec_in("w1", f"cat /data/hello.txt && echo {key} > /data/{key}.txt && cat /data/{key}.txt")
    assert out == f"hello from w1\n{key}\n"
    wait_for(lambda: s3.read(f"{STATIC_PREFIX}{key}.txt") == f"{key}\n".encode(), 30,
             f"{key}.txt in S3")
    assert sorted(p["metadata"]["name"] for p in mounter_pods()) == mounters, \
        "the mounter pods outlive the node plugin"
    assert kube.restarts(get("pod", "w1", "default")) == 0


def test_5_node_plugin_deleted_and_upgraded(release: Release, s3: S3) -> None:
    restart_node_plugin_and_check(
        release, s3, "node-plugin-deleted: as in a DaemonSet rollout",
        lambda pod: kube.delete("pod", pod["metadata"]["name"], NS))
    restart_node_plugin_and_check(
        release, s3, "chart-upgrade: image tag e2e -> e2e-upgrade",
        lambda pod: release.install(e2e_values(release.s3, **{"image.tag": "e2e-upgrade"})),
        image="local/s3csi:e2e-upgrade")


# --- 6 ---------------------------------------------------------------------------------------
def gone_after_delete(name: str, grace: int) -> float:
    """Deletes pod `name`. Our part, timed: every mount under the pod's directory is gone
    (containers stopped within `grace`, then NodeUnpublishVolume) within grace + 10 s.
    The Pod object's removal after that is kubelet's bookkeeping: in this session's runs
    the 1.20 kubelet sometimes took 25-40 s more after the unpublish had returned, so it is
    bounded (180 s), not timed. Returns the seconds until the mounts were gone."""
    pod = get("pod", name, "default")
    pod_dir = kube.KUBELET_DIR / "pods" / pod["metadata"]["uid"]
    t0 = time.monotonic()
    kube.delete("pod", name, "default")
    # The pod's own volumes (the service-account token tmpfs among them) go last.
    wait_for(lambda: get("pod", name, "default") is None or not kube.mounts_under(pod_dir),
             grace + 30, f"{name}'s mounts gone")
    took = time.monotonic() - t0
    assert took < grace + 10, f"{name} took {took:.1f} s to unmount (grace {grace} s)"
    wait_for(lambda: get("pod", name, "default") is None, 180, f"{name} deleted")
    gone = time.monotonic() - t0
    if gone > grace + 10:
        print(f"[e2e]    {name}: mounts gone after {took:.1f} s, the Pod object after {gone:.1f} s")
    assert not kube.mounts_under(pod_dir)
    return took


def test_6_workload_deleted_mounter_and_secret_gone(release: Release) -> None:
    # Scenario 5's upgrade leaves old driver pods terminating for up to their 30 s grace;
    # the kubelet only started stopping w1 once they were gone (seen twice: w1 took 38 s
    # and 40+ s, StopContainer 34 s after the delete). Measure w1's deletion, not theirs.
    wait_for(lambda: not any(p["metadata"].get("deletionTimestamp") for p in get("pods", ns=NS)),
             90, "the upgrade's old driver pods gone")
    (mounter,) = mounter_pods()
    name = mounter["metadata"]["name"]
    secrets = [s["metadata"]["name"] for s in get("secrets", ns=NS)
               if s["metadata"]["name"].startswith(name.rsplit("-", 1)[0])]
    assert secrets, "the mounter's per-volume Secret (the chart's static keys)"
    env = [e for c in mounter["spec"]["containers"] for e in c.get("env", [])]
    assert all("value" not in e for e in env if e["name"].startswith("AWS_SECRET")), env
    timing("6. workload pod deleted (grace 10 s)", gone_after_delete("w1", 10))
    t0 = time.monotonic()
    wait_for(lambda: not any_mounter_pods(), 60, "its mounter pod deleted")
    wait_for(lambda: not [s for s in get("secrets", ns=NS) if s["metadata"]["name"] in secrets],
             30, "its mounter Secret deleted")
    timing("6. mounter pod and Secret gone after the pod", time.monotonic() - t0)


def test_6b_busy_file_at_deletion_does_not_hang(release: Release) -> None:
    kube.apply([workload("busy", "static", f"exec 3</data/hello.txt; {IDLE}")])
    running("busy")
    pod = get("pod", "busy", "default")
    # A process on the node holds a file open on the volume too, so the unmount is busy.
    held = open(kube.csi_target(pod, STATIC_PV) / "hello.txt", "rb")
    (mounter,) = mounter_pods()
    ended: dict[str, Any] = {}

    def mounter_gone() -> bool:
        m = get("pod", mounter["metadata"]["name"], NS)
        if m is None:
            return True
        for c in m["status"].get("containerStatuses", []):
            if "terminated" in c.get("state", {}):
                ended.update(c["state"]["terminated"], deletion=m["metadata"].get("deletionTimestamp"))
        return False
    try:
        timing("6. pod with busy open files deleted (grace 10 s)", gone_after_delete("busy", 10))
        t0 = time.monotonic()
        wait_for(mounter_gone, 60, "its mounter pod deleted")
        timing("6. its mounter pod gone after the pod", time.monotonic() - t0)
        if ended:  # how the mounter ended, when its Pod was seen terminating
            print(f"[e2e] 6. its mounter: deleted {ended.get('deletion')}, exit code "
                  f"{ended.get('exitCode')} ({ended.get('reason')}) at {ended.get('finishedAt')}")
    finally:
        try:
            held.read()
        except OSError as e:
            print(f"[e2e] 6. the node's descriptor after the lazy unmount: {e}")
        try:
            held.close()
        except OSError as e:  # the mount is gone: ENOTCONN, as README says
            print(f"[e2e] 6. closing it: {e}")


# --- 7 ---------------------------------------------------------------------------------------
def test_7_non_root_pods(release: Release, s3: S3, provisioner: Any) -> None:
    """On 1.20 the kubelet does not pass fsGroup to CSI drivers (no DelegateFSGroupToCSIDriver)
    and the chart's CSIDriver says fsGroupPolicy None, so the kubelet changes no file either:
    a non-root pod writes where the class's mount options let it (allow-other, uid=, gid=).
    The VOLUME_MOUNT_GROUP path of newer kubelets is covered in tests/it/csi.rs."""
    assert get("csidriver", DRIVER)["spec"]["fsGroupPolicy"] == "None"
    security = {"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000}
    kube.apply([claim("nonroot", "e2e-nonroot"), claim("plain", "e2e-delete")])
    kube.apply([
        workload("nonroot", "nonroot", f"id && stat -c '%u %g %a' /data && echo ok > /data/n.txt "
                 f"&& cat /data/n.txt && {IDLE}", security),
        workload("plain", "plain", f"id; touch /data/n.txt 2>&1; ls /data 2>&1; {IDLE}", security),
    ])
    t0 = time.monotonic()
    running("nonroot")
    running("plain")
    timing("7. two non-root pods Running", time.monotonic() - t0)
    log = kubectl("logs", "nonroot", "-n", "default")
    assert "uid=1000" in log and "1000 2000" in log and "ok" in log, log
    pv = get("pvc", "nonroot", "default")["spec"]["volumeName"]
    wait_for(lambda: s3.read(f"nonroot/{pv}/n.txt") == b"ok\n", 30, "n.txt in S3")
    plain = kubectl("logs", "plain", "-n", "default")
    print(f"[e2e] 7. nonroot (allow-other,uid=1000,gid=2000): {log.strip()!r}")
    print(f"[e2e] 7. plain (no mount options): {plain.strip()!r}")
    # Without allow-other only root reaches a FUSE mount: no fsGroup magic on 1.20.
    assert "Permission denied" in plain, plain
    for name in ("nonroot", "plain"):
        kube.delete("pod", name, "default", wait=True)
        kube.delete("pvc", name, "default", wait=True)


# --- 8 ---------------------------------------------------------------------------------------
def test_8_two_pods_share_a_mounter(release: Release, s3: S3) -> None:
    """Two pods of the static volume on the node: one mounter Pod serves both (the second
    publish bind-mounts the first one's mount); it stays while either pod runs and goes
    with the last."""
    kube.apply([
        workload("s8a", "static", f"echo from s8a > /data/s8.txt && cat /data/s8.txt && {IDLE}"),
        workload("s8b", "static", f"{IDLE}"),
    ])
    t0 = time.monotonic()
    running("s8a")
    running("s8b")
    timing("8. two pods of one volume Running", time.monotonic() - t0)
    (mounter,) = mounter_pods()
    assert exec_in("s8b", "cat /data/s8.txt") == "from s8a\n"
    assert exec_in("s8b", "echo from s8b > /data/s8b.txt && cat /data/s8b.txt") == "from s8b\n"
    assert exec_in("s8a", "cat /data/s8b.txt") == "from s8b\n"
    pods = [get("pod", n, "default") for n in ("s8a", "s8b")]
    volume_id = f"{BUCKET}/{STATIC_PREFIX.rstrip('/')}"
    for pod in pods:
        assert not volume_condition(volume_id, kube.csi_target(pod, STATIC_PV)).abnormal
    print(f"[e2e] 8. s8a and s8b share the mounter pod {mounter['metadata']['name']}")
    # s8a goes while s8b keeps the volume: our part is NodeUnpublishVolume of s8a's target
    # (its bind unmounted, the shared mount kept). The Pod object's deletion after that is
    # kubelet 1.20's bookkeeping, which once (1 run in 4) held a pod whose volume another
    # pod on the node still uses until that pod went too: bounded, not timed, here.
    target = kube.csi_target(pods[0], STATIC_PV)
    t0 = time.monotonic()
    kube.delete("pod", "s8a", "default")
    wait_for(lambda: not kube.mounts_under(target.parent), 40, "s8a's target unmounted")
    timing("8. s8a's target unpublished after its deletion", time.monotonic() - t0)
    wait_for(lambda: get("pod", "s8a", "default") is None, 180, "s8a deleted")
    timing("8. s8a's Pod object gone", time.monotonic() - t0)
    assert [p["metadata"]["name"] for p in mounter_pods()] == [mounter["metadata"]["name"]]
    assert exec_in("s8b", "cat /data/s8.txt") == "from s8a\n"
    gone_after_delete("s8b", 10)
    t0 = time.monotonic()
    wait_for(lambda: not any_mounter_pods(), 60, "the shared mounter pod deleted")
    timing("8. the shared mounter pod gone after the last pod", time.monotonic() - t0)


def _moto() -> tuple[subprocess.Popen, str]:
    """A moto server (S3 and STS) on a free loopback port, for scenario 8b."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(kube.W / "log" / "moto.log", "w")
    proc = subprocess.Popen(["python3", "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            import urllib.request
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            return True
        except Exception:
            return False
    wait_for(up, 60, "moto serving")
    return proc, endpoint


def _jwt_claims(token: str) -> dict[str, Any]:
    import base64
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_8b_pod_credentials(release: Release) -> None:
    """A volume with authenticationSource: pod. kubelet hands each publish a token of the
    pod's ServiceAccount (tokenRequests); the node plugin reads the role annotated on that
    account, and the pod's mounter (its own Pod, which has no credentials of its own)
    exchanges the token at STS for the role's session. Pods of one account share a
    mounter, another account gets its own; the token is a 0600 file, in no Kubernetes
    object; kubelet republishes (requiresRepublish) and the token is rewritten."""
    import boto3
    # The CSIDriver's spec is immutable on 1.20: recreated with tokenRequests and
    # requiresRepublish (podCredentials), which the node plugin needs no restart for.
    kube.delete("csidriver", DRIVER, wait=True)
    release.install(e2e_values(release.s3, **{"image.tag": "e2e-upgrade",
                                               "podCredentials.enabled": True}))
    spec = get("csidriver", DRIVER)["spec"]
    assert spec.get("requiresRepublish") is True and spec.get("tokenRequests"), spec
    proc, endpoint = _moto()
    try:
        bucket = "e2e-tenants"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="moto", aws_secret_access_key="moto"
                     ).create_bucket(Bucket=bucket)
        roles = {"tenant-a": "arn:aws:iam::123456789012:role/tenant-a",
                 "tenant-b": "arn:aws:iam::123456789012:role/tenant-b"}
        kube.apply([
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": sa, "namespace": "default",
                          "annotations": {"eks.amazonaws.com/role-arn": role}}}
            for sa, role in roles.items()
        ] + [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "e2e-tenants"},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                      "claimRef": {"namespace": "default", "name": "tenants"},
                      "csi": {"driver": DRIVER, "volumeHandle": bucket,
                              "volumeAttributes": {
                                  "authenticationSource": "pod", "endpointUrl": endpoint,
                                  "stsEndpointUrl": endpoint, "region": "us-east-1",
                                  "forcePathStyle": "true"}}}}])
        wait_for(lambda: get("pv", "e2e-tenants")["status"].get("phase") == "Available", 30,
                 "the tenants PV Available")
        kube.apply([claim("tenants", "", "e2e-tenants")])
        wait_for(lambda: get("pvc", "tenants", "default")["status"].get("phase") == "Bound", 30,
                 "the tenants claim Bound")
        pods = {"t8a": "tenant-a", "t8a2": "tenant-a", "t8b": "tenant-b"}
        manifests = []
        for name, sa in pods.items():
            w = workload(name, "tenants", IDLE)
            w["spec"]["serviceAccountName"] = sa
            manifests.append(w)
        t0 = time.monotonic()
        kube.apply(manifests)
        for name in pods:
            running(name)
        timing("8b. three pods of two service accounts Running", time.monotonic() - t0)
        assert exec_in("t8a", "echo from tenant a > /data/a.txt && cat /data/a.txt") == \
            "from tenant a\n"
        assert exec_in("t8a2", "cat /data/a.txt") == "from tenant a\n"
        assert exec_in("t8b", "cat /data/a.txt && echo b > /data/b.txt && cat /data/b.txt") == \
            "from tenant a\nb\n"
        mine = [p for p in mounter_pods()
                if p["metadata"]["annotations"].get("s3csi.dev/volume-id") == bucket]
        assert len(mine) == 2, [p["metadata"]["name"] for p in mine]
        secrets = get("secrets", ns=NS, selector="app.kubernetes.io/name=s3csi-mounter")
        import base64
        data = [{k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
                for s in secrets]
        tenant = [d for d in data if "AWS_ROLE_ARN" in d]
        assert sorted(d["AWS_ROLE_ARN"] for d in tenant) == sorted(roles.values()), tenant
        for d in tenant:
            assert "AWS_ACCESS_KEY_ID" not in d and d["AWS_WEB_IDENTITY_TOKEN_FILE"].endswith(
                "/pod-token"), d
        # The token: kubelet's, for this pod's account and STS's audience, a private file.
        files = {d["AWS_ROLE_ARN"]: Path(d["AWS_WEB_IDENTITY_TOKEN_FILE"]) for d in tenant}
        for sa, role in roles.items():
            f = files[role]
            assert f.stat().st_mode & 0o777 == 0o600
            claims = _jwt_claims(f.read_text())
            assert claims["sub"] == f"system:serviceaccount:default:{sa}", claims
            assert "sts.amazonaws.com" in claims["aud"], claims
            token = f.read_text()
            for obj in ("pods", "secrets"):
                assert token not in kubectl("get", obj, "-A", "-o", "json")
            assert token not in node_logs(release.node_pod())
        print(f"[e2e] 8b. mounter pods {[p['metadata']['name'] for p in mine]} for roles "
              f"{sorted(roles.values())}")
        # kubelet republishes each volume with the pod's token (requiresRepublish); each
        # republish rewrites the token file (the same token, until kubelet renews it).
        written = {role: f.stat().st_mtime_ns for role, f in files.items()}
        t0 = time.monotonic()
        wait_for(lambda: all(f.stat().st_mtime_ns != written[r] for r, f in files.items()),
                 240, "a republish of each pod-credentials mount")
        timing("8b. both token files rewritten by a republish", time.monotonic() - t0)
        # Another mounter wrote it: seen once tenant a's metadata TTL has passed.
        wait_for(lambda: kubectl("exec", "-n", "default", "t8a2", "--", "cat", "/data/b.txt",
                                 check=False) == "b\n", 30, "b.txt seen from the other mounter")
        # Our part: each pod's target unpublished. The Pod objects go when kubelet 1.20
        # (requiresRepublish: alpha there) gets to it: bounded, not timed.
        objs = {name: get("pod", name, "default") for name in pods}
        t0 = time.monotonic()
        for name in pods:
            kube.delete("pod", name, "default")
        for name, pod in objs.items():
            target = kube.csi_target(pod, "e2e-tenants")
            wait_for(lambda: not kube.mounts_under(target.parent), 40,
                     f"{name}'s target unmounted")
        timing("8b. the three targets unpublished after their deletion", time.monotonic() - t0)
        for name in pods:
            wait_for(lambda: get("pod", name, "default") is None, 180, f"{name} deleted")
        timing("8b. the three Pod objects gone", time.monotonic() - t0)
        wait_for(lambda: not [p for p in any_mounter_pods()
                              if p in {m["metadata"]["name"] for m in mine}], 60,
                 "the tenants' mounter pods deleted")
        for f in files.values():
            assert not f.exists(), f
    finally:
        for kind, name in (("pvc", "tenants"), ("pv", "e2e-tenants"),
                           ("serviceaccount", "tenant-a"), ("serviceaccount", "tenant-b")):
            kube.delete(kind, name, "default" if kind != "pv" else None)
        proc.terminate()
        proc.wait(timeout=20)


def test_9_nothing_left_on_the_node(release: Release) -> None:
    wait_for(lambda: not any_mounter_pods(), 60, "no mounter pods")
    left = [m for m in kube.mounts_under(kube.KUBELET_DIR / "pods") if "kubernetes.io~csi" in m]
    assert not left, left
    out = subprocess.run(["findmnt", "-rn", "-t", "fuse", "-o", "TARGET,SOURCE"],
                         capture_output=True, text=True).stdout
    assert str(kube.W) not in out, out
