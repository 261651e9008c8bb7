"""The cluster as the harness sees it: kubectl with the admin kubeconfig of tests/e2e/k8s.sh,
JSON in and out, and waiting with timings."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

W = Path(os.environ.get("S3CSI_E2E_WORK", "/var/tmp/s3csi-e2e"))
KUBECTL = [str(W / "bin" / "kubectl"), "--kubeconfig", str(W / "cfg" / "admin.kubeconfig")]
CONTAINERD_SOCK = W / "run" / "containerd" / "containerd.sock"
KUBELET_DIR = W / "kubelet"
NODE = "one-node"
NS = "kube-system"


class KubectlError(RuntimeError):
    pass


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
    p = subprocess.run(KUBECTL + list(args), input=input, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise KubectlError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def get(kind: str, name: str | None = None, ns: str | None = None, selector: str | None = None,
        ) -> Any:
    """The object (None if it does not exist), or the list's items when no name is given."""
    args = ["get", kind, "-o", "json"]
    if name:
        args.insert(2, name)
    if ns:
        args += ["-n", ns]
    elif not name and kind not in ("pv", "persistentvolumes", "nodes", "csinodes", "storageclass"):
        args += ["--all-namespaces"]
    if selector:
        args += ["-l", selector]
    try:
        out = json.loads(kubectl(*args))
    except KubectlError as e:
        if "NotFound" in str(e) or "not found" in str(e):
            return None
        raise
    return out if name else out["items"]


def apply(objects: list[dict[str, Any]]) -> None:
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                  "items": objects}))


def delete(kind: str, name: str, ns: str | None = None, wait: bool = False,
           extra: tuple[str, ...] = ()) -> None:
    args = ["delete", kind, name, "--ignore-not-found", f"--wait={'true' if wait else 'false'}"]
    if ns:
        args += ["-n", ns]
    kubectl(*args, *extra, timeout=300)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> float:
    """Seconds until cond() is truthy; AssertionError naming `what` after `timeout`."""
    t0 = time.monotonic()
    last: Any = None
    while True:
        try:
            last = cond()
        except KubectlError as e:
            last = e
        if last and not isinstance(last, Exception):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                                 f"(last: {last!r})")
        time.sleep(every)


def pod_ready(pod: dict[str, Any] | None) -> bool:
    if not pod or pod["status"].get("phase") != "Running":
        return False
    return all(c.get("ready") for c in pod["status"].get("containerStatuses", []))


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))


def exec_in(pod: str, script: str, ns: str = "default", timeout: float = 60) -> str:
    return kubectl("exec", "-n", ns, pod, "--", "sh", "-c", script, timeout=timeout)


def container_pid(pod: dict[str, Any], container: str) -> int:
    """The host pid of a container's main process, from containerd."""
    cid = next(c["containerID"] for c in pod["status"]["containerStatuses"]
               if c["name"] == container).split("://", 1)[1]
    out = subprocess.run(["ctr", "-a", str(CONTAINERD_SOCK), "-n", "k8s.io", "tasks", "ls"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == cid:
            return int(fields[1])
    raise AssertionError(f"no task for container {cid}")


def mounts_under(path: Path) -> list[str]:
    out = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout
    return [m for m in out.splitlines() if m.startswith(str(path))]


def csi_target(pod: dict[str, Any], pv: str) -> Path:
    """Where the kubelet (1.20) asks a CSI driver to publish a pod's volume."""
    return KUBELET_DIR / "pods" / pod["metadata"]["uid"] / "volumes" / "kubernetes.io~csi" / pv / "mount"
