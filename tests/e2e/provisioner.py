"""The external-provisioner's part, played by the harness (no csi-provisioner image can be
pulled here). It does what csi-provisioner (v5, with --extra-create-metadata) does for a
driver without topology, snapshots or expansion:

- a PVC whose class names our driver, Pending, unbound, and annotated by the PV controller
  (kube-controller-manager) with `volume.beta.kubernetes.io/storage-provisioner: <driver>`:
  CreateVolume over the controller's socket (name `pvc-<PVC uid>`, the requested capacity,
  a mount capability with the claim's access mode, the class's parameters without the
  `csi.storage.k8s.io/` keys plus the PVC/PV metadata, the provisioner secret the class
  names), then the PV: `pv.kubernetes.io/provisioned-by`, claimRef, the class's reclaim policy
  and mount options, the CSI source with volumeHandle/volumeAttributes and the node-publish
  secret reference. The PV controller binds it to the claim.
- a PV it provisioned, `Released`, with reclaim policy Delete: DeleteVolume, then the PV is
  deleted. Retain: left alone.

The scenarios only create and delete PVCs and look at PVs and S3, so they run unchanged with
the real sidecar (sidecars.provisioner.enabled: true, S3CSI_E2E_PROVISIONER=sidecar).
"""

from __future__ import annotations

import base64
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import csi_client
from kube import KubectlError, apply, delete, get

PREFIX = "csi.storage.k8s.io/"
ACCESS = {
    "ReadWriteOnce": "SINGLE_NODE_WRITER",
    "ReadOnlyMany": "MULTI_NODE_READER_ONLY",
    "ReadWriteMany": "MULTI_NODE_MULTI_WRITER",
}
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
         "G": 10**9, "T": 10**12}


def quantity(q: str) -> int:
    for suffix, n in UNITS.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * n)
    return int(q)


class Provisioner:
    def __init__(self, driver: str, socket: Callable[[], Path | None]) -> None:
        self.driver = driver
        self.socket = socket
        self.errors: list[str] = []
        self.log: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="provisioner", daemon=True)

    def start(self) -> "Provisioner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - keep serving; the scenarios see the error
                self.errors.append(traceback.format_exc())
            self._stop.wait(0.3)

    def _secrets(self, params: dict[str, str], kind: str) -> dict[str, str]:
        name = params.get(f"{PREFIX}{kind}-secret-name")
        if not name:
            return {}
        secret = get("secret", name, params.get(f"{PREFIX}{kind}-secret-namespace", "default"))
        if secret is None:
            raise RuntimeError(f"the {kind} secret {name} does not exist")
        return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}

    def _controller(self) -> Any:
        socket = self.socket()
        if socket is None:
            raise RuntimeError("the controller is not serving")
        return csi_client.controller(socket)

    def sync(self) -> None:
        if self.socket() is None:
            return  # the controller pod is (re)starting; the real sidecar waits for it too
        classes = {c["metadata"]["name"]: c for c in get("storageclass")
                   if c.get("provisioner") == self.driver}
        for pvc in get("pvc"):
            cls = classes.get(pvc["spec"].get("storageClassName") or "")
            annotations = pvc["metadata"].get("annotations", {})
            if (cls and pvc["status"].get("phase") == "Pending" and not pvc["spec"].get("volumeName")
                    and annotations.get("volume.beta.kubernetes.io/storage-provisioner") == self.driver
                    and not pvc["metadata"].get("deletionTimestamp")):
                self.provision(pvc, cls)
        for pv in get("pv"):
            if (pv["metadata"].get("annotations", {}).get("pv.kubernetes.io/provisioned-by") == self.driver
                    and pv["status"].get("phase") == "Released"
                    and pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete"
                    and not pv["metadata"].get("deletionTimestamp")):
                self.delete(pv)

    def provision(self, pvc: dict[str, Any], cls: dict[str, Any]) -> None:
        pb = csi_client.pb
        meta = pvc["metadata"]
        name = f"pvc-{meta['uid']}"
        if get("pv", name) is not None:
            return  # made already; the PV controller is binding it
        params = dict(cls.get("parameters", {}))
        secrets = self._secrets(params, "provisioner")
        parameters = {k: v for k, v in params.items() if not k.startswith(PREFIX)}
        parameters.update({f"{PREFIX}pvc/name": meta["name"],
                           f"{PREFIX}pvc/namespace": meta["namespace"],
                           f"{PREFIX}pv/name": name})
        modes = pvc["spec"].get("accessModes", ["ReadWriteOnce"])
        requested = quantity(pvc["spec"]["resources"]["requests"]["storage"])
        caps = [pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(mount_flags=cls.get("mountOptions", [])),
            access_mode=pb.VolumeCapability.AccessMode(
                mode=pb.VolumeCapability.AccessMode.Mode.Value(ACCESS[m])))
            for m in modes]
        t0 = time.monotonic()
        volume = self._controller().CreateVolume(pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=requested),
            volume_capabilities=caps, parameters=parameters, secrets=secrets), timeout=60).volume
        csi: dict[str, Any] = {"driver": self.driver, "volumeHandle": volume.volume_id,
                               "fsType": "", "volumeAttributes": dict(volume.volume_context)}
        csi["volumeAttributes"]["storage.kubernetes.io/csiProvisionerIdentity"] = f"e2e-{self.driver}"
        node_secret = params.get(f"{PREFIX}node-publish-secret-name")
        if node_secret:
            csi["nodePublishSecretRef"] = {
                "name": node_secret,
                "namespace": params.get(f"{PREFIX}node-publish-secret-namespace", "default")}
        del csi["fsType"]
        capacity = volume.capacity_bytes or requested
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": name,
                           "annotations": {"pv.kubernetes.io/provisioned-by": self.driver}},
              "spec": {"accessModes": modes, "capacity": {"storage": str(capacity)},
                       "persistentVolumeReclaimPolicy": cls.get("reclaimPolicy", "Delete"),
                       "storageClassName": cls["metadata"]["name"], "volumeMode": "Filesystem",
                       "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                    "namespace": meta["namespace"], "name": meta["name"],
                                    "uid": meta["uid"],
                                    "resourceVersion": meta["resourceVersion"]},
                       "csi": csi}}
        if cls.get("mountOptions"):
            pv["spec"]["mountOptions"] = cls["mountOptions"]
        apply([pv])
        self.log.append(f"provisioned {name} -> {volume.volume_id} "
                        f"({time.monotonic() - t0:.2f} s for CreateVolume and the PV)")

    def delete(self, pv: dict[str, Any]) -> None:
        pb = csi_client.pb
        params: dict[str, str] = {}
        cls = get("storageclass", pv["spec"].get("storageClassName", "")) if pv["spec"].get(
            "storageClassName") else None
        if cls:
            params = cls.get("parameters", {})
        self._controller().DeleteVolume(pb.DeleteVolumeRequest(
            volume_id=pv["spec"]["csi"]["volumeHandle"],
            secrets=self._secrets(params, "provisioner")), timeout=60)
        try:
            delete("pv", pv["metadata"]["name"])
        except KubectlError:
            return
        self.log.append(f"deleted {pv['metadata']['name']} ({pv['spec']['csi']['volumeHandle']})")
