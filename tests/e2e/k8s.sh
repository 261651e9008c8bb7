#!/usr/bin/env bash
# tests/e2e/k8s.sh deps|build|images|up|test|down|all — a real one-node Kubernetes on loopback, all from Debian's packages
# (the project's copy of ../shared/tools/one-node-k8s.sh; tests/e2e/run.sh drives it, see tests/e2e/README.md):
#   etcd 3.4 (etcd-server), containerd 1.6 + runc 1.1 (containerd, runc), loopback CNI (containernetworking-plugins),
#   kube-apiserver/-controller-manager/-scheduler/kubelet/kubectl v1.20.2 built from Debian's `kubernetes` SOURCE
#   package (full upstream tree with vendor/; `apt-get source`, Go 1.19 from golang-1.19-go), images built locally
#   (busybox-static; a 10-line static pause) and imported with `ctr`. No container registry, no Go module proxy.
# Work dir: $K8S_WORK (default /var/tmp/s3csi-e2e; the k8s build in bin/ is kept and reused). Everything listens on 127.0.0.1 only; pods must use
#   hostNetwork (only a loopback CNI config exists, which just makes the runtime report NetworkReady).
# Three patches to the k8s source: vendored reflect2 v1.0.1 -> Debian's v1.0.2 (v1.0.1 corrupts memory under Go >= 1.18);
#   the kubelet only warns instead of rewriting host sysctls (vm.overcommit_memory, kernel.panic, panic_on_oops); and it
#   accepts --node-ip=127.0.0.1 (stock 1.20 rejects a loopback node IP, leaving the node with no address, so the
#   apiserver cannot reach the kubelet for logs/exec).
# cgroup v1 (or hybrid) with the cgroupfs driver; k8s 1.20 has no failCgroupV1 setting (that came in 1.31).
# containerd: restrict_oom_score_adj=true, since this sandbox lacks CAP_SYS_RESOURCE (runc failed with
#   "failed to update /proc/self/oom_score_adj: Permission denied" -> "can't get final child's PID from pipe: EOF").
# Measured on 2 shared cores (other builds running): first build 439 s (codegen ~3 min + compile), a rebuild in a
#   new tree 305 s, peak RSS 1.4 GB; `all` with the build 5m35s; images + up to a Ready node ~25 s; pods Succeeded in 2-3 s.
#   Binaries: kube-apiserver 110 MB, kube-controller-manager 104 MB, kubelet 105 MB, kube-scheduler 40 MB, kubectl 38 MB.
# Idle RSS: kube-apiserver ~300-340 MiB, controller-manager ~85, kubelet ~85, containerd ~50, etcd ~50, scheduler ~40.
# Usage: `all` once (needs root); then `down` / `up` / `test`; `down` stops everything it started and unmounts.
#   Admin: bin/kubectl --kubeconfig cfg/admin.kubeconfig (in the work dir). In-cluster clients: the kubernetes Service
#   IP (10.96.0.1) leads nowhere (no kube-proxy): give them a kubeconfig or KUBERNETES_SERVICE_HOST=127.0.0.1, _PORT=6443.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
W=${K8S_WORK:-/var/tmp/s3csi-e2e}
mkdir -p "$W"; W=$(readlink -f "$W")
BIN=$W/bin RUN=$W/run LOG=$W/log PKI=$W/pki CFG=$W/cfg
SOCK=$RUN/containerd/containerd.sock
KUBECTL="$BIN/kubectl --kubeconfig $CFG/admin.kubeconfig"
GO119=/usr/lib/go-1.19/bin
export GOMAXPROCS=${GOMAXPROCS:-2}

deps() {  # Debian packages; quick when all are installed (dpkg -s), waits for another apt to finish
  local pkgs="golang-1.19-go golang-github-modern-go-reflect2-dev rsync jq make gcc libc6-dev dpkg-dev openssl
    etcd-server etcd-client containerd runc containernetworking-plugins busybox-static iptables fuse3 ca-certificates"
  # shellcheck disable=SC2086
  dpkg -s $pkgs >/dev/null 2>&1 && return 0
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends $pkgs >/dev/null
}

# --- build: Debian's kubernetes source package, via a private deb-src list derived from the machine's apt sources ---
build() {
  local src=$W/src a
  mkdir -p "$src" "$W/apt/lists/partial" "$W/apt/cache/archives/partial" "$W/apt/parts" "$BIN"
  for f in /etc/apt/sources.list.d/*.sources; do [ -e "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" >"$W/apt/parts/$(basename "$f")"; done
  [ -f /etc/apt/sources.list ] && grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' >"$W/apt/parts/main.list" || true
  a="-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts=$W/apt/parts -o Dir::State::Lists=$W/apt/lists -o Dir::Cache=$W/apt/cache"
  apt-get $a update -qq
  (cd "$src" && apt-get $a source --download-only kubernetes >/dev/null 2>&1)
  rm -rf "$src/k8s"; (cd "$src" && dpkg-source -x kubernetes_*.dsc k8s >/dev/null)
  cd "$src/k8s"
  local r=vendor/github.com/modern-go/reflect2
  rm -f $r/*.go $r/*.s; cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s $r/
  sed -i 's#github.com/modern-go/reflect2 v1.0.1#github.com/modern-go/reflect2 v1.0.2#g' go.mod vendor/modules.txt
  sed -i 's#^\tb := KernelTunableModify$#\tb := KernelTunableWarn // never rewrite host sysctls#' pkg/kubelet/cm/container_manager_linux.go
  grep -q 'b := KernelTunableWarn' pkg/kubelet/cm/container_manager_linux.go
  sed -i 's#^\tif nodeIP.IsLoopback() {$#\tif false \&\& nodeIP.IsLoopback() { // node address 127.0.0.1#' pkg/kubelet/kubelet_node_status.go
  grep -q 'if false && nodeIP.IsLoopback()' pkg/kubelet/kubelet_node_status.go
  mkdir -p .go/src/k8s.io "$W/home"; [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes
  local t0=$SECONDS
  env GOPATH="$PWD/.go" PATH="$GO119:$PATH" CGO_ENABLED=0 GOCACHE="$W/gocache" HOME="$W/home" GOFLAGS=-p=2 \
    nice -n 19 make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kubectl"
  cp _output/local/bin/linux/amd64/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kubectl} "$BIN/"
  echo "built k8s $("$BIN/kubelet" --version) in $((SECONDS - t0)) s"
}

# --- images: docker-archive tars written by a small python script, imported with ctr -------------------------------
images() {
  local d=$W/images; rm -rf "$d"; mkdir -p "$d/bb/bin" "$d/bb/etc" "$d/bb/tmp" "$d/bb/proc" "$d/bb/sys" "$d/bb/dev" "$d/pause"
  cp /bin/busybox "$d/bb/bin/busybox"; (cd "$d/bb/bin" && for x in $(./busybox --list); do [ "$x" = busybox ] || ln -sf busybox "$x"; done)
  echo 'root:x:0:0:root:/root:/bin/sh' >"$d/bb/etc/passwd"; echo 'root:x:0:' >"$d/bb/etc/group"
  cat >"$d/pause.c" <<'EOF'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void on_term(int s) { (void)s; _exit(0); }
static void on_chld(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) { signal(SIGINT, on_term); signal(SIGTERM, on_term); signal(SIGCHLD, on_chld); for (;;) pause(); }
EOF
  gcc -static -Os -o "$d/pause/pause" "$d/pause.c"; strip "$d/pause/pause"
  python3 "$here/mkimage.py" "$d/bb" "$d/busybox.tar" local/busybox:1 --cmd /bin/sh
  python3 "$here/mkimage.py" "$d/pause" "$d/pause.tar" local/pause:1 --cmd /pause
  rm -rf "$d/bb" "$d/pause"
}

# --- config: CA + serving cert (openssl), static tokens for the clients, SA key pair, kubeconfigs, component configs ---
config() {
  mkdir -p "$PKI" "$CFG" "$RUN" "$LOG" "$W/var/etcd" "$W/cni/net.d" "$W/kubelet"
  if [ ! -f "$PKI/tokens.csv" ]; then (
    cd "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 -subj /CN=one-node-ca 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 365 -extfile apiserver.ext 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    for u in admin kubelet kcm scheduler; do od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >$u.token; done
    { echo "$(cat admin.token),admin,admin,\"system:masters\""
      echo "$(cat kubelet.token),system:node:one-node,kubelet,\"system:nodes\""
      echo "$(cat kcm.token),system:kube-controller-manager,kcm,\"system:masters\""
      echo "$(cat scheduler.token),system:kube-scheduler,scheduler"; } >tokens.csv
  ); fi
  for u in admin kubelet kcm scheduler; do cat >"$CFG/$u.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", certificate-authority: "$PKI/ca.crt"}}]
users: [{name: u, user: {token: "$(cat "$PKI/$u.token")"}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
EOF
  done
  echo '{"cniVersion": "0.4.0", "name": "lo-only", "plugins": [{"type": "loopback"}]}' >"$W/cni/net.d/10-lo.conflist"
  cat >"$CFG/containerd.toml" <<EOF
version = 2
root = "$W/var/containerd"
state = "$RUN/containerd"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/local/pause:1"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  restrict_oom_score_adj = true   # no CAP_SYS_RESOURCE here: runc could not lower oom_score_adj (-998)
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
EOF
  cat >"$CFG/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
# 1.20: kubelet requests service-account tokens for CSI drivers (tokenRequests; pod-level
# credentials) only with this alpha gate, which the API server has on too.
featureGates: {CSIServiceAccountToken: true}
EOF
}

start() {  # start NAME CMD... ; NAME's pid in $RUN/NAME.pid, output in $LOG/NAME.log
  local n=$1; shift
  # AWS_EC2_METADATA_DISABLED: else the 1.20 kubelet's ECR credential provider probes the EC2 metadata address
  AWS_EC2_METADATA_DISABLED=true setsid nohup nice -n 10 "$@" >"$LOG/$n.log" 2>&1 </dev/null & echo $! >"$RUN/$n.pid"
}
wait_for() { local i; for i in $(seq 1 "$1"); do eval "$2" >/dev/null 2>&1 && return 0; sleep 1; done; echo "timeout: $2" >&2; return 1; }

up() {
  config; local t0=$SECONDS
  start containerd containerd --config "$CFG/containerd.toml"
  wait_for 30 "ctr -a $SOCK version"
  local img; for img in "$W"/images/*.tar; do ctr -a "$SOCK" -n k8s.io images import "$img" >/dev/null; done
  start etcd etcd --name one --data-dir "$W/var/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster one=http://127.0.0.1:2380
  wait_for 30 "ETCDCTL_API=3 etcdctl --endpoints=http://127.0.0.1:2379 endpoint health"
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 --bind-address=127.0.0.1 \
    --secure-port=6443 --insecure-port=0 --advertise-address=127.0.0.1 --endpoint-reconciler-type=none \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --token-auth-file="$PKI/tokens.csv" --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --service-cluster-ip-range=10.96.0.0/16 --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" --service-account-issuer=https://kubernetes.default.svc \
    --allow-privileged=true --cert-dir="$W/var/apiserver" --profiling=false --kubelet-preferred-address-types=InternalIP \
    --feature-gates=CSIServiceAccountToken=true
  wait_for 90 "$KUBECTL get --raw /readyz"
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$CFG/kcm.kubeconfig" \
    --bind-address=127.0.0.1 --port=0 --secure-port=0 --leader-elect=false --root-ca-file="$PKI/ca.crt" \
    --service-account-private-key-file="$PKI/sa.key" --cert-dir="$W/var/kcm" --profiling=false
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$CFG/scheduler.kubeconfig" --bind-address=127.0.0.1 \
    --port=0 --secure-port=0 --leader-elect=false --profiling=false
  start kubelet "$BIN/kubelet" --config="$CFG/kubelet.yaml" --kubeconfig="$CFG/kubelet.kubeconfig" \
    --container-runtime=remote --container-runtime-endpoint="unix://$SOCK" --root-dir="$W/kubelet" \
    --cert-dir="$W/kubelet/pki" --volume-plugin-dir="$W/kubelet/volume-plugins" --hostname-override=one-node \
    --node-ip=127.0.0.1
  wait_for 120 "$KUBECTL get node one-node -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
  wait_for 60 "$KUBECTL get serviceaccount default"
  echo "node Ready $((SECONDS - t0)) s after containerd started"; $KUBECTL get nodes -o wide
}

test_pods() {
  mkdir -p "$W/hostpath"; rm -f "$W/hostpath/out.txt"
  $KUBECTL delete pod --ignore-not-found hp ed >/dev/null
  cat <<EOF | $KUBECTL apply -f -
apiVersion: v1
kind: Pod
metadata: {name: hp}
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
  - {name: c, image: local/busybox:1, imagePullPolicy: Never, command: [sh, -c, 'echo written-by-pod > /out/out.txt'],
     volumeMounts: [{name: v, mountPath: /out}]}
  volumes: [{name: v, hostPath: {path: "$W/hostpath", type: Directory}}]
---
apiVersion: v1
kind: Pod
metadata: {name: ed}
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
  - {name: c, image: local/busybox:1, imagePullPolicy: Never,
     command: [sh, -c, 'echo hi > /scratch/f && cat /scratch/f && ls /var/run/secrets/kubernetes.io/serviceaccount'],
     volumeMounts: [{name: v, mountPath: /scratch}]}
  volumes: [{name: v, emptyDir: {}}]
EOF
  local t0=$SECONDS p
  for p in hp ed; do wait_for 120 "$KUBECTL get pod $p -o jsonpath='{.status.phase}' | grep -qx Succeeded" || { $KUBECTL describe pod $p; return 1; }; done
  echo "both pods Succeeded $((SECONDS - t0)) s after apply"; cat "$W/hostpath/out.txt"; $KUBECTL logs ed
}

down() {
  [ -f "$RUN/kube-apiserver.pid" ] && $KUBECTL delete pod --all --wait=true --timeout=60s >/dev/null 2>&1 || true
  local n p
  for n in kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -f "$RUN/$n.pid" ] && p=$(cat "$RUN/$n.pid") && kill "$p" 2>/dev/null && { wait_for 20 "! kill -0 $p"; rm -f "$RUN/$n.pid"; }
    rm -f "$RUN/$n.pid"
  done
  if [ -f "$RUN/containerd.pid" ]; then
    for c in $(ctr -a "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$SOCK" -n k8s.io tasks kill -s SIGKILL "$c" 2>/dev/null || true; done
    sleep 2
    for c in $(ctr -a "$SOCK" -n k8s.io containers ls -q 2>/dev/null); do ctr -a "$SOCK" -n k8s.io tasks delete -f "$c" >/dev/null 2>&1 || true; done
    p=$(cat "$RUN/containerd.pid"); kill "$p" 2>/dev/null && wait_for 20 "! kill -0 $p"; rm -f "$RUN/containerd.pid"
  fi
  # leftover mounts (pod volumes, rootfs, sandbox shm) and the kubelet's cgroups
  findmnt -rn -o TARGET | grep -F "$W/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf /var/log/pods/* /var/log/containers/*   # the 1.20 kubelet hard-codes these two log folders
  for h in /sys/fs/cgroup/*/kubepods; do [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || true; done
}

case ${1:-all} in
  deps) deps ;; build) build ;; images) images ;; up) up ;; test) test_pods ;; down) down ;;
  all) deps; [ -x "$BIN/kubelet" ] || build; images; up; test_pods ;;
  *) echo "usage: $0 deps|build|images|up|test|down|all" >&2; exit 2 ;;
esac
