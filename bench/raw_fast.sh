#!/usr/bin/env bash
# Sequential throughput of the FUSE path on a fast S3 server (the embedded `s3csi s3-server`
# behind the latency proxy, default RTT 10 ms; see bench/embedded.sh), against the raw
# clients that set the ceiling: what a mount costs over the fastest client of the same server.
#
#   [S3CSI_ARGS="--flag v"] bench/raw_fast.sh [--size 1GiB] [--rtt MS] [--runs N] [--only "A B"]
#       [--baseline BIN] [--no-build]
#
# Rows (medians of RUNS; each mount fresh, no data cache):
#   read of a SIZE object with `cat` (s3csi, s3fs, rclone) or by the raw clients: `s3bench
#   raw-read` (aws-sdk-s3, 16 ranged GETs of 8 MiB in flight) and boto3 (16 threads, the
#   same ranges);
#   write of SIZE bytes with `dd bs=1M` into a new file (the mount's close waits for the
#   upload) or `s3bench raw-write` (multipart, 8 MiB parts, 16 in flight);
#   the mounter's CPU time (user + sys) per GiB moved and its peak RSS after the read and
#   after the write.
# Clients: s3csi, s3fs, rclone, and with --baseline another s3csi binary named "baseline"
# (e.g. the last landed commit's), mounted with the same flags; odd runs go in this order,
# even runs in the reverse one.
# Prints a Markdown table and writes it to bench/results/raw-fast-latest.md.
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=1GiB RTT=10 RUNS=1 BUILD=1 ONLY="" BASELINE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --baseline) BASELINE=$2; shift ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$BUILD" = 1 ] && { cargo build --release --workspace --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/rawfast.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
[ -n "$BASELINE" ] && { cp "$BASELINE" "$WORK/baseline" || exit 1; }
# shellcheck source=bench/embedded.sh
source bench/embedded.sh
now() { date +%s.%N; }
EP="http://127.0.0.1:$PPORT"
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $SIZE object"
BYTES=$(python3 -c "
import re; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)?','$SIZE'); n=int(m[1]); print(n*{None:1,'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[m[2]])")
"$WORK/s3bench" raw-write --endpoint "$DIRECT" --bucket bench --key big.bin --size "$SIZE" >/dev/null || exit 1

mount_one() { # NAME
  case $1 in
    # shellcheck disable=SC2086 # S3CSI_ARGS: extra s3csi mount flags, split on spaces
    s3csi|baseline) "${CLIENT[@]}" "$WORK/$1" mount --foreground --endpoint-url "$EP" --force-path-style ${S3CSI_ARGS:-} bench "$MNT" ;;
    rclone) rclone_mount --vfs-cache-mode off ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$EP,use_path_request_style,passwd_file=$WORK/passwd-s3fs" ;;
  esac >>"$WORK/$1.log" 2>&1 &
  wait_mounted "$1"
}
timed() { # CMD...: prints the seconds it took
  local t0; t0=$(now)
  "$@" >/dev/null 2>>"$WORK/errors.log" || { echo "failed: $*" >&2; echo nan; return; }
  awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'
}
rate() { awk -v s="$1" -v b="$BYTES" 'BEGIN { if (s > 0) printf "%.0f", b / 1e6 / s; else print "nan" }'; }
# The mount process: the newest one whose command line names the mountpoint ($! is the
# subshell that started it).
mounter() { pgrep -n -f -- "$MNT"; }
cpu_s() { awk -v t="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$(mounter)/stat" 2>/dev/null; }
peak_rss_mib() { awk '/VmHWM/ { printf "%.0f", $2 / 1024 }' "/proc/$(mounter)/status" 2>/dev/null; }
boto3_read() {
  "${CLIENT[@]}" python3 - "$EP" "$BYTES" <<'EOF'
import sys, boto3, botocore.config, concurrent.futures as cf
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                  config=botocore.config.Config(max_pool_connections=16, s3={"addressing_style": "path"}))
size, part = int(sys.argv[2]), 8 << 20
def get(start):
    end = min(start + part, size) - 1
    return len(s3.get_object(Bucket="bench", Key="big.bin", Range=f"bytes={start}-{end}")["Body"].read())
with cf.ThreadPoolExecutor(16) as ex:
    got = sum(ex.map(get, range(0, size, part)))
assert got == size, got
EOF
}

CLIENTS="s3csi"
[ -n "$BASELINE" ] && CLIENTS="$CLIENTS baseline"
command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
command -v rclone >/dev/null && CLIENTS="$CLIENTS rclone"
[ -n "$ONLY" ] && CLIENTS=$ONLY
declare -A T
add() { T[$1,$2]="${T[$1,$2]:-} $3"; log "run $run: $1 $2: $3"; }
for run in $(seq "$RUNS"); do
  add s3bench read "$(timed "${CLIENT[@]}" "$WORK/s3bench" raw-read --endpoint "$EP" --bucket bench --key big.bin)"
  add boto3 read "$(timed boto3_read)"
  add s3bench write "$(timed "${CLIENT[@]}" "$WORK/s3bench" raw-write --endpoint "$EP" --bucket bench --key raw-w.bin --size "$SIZE")"
  # Every other run in the opposite order: no client always reads right after the same one.
  order=$CLIENTS
  [ $((run % 2)) = 0 ] && order=$(echo "$CLIENTS" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    mount_one "$c" || continue
    add "$c" read "$(timed "${CLIENT[@]}" cat "$MNT/big.bin")"
    add "$c" rssr "$(peak_rss_mib)"
    add "$c" write "$(timed "${CLIENT[@]}" dd if=/dev/zero of="$MNT/w-$c-$run.bin" bs=1M count=$((BYTES >> 20)) conv=fsync status=none)"
    add "$c" cpu "$(cpu_s)"
    add "$c" rss "$(peak_rss_mib)"
    umount_one
  done
done

OUT=bench/results/raw-fast-latest.md
med() { echo "${T[$1,$2]:-}" | median; }
{
  echo "Sequential $SIZE on the embedded S3 server, RTT $RTT ms, median of $RUNS runs ($(git rev-parse --short HEAD))"
  echo
  echo "| client | read MB/s | ÷ fastest raw read | write MB/s | ÷ raw write | mounter CPU s per GiB read+written | peak RSS MiB: read / read+write |"
  echo "|---|---|---|---|---|---|---|"
  rr=$(med s3bench read) br=$(med boto3 read) rw=$(med s3bench write)
  best=$(awk -v a="$rr" -v b="$br" 'BEGIN { print (a < b) ? a : b }')
  echo "| raw: s3bench (aws-sdk-s3) | $(rate "$rr") | $(awk -v b="$best" -v s="$rr" 'BEGIN { printf "%.2f", b / s }') | $(rate "$rw") | 1.00 | – | – |"
  echo "| raw: boto3, 16 threads | $(rate "$br") | $(awk -v b="$best" -v s="$br" 'BEGIN { printf "%.2f", b / s }') | – | – | – | – |"
  for c in $CLIENTS; do
    r=$(med "$c" read) w=$(med "$c" write)
    echo "| $c | $(rate "$r") | $(awk -v b="$best" -v s="$r" 'BEGIN { printf "%.2f", b / s }') | $(rate "$w") | $(awk -v b="$rw" -v s="$w" 'BEGIN { printf "%.2f", b / s }') | $(awk -v c="$(med "$c" cpu)" -v g="$BYTES" 'BEGIN { printf "%.2f", c / (2 * g / 1073741824) }') | $(med "$c" rssr) / $(med "$c" rss) |"
  done
} | tee "$OUT"
