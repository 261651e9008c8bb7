"""Fixtures of the end-to-end suite: the embedded S3 server on 127.0.0.1, the chart installed
on the one-node cluster that tests/e2e/run.sh brought up (rendered with Helm's own engine,
helm-python-sdk, for v1.20.2, and applied with kubectl), and the provisioner.

Everything the suite creates is removed at the end of the session, in the order a user would:
workload pods, claims (their volumes deleted or kept by the reclaim policy), the release;
then run.sh stops the cluster.
"""

from __future__ import annotations

import base64
import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "chart"))

import kube  # noqa: E402
from chartlib import render_chart, rendered_documents  # noqa: E402
from kube import NS, W, get, kubectl, wait_for  # noqa: E402

KUBE_VERSION = "v1.20.2"
DRIVER = "s3csi.dev"
BUCKET = "e2e"
ACCESS_KEY = "s3csi-e2e"
# A secret of this run only; it reaches the cluster through kubectl's stdin, never its argv.
SECRET_KEY = base64.b32encode(os.urandom(20)).decode()
CREDENTIALS_SECRET = "s3csi-e2e-s3"


def timing(what: str, seconds: float) -> None:
    print(f"\n[e2e] {what}: {seconds:.2f} s", flush=True)


class S3:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def keys(self, prefix: str) -> list[str]:
        out = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for o in out.get("Contents", []))

    def read(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    data = W / "s3data"
    subprocess.run(["rm", "-rf", str(data)], check=True)
    log = open(W / "log" / "s3-server.log", "w")
    env = dict(os.environ, S3CSI_S3_SECRET_KEY=SECRET_KEY)
    proc = subprocess.Popen([os.environ["S3CSI_E2E_BIN"], "s3-server", "--listen", "127.0.0.1:0",
                             "--dir", str(data), "--access-key", ACCESS_KEY, "--bucket", BUCKET],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    (W / "run" / "s3-server.pid").write_text(str(proc.pid))
    line = proc.stdout.readline().strip()
    assert line.startswith("listening on http://"), line
    yield S3(line.split("listening on ", 1)[1])
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    (W / "run" / "s3-server.pid").unlink(missing_ok=True)


def e2e_values(s3: S3, **override: Any) -> dict[str, Any]:
    """tests/e2e/values.yaml with this run's paths and S3 endpoint."""
    values = yaml.safe_load((HERE / "values.yaml").read_text())
    values["node"]["kubeletPath"] = str(kube.KUBELET_DIR)
    values["node"]["stateDir"] = str(W / "state")
    values["s3"]["endpointUrl"] = s3.endpoint
    for sc in values["storageClasses"]:
        sc["endpointUrl"] = s3.endpoint
    if os.environ.get("S3CSI_E2E_PROVISIONER") == "sidecar":
        # The real csi-provisioner instead of provisioner.py, from an image at hand
        # (S3CSI_E2E_PROVISIONER_IMAGE=repository:tag, imported into containerd).
        repository, tag = os.environ["S3CSI_E2E_PROVISIONER_IMAGE"].rsplit(":", 1)
        values["sidecars"]["provisioner"] = {
            "enabled": True, "image": {"repository": repository, "tag": tag,
                                       "pullPolicy": "Never"}}
    for key, value in override.items():
        node = values
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return values


class Release:
    """The chart as installed: rendered for v1.20.2, applied with kubectl."""

    def __init__(self, s3: S3) -> None:
        self.s3 = s3
        self.objects: list[dict[str, Any]] = []

    def install(self, values: dict[str, Any]) -> None:
        rendered = render_chart(copy.deepcopy(values), kube_version=KUBE_VERSION)
        self.objects = [yaml.safe_load(doc) for _, doc in rendered_documents(rendered)]
        kube.apply(self.objects)

    def uninstall(self) -> None:
        for o in reversed(self.objects):
            ns = o["metadata"].get("namespace")
            kube.delete(o["kind"], o["metadata"]["name"], ns, wait=True)

    def node_pod(self) -> dict[str, Any] | None:
        pods = get("pods", ns=NS, selector="app.kubernetes.io/component=node")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None

    def controller_pod(self) -> dict[str, Any] | None:
        pods = get("pods", ns=NS, selector="app.kubernetes.io/component=controller")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None


def cleanup_workloads() -> None:
    """Workload pods and claims in `default`, then every PV left (Retain)."""
    kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", "--timeout=120s",
            check=False, timeout=180)
    kubectl("delete", "pvc", "--all", "-n", "default", "--wait=true", "--timeout=120s",
            check=False, timeout=180)
    try:
        wait_for(lambda: not [pv for pv in get("pv")
                              if pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete"],
                 60, "provisioned volumes with reclaimPolicy Delete deleted")
    finally:
        kubectl("delete", "pv", "--all", "--wait=true", "--timeout=60s", check=False, timeout=120)


def save_logs() -> None:
    """The driver's logs (node plugin, controller, mounters, also their previous containers)
    into $S3CSI_E2E_WORK/log/pods/, before the teardown deletes the pods."""
    out = W / "log" / "pods"
    out.mkdir(parents=True, exist_ok=True)
    for pod in get("pods", ns=NS) or []:
        name = pod["metadata"]["name"]
        for c in pod["spec"]["containers"]:
            for previous in (False, True):
                text = kubectl("logs", "-n", NS, name, "-c", c["name"],
                               *(["--previous"] if previous else []), check=False)
                if text:
                    suffix = ".previous" if previous else ""
                    (out / f"{name}.{c['name']}{suffix}.log").write_text(text)


@pytest.fixture(scope="session")
def release(s3: S3) -> Iterator[Release]:
    # The credentials, as a user would create them: a Secret the chart references.
    kube.apply([{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                 "metadata": {"name": CREDENTIALS_SECRET, "namespace": NS},
                 "stringData": {"accessKeyId": ACCESS_KEY, "secretAccessKey": SECRET_KEY}}])
    r = Release(s3)
    t0 = time.monotonic()
    r.install(e2e_values(s3))
    r.installed_at = t0  # type: ignore[attr-defined]
    try:
        yield r
    finally:
        save_logs()
        for phase in (cleanup_workloads, r.uninstall):
            try:
                phase()
            except Exception as e:  # noqa: BLE001 - the next phases and run.sh still clean up
                print(f"[e2e] cleanup: {phase.__name__}: {e}", flush=True)
        kube.delete("secret", CREDENTIALS_SECRET, NS)

        def mounters() -> list[str]:
            pods = get("pods", ns=NS, selector="app.kubernetes.io/name=s3csi-mounter") or []
            return [p["metadata"]["name"] for p in pods]
        try:
            wait_for(lambda: not mounters(), 60, "no mounter pods left")
        except AssertionError:
            raise AssertionError(f"mounter pods left: {mounters()}") from None


@pytest.fixture(scope="session")
def controller_socket(release: Release) -> Any:
    """A function giving the controller's CSI socket on the host (its emptyDir under the
    kubelet's pod directory; a new controller Pod has a new one), None while there is none."""
    def socket() -> Path | None:
        pod = release.controller_pod()
        if not pod or not kube.pod_ready(pod):
            return None
        path = (kube.KUBELET_DIR / "pods" / pod["metadata"]["uid"] / "volumes"
                / "kubernetes.io~empty-dir" / "socket-dir" / "csi.sock")
        if not path.exists():
            return None
        # That path is longer than a unix socket address may be (108 bytes): connect through
        # a short symbolic link to it.
        link = W / "run" / "controller.sock"
        if not link.is_symlink() or os.readlink(link) != str(path):
            tmp = link.with_suffix(".new")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(path)
            tmp.rename(link)
        return link

    return socket


@pytest.fixture(scope="session")
def provisioner(controller_socket: Any) -> Iterator[Any]:
    """The emulated external-provisioner (or, with S3CSI_E2E_PROVISIONER=sidecar, None: the
    real csi-provisioner runs in the controller pod). Its teardown removes the workloads and
    claims while it still serves DeleteVolume."""
    if os.environ.get("S3CSI_E2E_PROVISIONER") == "sidecar":
        try:
            yield None
        finally:
            cleanup_workloads()
        return
    from provisioner import Provisioner

    p = Provisioner(DRIVER, controller_socket).start()
    try:
        yield p
    finally:
        try:
            cleanup_workloads()
        finally:
            p.stop()
        for line in p.log:
            print(f"[e2e] provisioner: {line}")
        assert not p.errors, "the emulated provisioner failed:\n" + "\n".join(p.errors[-3:])
