#!/usr/bin/env bash
# One big directory on a fast S3 server: the walks users make of a data set.
#
#   bench/bigdir_fast.sh [--files N] [--rtt MS] [--baseline BIN] [--clients "s3csi s3fs ..."]
#                        [--walk-timeout S] [--no-build]
#
# N objects (default 100 000, 100 bytes each, no metadata, as a pipeline uploads them) in
# one directory of the embedded `s3csi s3-server`, behind the latency proxy (default RTT
# 10 ms), server pinned to the last CPU. For each client, one fresh mount and, in this
# order (as in issue 39): `ls -f` (names only), `ls -l` 6 s later, `ls -l` again 6 s later
# (past the default 5 s metadata TTL), `find DIR | wc -l`, then unmount, mount again on the
# same mountpoint (s3csi: the same --cache-dir) and `ls -l`. Each walk must show
# all N names and print nothing on stderr, else its cell says `error(lines)`; one that runs
# past --walk-timeout (default 300 s) says `timeout` and ends that client's walks. Cells
# give the seconds and the requests the proxy saw during the walk. Also the mounter's peak
# RSS (VmHWM) after the first mount's walks. Clients: s3csi, baseline (another s3csi binary, e.g.
# the previous landing), s3fs and rclone if installed. Prints a Markdown table and writes
# it to bench/results/bigdir-fast-latest.md.
set -uo pipefail
cd "$(dirname "$0")/.."
FILES=100000 RTT=10 BASELINE="" BUILD=1 CLIENTS="" WALK_TIMEOUT=300
while [ $# -gt 0 ]; do
  case "$1" in
    --files) FILES=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --baseline) BASELINE=$2; shift ;;
    --clients) CLIENTS=$2; shift ;;
    --walk-timeout) WALK_TIMEOUT=$2; shift ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$BUILD" = 1 ] && { cargo build --release --workspace --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/bigdir.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
[ -n "$BASELINE" ] && { cp "$BASELINE" "$WORK/baseline" || exit 1; }
# shellcheck source=bench/embedded.sh
source bench/embedded.sh
if [ -z "$CLIENTS" ]; then
  CLIENTS="s3csi"
  [ -n "$BASELINE" ] && CLIENTS="$CLIENTS baseline"
  command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
  command -v rclone >/dev/null && CLIENTS="$CLIENTS rclone"
fi
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $FILES objects in one directory"
t0=$(date +%s)
"$WORK/s3bench" populate --endpoint "$DIRECT" --bucket bench --prefix big --dirs 1 --files "$FILES" \
  --size 100 --concurrency 64 >/dev/null || exit 1
log "populated in $(($(date +%s) - t0)) s"
DIR=big/d000

mount_one() { # NAME
  local ep="http://127.0.0.1:$PPORT"
  case $1 in
    # Each its own state directory: what one learnt about the versions is not the other's.
    s3csi|baseline) "${CLIENT[@]}" "$WORK/$1" mount --foreground --endpoint-url "$ep" --force-path-style \
      --cache-dir "$WORK/state-$1" bench "$MNT" ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$ep,use_path_request_style,passwd_file=$WORK/passwd-s3fs" ;;
    rclone) rclone_mount ;;
  esac >>"$WORK/$1.log" 2>&1 &
  wait_mounted "$1"
}

# Runs one walk; prints "seconds (requests)", "error(lines)" when a name is missing or
# stderr is not empty, or "timeout" past WALK_TIMEOUT (the mount is then killed).
walk() { # WANT CMD...
  local want=$1; shift
  local t0 t1 n before rc
  before=$(requests_now)
  t0=$(date +%s.%N)
  timeout -s KILL "$WALK_TIMEOUT" "${CLIENT[@]}" "$@" >"$WORK/walk.out" 2>"$WORK/walk.err"
  rc=$?
  t1=$(date +%s.%N)
  n=$(wc -l <"$WORK/walk.out")
  if [ "$rc" = 137 ]; then
    log "$* ran past ${WALK_TIMEOUT} s"
    echo "timeout"
  elif [ "$n" != "$want" ] || [ -s "$WORK/walk.err" ]; then
    log "$* printed $n lines, $(wc -l <"$WORK/walk.err") on stderr: $(head -c 200 "$WORK/walk.err")"
    echo "error($n)"
  else
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
    printf ' (%s)' "$(requests_since "$before")"
  fi
}

declare -A T
WALKS="lsf lsl1 lsl2 find remount"
for c in $CLIENTS; do
  mount_one "$c" || continue
  for w in $WALKS; do
    case $w in
      lsf) T[$c,$w]=$(walk $((FILES + 2)) ls -f "$MNT/$DIR") ;;
      lsl1|lsl2) sleep 6; T[$c,$w]=$(walk $((FILES + 1)) ls -l "$MNT/$DIR") ;;
      find) T[$c,$w]=$(walk $((FILES + 1)) find "$MNT/$DIR")
        # The mounter: the newest process whose command line names the mountpoint.
        T[$c,rss]=$(awk '/VmHWM/ { printf "%.0f", $2 / 1024 }' "/proc/$(pgrep -n -f "$MNT")/status" 2>/dev/null)
        umount_one
        mount_one "$c" || break ;;
      remount) T[$c,$w]=$(walk $((FILES + 1)) ls -l "$MNT/$DIR") ;;
    esac
    log "$c $w: ${T[$c,$w]}"
    if [ "${T[$c,$w]}" = timeout ]; then
      pkill -9 -f "$MNT"; umount -l "$MNT" 2>/dev/null
      break
    fi
  done
  mountpoint -q "$MNT" && umount_one
done

OUT=bench/results/bigdir-fast-latest.md
{
  echo "One directory of $FILES objects (100 B, no metadata) on the embedded S3 server, RTT $RTT ms, one fresh mount per client, walks in this order: seconds (requests sent during the walk)"
  echo
  echo "| client | ls -f | ls -l (6 s later) | ls -l again (6 s later) | find \| wc -l | ls -l after a remount | mounter peak RSS, MiB |"
  echo "|---|---|---|---|---|---|---|"
  for c in $CLIENTS; do
    echo "| $c | ${T[$c,lsf]:--} | ${T[$c,lsl1]:--} | ${T[$c,lsl2]:--} | ${T[$c,find]:--} | ${T[$c,remount]:--} | ${T[$c,rss]:--} |"
  done
} | tee "$OUT"
