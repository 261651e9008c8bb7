"""mkimage.py ROOTFS OUT.tar REF [REF ...] [--entrypoint PATH] [--cmd ARG ...]

Packs a directory as a one-layer image in the docker-archive format that `ctr images import`
reads (manifest.json, the config JSON, layer.tar), tagged with every REF. Reproducible: files
owned by root, mtime 0, sorted. No container engine needed.
"""

import argparse
import hashlib
import io
import json
import os
import tarfile


def layer_of(rootfs: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for dp, dns, fns in os.walk(rootfs):
            dns.sort()
            for n in sorted(dns) + sorted(fns):
                p = os.path.join(dp, n)
                ti = tf.gettarinfo(p, os.path.relpath(p, rootfs))
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = "root"
                ti.mtime = 0
                if ti.isreg():
                    with open(p, "rb") as f:
                        tf.addfile(ti, f)
                else:
                    tf.addfile(ti)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rootfs")
    ap.add_argument("out")
    ap.add_argument("refs", nargs="+")
    ap.add_argument("--entrypoint")
    ap.add_argument("--cmd", nargs="*", default=None)
    a = ap.parse_args()
    layer = layer_of(a.rootfs)
    lsha = hashlib.sha256(layer).hexdigest()
    config = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    if a.entrypoint:
        config["Entrypoint"] = [a.entrypoint]
    if a.cmd:
        config["Cmd"] = a.cmd
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
                      "config": config,
                      "rootfs": {"type": "layers", "diff_ids": ["sha256:" + lsha]}},
                     sort_keys=True).encode()
    csha = hashlib.sha256(cfg).hexdigest()

    def put(tf: tarfile.TarFile, name: str, data: bytes) -> None:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        ti.mode = 0o644
        tf.addfile(ti, io.BytesIO(data))

    with tarfile.open(a.out, "w") as tf:
        put(tf, lsha + "/layer.tar", layer)
        put(tf, csha + ".json", cfg)
        manifest = [{"Config": csha + ".json", "RepoTags": a.refs, "Layers": [lsha + "/layer.tar"]}]
        put(tf, "manifest.json", json.dumps(manifest).encode())


if __name__ == "__main__":
    main()
