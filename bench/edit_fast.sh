#!/usr/bin/env bash
# The edit-in-place rows on a fast S3 server, where the mount and not the server is measured.
#
#   bench/edit_fast.sh [--size 1GiB] [--rtt MS] [--runs N] [--sql-rows N] [--only "A B"]
#                      [--no-build]
#
# On bench/run.sh's moto, appending to a large object measures moto's server-side copy
# (UploadPartCopy + CompleteMultipartUpload copy every byte in Python on its one core:
# ~14 s per GiB), which real S3 does inside the store. Here the embedded `s3csi s3-server`
# serves instead, behind the latency proxy (`s3bench proxy`, default RTT 10 ms), pinned to
# the last CPU like run.sh's server side. Rows, each client on a fresh mount and a fresh
# SIZE object, medians of RUNS:
#   append 1 MiB + close; MiB the client sent for it; 1000 random 4 KiB writes + close;
#   SQLite inserts in transactions of 100 (bench/edit_workloads.py)
# Clients: s3csi (durable at close/fsync), s3csi-wb (--write-back 50ms), rclone-w
# (--vfs-cache-mode writes --vfs-write-back 0s) and s3fs if installed; the two that
# acknowledge close before the upload are timed until their upload is done.
# Prints a Markdown table and writes it to bench/results/edit-fast-latest.md.
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=1GiB RTT=10 RUNS=1 SQL_N=2000 BUILD=1 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --sql-rows) SQL_N=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$BUILD" = 1 ] && { cargo build --release --workspace --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/editfast.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
# shellcheck source=bench/embedded.sh
source bench/embedded.sh
now() { date +%s.%N; }
RC_PORT=$(free_port)
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $SIZE object, $SQL_N SQLite rows"

mount_one() { # NAME: starts that client's mount on $MNT
  local ep="http://127.0.0.1:$PPORT"
  case $1 in
    s3csi) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style bench "$MNT" ;;
    s3csi-wb) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style \
      --write-back 50ms --cache-dir "$WORK/cache-wb" bench "$MNT" ;;
    rclone-w) rclone_mount --vfs-cache-mode writes --vfs-write-back 0s --cache-dir "$WORK/rclone-cache" \
        --rc --rc-addr "127.0.0.1:$RC_PORT" --rc-no-auth ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$ep,use_path_request_style,passwd_file=$WORK/passwd-s3fs" ;;
  esac >>"$WORK/$1.log" 2>&1 &
  wait_mounted "$1"
}
# Seconds until the client has no upload queued or under way (0 for the durable ones).
# rclone reports idle for a while after a close before its write-back queues the upload
# (a 1 GiB append's upload landed in the next row), so for rclone the wait also lasts
# until nothing went through the proxy for 2 s; those 2 s are not counted.
uploaded() { # NAME
  local t0 last n quiet
  t0=$(now)
  case $1 in
    s3csi-wb) while compgen -G "$WORK/cache-wb/*.staged" >/dev/null; do sleep 0.01; done ;;
    rclone-w)
      last=$(cat "$WORK/sent") quiet=0
      while :; do
        n=$(rclone rc --url "http://127.0.0.1:$RC_PORT" vfs/stats 2>/dev/null | python3 -c '
import json, sys
c = json.load(sys.stdin).get("diskCache", {})
print(c.get("uploadsInProgress", 0) + c.get("uploadsQueued", 0))' 2>/dev/null)
        sleep 0.2
        if [ "$n" = 0 ] && [ "$(cat "$WORK/sent")" = "$last" ]; then
          quiet=$((quiet + 1))
          [ "$quiet" -ge 10 ] && break
        else
          quiet=0 last=$(cat "$WORK/sent")
        fi
      done
      t0=$(awk -v a="$t0" 'BEGIN { printf "%.3f", a + 2 }') ;;
  esac
  awk -v a="$t0" -v b="$(now)" 'BEGIN { v = b - a; printf "%.3f", v < 0 ? 0 : v }'
}
sent_mib() { sleep 0.3; awk -v a="$1" -v b="$(cat "$WORK/sent")" 'BEGIN { printf "%.1f", (b - a) / 1048576 }'; }
secs_of() { sed -n 's/.*secs=\([0-9.]*\).*/\1/p' | tail -1; }

CLIENTS="s3csi s3csi-wb"
command -v rclone >/dev/null && CLIENTS="$CLIENTS rclone-w"
command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
[ -n "$ONLY" ] && CLIENTS=$ONLY
declare -A T
add() { T[$1,$2]="${T[$1,$2]:-} $3"; log "run $run: $1 $2: $3"; }
for run in $(seq "$RUNS"); do
  for c in $CLIENTS; do
    "$WORK/s3bench" raw-write --endpoint "$DIRECT" --bucket bench --key edit.bin --size "$SIZE" >/dev/null || exit 1
    mount_one "$c" || continue
    sync
    s0=$(cat "$WORK/sent")
    t=$("${CLIENT[@]}" python3 bench/edit_workloads.py append "$MNT/edit.bin" --size 1MiB | secs_of)
    w=$(uploaded "$c")
    add "$c" append "$(awk -v a="$t" -v b="$w" 'BEGIN { printf "%.3f", a + b }')"
    add "$c" sent "$(sent_mib "$s0")"
    t=$("${CLIENT[@]}" python3 bench/edit_workloads.py random-writes "$MNT/edit.bin" --n 1000 | secs_of)
    w=$(uploaded "$c")
    add "$c" random "$(awk -v a="$t" -v b="$w" 'BEGIN { printf "%.3f", a + b }')"
    t=$("${CLIENT[@]}" python3 bench/edit_workloads.py sqlite "$MNT/db-$c-$run.sqlite" --rows "$SQL_N" | secs_of)
    w=$(uploaded "$c")
    add "$c" sqlite "$(awk -v a="$t" -v b="$w" -v n="$SQL_N" 'BEGIN { printf "%.0f", n / (a + b) }')"
    umount_one
  done
done

OUT=bench/results/edit-fast-latest.md
{
  echo "Editing in place on the embedded S3 server, RTT $RTT ms, $SIZE object, median of $RUNS fresh mounts; s3csi-wb and rclone-w timed until their upload is done"
  echo
  echo "| client | append 1 MiB + close (s) | MiB sent for it | 1000 random 4 KiB writes + close (s) | SQLite $SQL_N inserts (rows/s) |"
  echo "|---|---|---|---|---|"
  for c in $CLIENTS; do
    echo "| $c | $(echo "${T[$c,append]:-}" | median) | $(echo "${T[$c,sent]:-}" | median) | $(echo "${T[$c,random]:-}" | median) | $(echo "${T[$c,sqlite]:-}" | median) |"
  done
} | tee "$OUT"
