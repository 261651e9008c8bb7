#!/usr/bin/env bash
# tests/e2e/run.sh — the end-to-end suite on a real one-node Kubernetes (v1.20.2, built from
# Debian's source package by k8s.sh; see tests/e2e/README.md). Called by ./test.sh; runs alone
# too (as root, from anywhere). S3CSI_SKIP_E2E=1 skips it.
#
#   1. Debian packages (k8s.sh deps), the Kubernetes build unless cached in $S3CSI_E2E_WORK/bin
#   2. the s3csi release binary, and the s3csi image without a container engine:
#      image/rootfs.sh (as the Containerfile) + mkimage.py, imported with ctr by k8s.sh up
#   3. the cluster (k8s.sh up), then pytest tests/e2e: the embedded S3 server, the chart
#      rendered with Helm's engine and applied with kubectl, the scenarios
#   4. always, also on failure or Ctrl-C: the cluster down (k8s.sh down), and a check that no
#      process, mount or cgroup of it is left
set -euo pipefail
if [ "${S3CSI_SKIP_E2E:-}" = 1 ]; then
  echo "e2e: skipped (S3CSI_SKIP_E2E=1)"
  exit 0
fi
here=$(dirname "$(readlink -f "$0")")
repo=$(readlink -f "$here/../..")
export K8S_WORK=${S3CSI_E2E_WORK:-/var/tmp/s3csi-e2e}
mkdir -p "$K8S_WORK"
W=$(readlink -f "$K8S_WORK")
export S3CSI_E2E_WORK=$W
[ "$(id -u)" = 0 ] || { echo "e2e: needs root (a kubelet, containerd and FUSE mounts)" >&2; exit 1; }
t0=$SECONDS
stamp() { echo "e2e: $1 ($((SECONDS - t0)) s)"; }

"$here/k8s.sh" deps
if [ ! -x "$W/bin/kubelet" ]; then
  stamp "building Kubernetes v1.20.2 from Debian's source package (once; cached in $W/bin)"
  "$here/k8s.sh" build >"$W/build.log" 2>&1 || { tail -50 "$W/build.log"; exit 1; }
  rm -rf "$W/src" "$W/gocache" "$W/apt"   # ~3 GB; only bin/ is reused
fi
stamp "Kubernetes binaries ready"

# The release binary: test.sh's `cargo test --release` has built it; a run alone builds it.
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && nice -n 10 cargo build --release --locked --bin s3csi)
export S3CSI_E2E_BIN=$target/release/s3csi
"$here/k8s.sh" images
sh "$repo/image/rootfs.sh" "$W/images/s3csi-rootfs" "$S3CSI_E2E_BIN"
# Two tags of one image: the upgrade scenario moves the node plugin from one to the other.
python3 "$here/mkimage.py" "$W/images/s3csi-rootfs" "$W/images/s3csi.tar" \
  local/s3csi:e2e local/s3csi:e2e-upgrade --entrypoint /usr/local/bin/s3csi
rm -rf "$W/images/s3csi-rootfs"
stamp "images built"

down() {
  local rc=$?
  set +e
  stamp "tearing down"
  # The S3 server, if pytest was killed before its own teardown.
  [ -f "$W/run/s3-server.pid" ] && kill "$(cat "$W/run/s3-server.pid")" 2>/dev/null
  rm -f "$W/run/s3-server.pid"
  "$here/k8s.sh" down
  # Nothing of the cluster may be left: processes (pid files), mounts, cgroups.
  local left=0 n
  for n in "$W"/run/*.pid; do
    [ -f "$n" ] && kill -0 "$(cat "$n")" 2>/dev/null && { echo "e2e: left running: $n" >&2; left=1; }
  done
  if findmnt -rn -o TARGET | grep -F "$W/"; then echo "e2e: mounts left (above)" >&2; left=1; fi
  for n in /sys/fs/cgroup/*/kubepods; do
    [ -d "$n" ] && { echo "e2e: cgroup left: $n" >&2; left=1; }
  done
  stamp "done"
  [ "$rc" = 0 ] && [ "$left" = 1 ] && rc=1
  exit "$rc"
}
trap down EXIT
trap 'exit 130' INT TERM
# A fresh cluster every run: no etcd data, kubelet or driver state of an earlier one (the
# build, the PKI and the images stay). Never below a mount that an earlier run left.
if findmnt -rn -o TARGET | grep -qF "$W/"; then echo "e2e: mounts under $W are left from an earlier run" >&2; exit 1; fi
rm -rf "$W/var" "$W/kubelet" "$W/state" "$W/s3data" "$W/run" "$W/log"
"$here/k8s.sh" up
stamp "cluster up"
cd "$repo"
python3 -m pytest -q -s -x -p no:cacheprovider tests/e2e  # -x: the scenarios build on each other
