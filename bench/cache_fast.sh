#!/usr/bin/env bash
# The data-cache rows on a fast S3 server (the embedded `s3csi s3-server` behind the latency
# proxy, default RTT 10 ms; see bench/embedded.sh), where the mount and not the server is
# measured.
#
#   bench/cache_fast.sh [--size 1GiB] [--files 1000] [--rtt MS] [--runs N] [--only "A B"]
#                       [--no-build]
#
# Rows, each client on a fresh mount with an empty cache, medians of RUNS:
#   read of a SIZE object: first (from S3), second and third (from the cache, the third once
#   the cache writers caught up), and `cat` of the same bytes from a local file (page cache
#   warm, as the cache file is after the first read);
#   an epoch loop over FILES files of 1 MiB read in order: first pass, second pass;
#   the mounter's peak RSS and the cache's disk use after both rows.
# Clients: s3csi-nocache (no cache: what the first read costs without one), s3csi
# (--cache-dir --read-only; wholly cached files read by the kernel itself, FUSE passthrough),
# s3csi-daemon (the same with --passthrough off: cache hits served through the mounter), s3fs (use_cache=DIR) and rclone (--vfs-cache-mode full) if
# installed. Prints a Markdown table and writes it to bench/results/cache-fast-latest.md.
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=1GiB FILES=1000 RTT=10 RUNS=1 BUILD=1 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --files) FILES=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$BUILD" = 1 ] && { cargo build --release --workspace --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/cachefast.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
# shellcheck source=bench/embedded.sh
source bench/embedded.sh
now() { date +%s.%N; }
CACHE=$WORK/client-cache
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $SIZE object, $FILES files of 1 MiB"

mount_one() { # NAME: starts that client's mount on $MNT with an empty cache in $CACHE
  local ep="http://127.0.0.1:$PPORT"
  rm -rf "$CACHE"; mkdir -p "$CACHE"
  case $1 in
    s3csi) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style \
      --cache-dir "$CACHE" --cache-size 20GiB --read-only bench "$MNT" ;;
    s3csi-daemon) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style \
      --cache-dir "$CACHE" --cache-size 20GiB --read-only --passthrough off bench "$MNT" ;;
    s3csi-nocache) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style \
      bench "$MNT" ;;
    rclone) rclone_mount --vfs-cache-mode full --vfs-cache-max-size 20G --cache-dir "$CACHE" ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$ep,use_path_request_style,passwd_file=$WORK/passwd-s3fs,use_cache=$CACHE" ;;
  esac >>"$WORK/$1.log" 2>&1 &
  wait_mounted "$1"
}
timed() { # CMD...: prints the seconds it took
  local t0; t0=$(now)
  "$@" >/dev/null || { echo "failed: $*" >&2; echo nan; return; }
  awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'
}
rate() { awk -v s="$1" -v b="$2" 'BEGIN { if (s > 0) printf "%.0f", b / 1048576 / s; else print "nan" }'; }
# The mount process: the newest one whose command line names the mountpoint.
peak_rss_mib() { awk '/VmHWM/ { printf "%.0f", $2 / 1024 }' "/proc/$(pgrep -n -f -- "$MNT")/status" 2>/dev/null; }
BYTES=$(python3 -c "
import re,sys; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)?','$SIZE'); n=int(m[1]); print(n*{None:1,'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[m[2]])")

log "writing the objects"
"$WORK/s3bench" raw-write --endpoint "$DIRECT" --bucket bench --key big.bin --size "$SIZE" >/dev/null || exit 1
python3 - "$DIRECT" "$FILES" <<'EOF' || exit 1
import sys, boto3, concurrent.futures as cf
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
body = bytes(range(256)) * 4096
with cf.ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda i: s3.put_object(Bucket="bench", Key=f"epoch/{i:05d}", Body=body), range(int(sys.argv[2]))))
EOF
LOCAL=$WORK/local-copy.bin
head -c "$BYTES" /dev/urandom >"$LOCAL"
cat "$LOCAL" >/dev/null
epoch() { find "$MNT/epoch" -type f | sort | xargs cat >/dev/null; }

CLIENTS="s3csi-nocache s3csi s3csi-daemon"
command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
command -v rclone >/dev/null && CLIENTS="$CLIENTS rclone"
[ -n "$ONLY" ] && CLIENTS=$ONLY
declare -A T
add() { T[$1,$2]="${T[$1,$2]:-} $3"; log "run $run: $1 $2: $3"; }
for run in $(seq "$RUNS"); do
  add local cat "$(timed cat "$LOCAL")"
  for c in $CLIENTS; do
    mount_one "$c" || continue
    add "$c" first "$(timed "${CLIENT[@]}" cat "$MNT/big.bin")"
    sleep 2 # the cache writers catch up (s3csi's runs in the background)
    add "$c" second "$(timed "${CLIENT[@]}" cat "$MNT/big.bin")"
    sleep 2
    add "$c" third "$(timed "${CLIENT[@]}" cat "$MNT/big.bin")"
    add "$c" epoch1 "$(timed epoch)"
    sleep 2
    add "$c" epoch2 "$(timed epoch)"
    add "$c" rss "$(peak_rss_mib)"
    add "$c" disk "$(du -sm "$CACHE" | cut -f1)"
    umount_one
  done
done

OUT=bench/results/cache-fast-latest.md
med() { echo "${T[$1,$2]:-}" | median; }
{
  echo "Data cache on the embedded S3 server, RTT $RTT ms, $SIZE object and $FILES files of 1 MiB, median of $RUNS runs, each on a fresh mount with an empty cache"
  echo
  echo "| client | $SIZE first read MB/s | second read MB/s | third read MB/s | third / local cat | epoch 1 (s) | epoch 2 (s) | epoch 2 / epoch 1 | peak RSS MiB | cache on disk MiB |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  lc=$(med local cat)
  echo "| local file (cat) | – | – | $(rate "$lc" "$BYTES") | 1.00 | – | – | – | – | – |"
  for c in $CLIENTS; do
    f=$(med "$c" first) s=$(med "$c" second) t=$(med "$c" third) e1=$(med "$c" epoch1) e2=$(med "$c" epoch2)
    echo "| $c | $(rate "$f" "$BYTES") | $(rate "$s" "$BYTES") | $(rate "$t" "$BYTES") | $(awk -v l="$lc" -v s="$t" 'BEGIN { printf "%.2f", l / s }') | $e1 | $e2 | $(awk -v a="$e1" -v b="$e2" 'BEGIN { printf "%.2f", b / a }') | $(med "$c" rss) | $(med "$c" disk) |"
  done
} | tee "$OUT"
