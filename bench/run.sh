#!/usr/bin/env bash
# s3csi vs s3fs vs rclone mount vs raw S3, through injected network latency, on two S3
# servers side by side.
#
#   bench/run.sh [--quick] [--full] [--rtt MS] [--runs N] [--only "s3csi s3fs rclone"]
#                [--servers "moto fast"] [--no-build] [--keep]
#
# For each server: starts it on a fresh loopback port, one latency proxy (`s3bench proxy`,
# RTT/2 each way plus one RTT per new connection) per client in front of it, one bucket per
# client, and runs the workloads on fresh mounts, N times. The servers:
#   moto  bench/moto_server.py: faithful S3 metadata, slow data (~440 MiB/s at best); every
#         request is logged, so its rows also count the S3 requests of each workload
#   fast  the embedded `s3csi s3-server` in /dev/shm (tmpfs): the data path is not the
#         limit, so "% of raw S3" measures what the FUSE path costs
# Prints a Markdown table of medians and writes it to bench/results/latest.md.
#   --quick   small sizes, 1 run (a few minutes per server)
#   --full    the issue's sizes: 1 GiB objects instead of 256 MiB (moto needs ~35 s per GiB
#             uploaded), 6 400 files for cp -r instead of 1 600
#   --servers L  which servers, in order (default "moto fast")
#   --rtt MS  round-trip time injected by the proxy (default 10; 0 = proxy without delay)
#   --runs N  runs of s3csi and raw S3 (default 3; medians are reported)
#   --peer-runs N  runs of s3fs and rclone (default 1: they are slow, ~8 and ~5 min a run)
#   --only L  which mounts to run (default all; missing peers are skipped anyway); rclone-w is
#             rclone with --vfs-cache-mode writes and s3csi-wb is s3csi with --write-back
#             50ms, both run on the edit-in-place rows only, each timed until the upload of
#             the change is done (their close does not wait)
#   --keep    keep the work directory (logs, moto request log, raw results)
#   --no-pin  share all CPUs between the S3 server side and the clients (see below)
# CPUs: with 2 or more, the S3 server side (moto and the latency proxies, which stand for
# the remote store and the network) runs on the last CPU and every client (mounts,
# workloads, raw S3) on the others, so that a client that spends more CPU does not slow the
# server all clients share and a remote S3 would not share with them.
# Environment: S3CSI_ARGS="--max-concurrency 32" adds flags to every s3csi mount.
# Needs root (FUSE), fuse3, python3 with moto[server] and waitress (pip install
# 'moto[server]' waitress); s3fs and rclone are optional (apt-get install s3fs rclone).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

QUICK=0 FULL=0 RTT=10 RUNS="" PEER_RUNS="" ONLY="s3csi s3csi-wb s3fs rclone rclone-w" BUILD=1 KEEP=0 PIN=1
SERVERS="moto fast"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --full) FULL=1 ;;
    --rtt) RTT=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --peer-runs) PEER_RUNS=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --servers) SERVERS=$2; shift ;;
    --no-build) BUILD=0 ;;
    --keep) KEEP=1 ;;
    --no-pin) PIN=0 ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$QUICK" = 1 ]; then
  BIG=64MiB TOUCH_N=100 DIRS=10 FILES=100 WU_N=100 MD_N=100 RUNS=${RUNS:-1} SQL_N=2000
  MANY_N=100 CP_DIRS=2 PAR_N=8
else
  BIG=256MiB TOUCH_N=500 DIRS=100 FILES=100 WU_N=1000 MD_N=500 RUNS=${RUNS:-3} SQL_N=10000
  MANY_N=1000 CP_DIRS=16 PAR_N=8
fi
[ "$FULL" = 1 ] && BIG=1GiB CP_DIRS=64
CP_FILES=100 CP_SIZE=4096   # cp -r: CP_DIRS directories of CP_FILES files of CP_SIZE bytes
MD_PROCS=4                  # the parallel mdtest rows: MD_PROCS processes, MD_N files in all
PEER_RUNS=${PEER_RUNS:-1}
[ "$PEER_RUNS" -gt "$RUNS" ] && PEER_RUNS=$RUNS
BIG_BYTES=$(python3 -c "import re;m=re.fullmatch(r'(\d+)([KMG]iB)','$BIG');print(int(m[1])<<{'KiB':10,'MiB':20,'GiB':30}[m[2]])")
TMO=${BENCH_TIMEOUT:-900}   # per workload, seconds
DELAY_MS=$((RTT / 2))

[ "$(id -u)" = 0 ] || echo "warning: not root; FUSE mounts may fail" >&2
command -v fusermount3 >/dev/null || { echo "fuse3 (fusermount3) is required" >&2; exit 1; }
python3 -c 'import moto.server' 2>/dev/null || { echo "pip install 'moto[server]' waitress is required" >&2; exit 1; }
python3 -c 'import waitress' 2>/dev/null || echo "warning: no waitress (pip install waitress): moto will close every connection" >&2

if [ "$BUILD" = 1 ]; then
  cargo build --release --workspace --bins -q || exit 1
fi
WORK=$(mktemp -d /tmp/s3bench.XXXXXX)
# private copies: a rebuild during the run must not swap the binaries under it
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
S3CSI=$WORK/s3csi
BENCH=$WORK/s3bench
RES=$WORK/results.tsv
: >"$RES"
NOTES=$WORK/notes.txt
: >"$NOTES"
# The embedded server's objects, in memory as moto's are: on disk the page-cache drop
# before every workload made its reads disk-bound (a 256 MiB raw read at 57 MiB/s).
FAST_DATA=/dev/shm/s3bench-fast-${WORK##*.}
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1 RUST_BACKTRACE=0
unset AWS_PROFILE AWS_SESSION_TOKEN

MOUNTED=()
SERVER_PIDS=()
cleanup() {
  for m in "${MOUNTED[@]}"; do fusermount3 -u "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  for p in "${SERVER_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$FAST_DATA"
  if [ "$KEEP" = 1 ]; then echo "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
log() { echo "[$(date +%T)] $*" >&2; }
now() { date +%s.%N; }

# ---------------------------------------------------------------- S3 servers and proxies
NCPU=$(nproc)
SERVER_SIDE=()
CPUS="all $NCPU CPUs shared"
if [ "$PIN" = 1 ] && [ "$NCPU" -ge 2 ] && command -v taskset >/dev/null; then
  SERVER_SIDE=(taskset -c "$((NCPU - 1))")
  taskset -cp "0-$((NCPU - 2))" $$ >/dev/null   # this script and every client it starts
  CPUS="S3 server side (S3 server, proxies) on CPU $((NCPU - 1)), clients on CPU 0-$((NCPU - 2))"
fi

CLIENTS="raw"
for fs in $ONLY; do
  case $fs in
    s3csi|s3csi-wb) CLIENTS="$CLIENTS $fs" ;;
    s3fs|rclone|rclone-w)
      if command -v "${fs%-w}" >/dev/null; then CLIENTS="$CLIENTS $fs"
      else echo "$fs: not installed, skipped (apt-get install ${fs%-w})" >>"$NOTES"; fi ;;
    *) echo "unknown mount $fs" >&2; exit 2 ;;
  esac
done
for srv in $SERVERS; do
  case $srv in moto|fast) ;; *) echo "unknown server $srv (moto or fast)" >&2; exit 2 ;; esac
done
# rclone-w and s3csi-wb run the edit rows only: edit.bin is the one object they need (on the
# fast server, their copies of the big and parallel-read objects did not fit in memory).
edit_rows_only() { case $1 in rclone-w|s3csi-wb) return 0 ;; *) return 1 ;; esac; }
# The fast server keeps every client's objects in /dev/shm: refuse a run whose objects do not
# fit in memory, before any server starts, rather than have the kernel kill a server or a
# mounter halfway (raw S3 and s3csi alone at --full sizes need ~22 GiB).
if [[ " $SERVERS " == *" fast "* ]]; then
  need=0
  for c in $CLIENTS; do
    if [ "$c" = raw ]; then need=$((need + (PAR_N + 2) * BIG_BYTES))   # big, par, the write
    elif edit_rows_only "$c"; then need=$((need + 2 * BIG_BYTES))      # edit.bin and its copy
    else                                # big, par, edit.bin and its copy, the write, many
      need=$((need + (PAR_N + 4) * BIG_BYTES + (MANY_N << 20)))
    fi
  done
  avail=$(awk '/^MemAvailable:/ { printf "%.0f", $2 * 1024 }' /proc/meminfo)
  if [ "$need" -gt $((avail / 10 * 9)) ]; then
    echo "the fast server would keep $((need >> 30)) GiB of objects in memory, and $((avail >> 30)) GiB is available: use fewer clients (--only), smaller sizes (no --full) or --servers moto" >&2
    exit 1
  fi
fi
bucket() { echo "bench-$1"; }
SRV=""            # the server of the rows being measured
SERVER_PID=""     # its process (quiesce waits until it is idle)
REQLOG=""         # its request log, one line per request (moto only)
SERVER_PIDS=()    # the server and its proxies, stopped by stop_server
declare -A PPORT

# Starts server $1 with one proxy and one bucket per client, and uploads the data sets.
start_server() { # moto|fast
  SRV=$1
  SERVER_PIDS=()
  local port c
  port=$(free_port)
  DIRECT=http://127.0.0.1:$port
  if [ "$SRV" = moto ]; then
    REQLOG=$WORK/moto.log
    : >"$REQLOG"
    "${SERVER_SIDE[@]}" python3 bench/moto_server.py -H 127.0.0.1 -p "$port" >"$REQLOG" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 100); do curl -s -o /dev/null "$DIRECT" && break; sleep 0.2; done
    curl -s -o /dev/null "$DIRECT" || { echo "moto did not start" >&2; exit 1; }
    for c in $CLIENTS; do
      curl -sf -X PUT "$DIRECT/$(bucket "$c")" >/dev/null || { echo "cannot create bucket" >&2; exit 1; }
    done
  else
    REQLOG=""
    local buckets=()
    for c in $CLIENTS; do buckets+=(--bucket "$(bucket "$c")"); done
    S3CSI_S3_SECRET_KEY=$AWS_SECRET_ACCESS_KEY "${SERVER_SIDE[@]}" "$S3CSI" s3-server \
      --listen "127.0.0.1:$port" --dir "$FAST_DATA" --access-key "$AWS_ACCESS_KEY_ID" \
      "${buckets[@]}" --log-level warn >"$WORK/fast.out" 2>"$WORK/fast.log" &
    SERVER_PID=$!
    for _ in $(seq 100); do grep -q '^listening on' "$WORK/fast.out" && break; sleep 0.1; done
    grep -q '^listening on' "$WORK/fast.out" || { echo "the embedded server did not start" >&2; exit 1; }
  fi
  SERVER_PIDS+=("$SERVER_PID")
  for c in $CLIENTS; do
    PPORT[$c]=$(free_port)
    "${SERVER_SIDE[@]}" "$BENCH" proxy --listen "127.0.0.1:${PPORT[$c]}" --upstream "${DIRECT#http://}" \
      --delay-ms "$DELAY_MS" --bytes-file "$WORK/proxy-$c.bytes" >"$WORK/proxy-$c.log" 2>&1 &
    SERVER_PIDS+=($!)
  done
  sleep 0.5
  log "$SRV on $DIRECT, RTT ${RTT} ms, clients: $CLIENTS, big object $BIG, runs $RUNS, work dir $WORK; $CPUS"
  for c in $CLIENTS; do
    local b; b=$(bucket "$c")
    if ! edit_rows_only "$c"; then
      log "setup $SRV $c: uploading big.bin ($BIG)"
      "$BENCH" raw-write --endpoint "$DIRECT" --bucket "$b" --key big.bin --size "$BIG" >/dev/null || exit 1
      if has_par; then
        log "setup $SRV $c: uploading $PAR_N objects of $BIG for the parallel read"
        for i in $(seq "$PAR_N"); do
          "$BENCH" raw-write --endpoint "$DIRECT" --bucket "$b" --key "par/p$i.bin" --size "$BIG" >/dev/null || exit 1
        done
      fi
    fi
    [ "$c" = raw ] && continue
    log "setup $SRV $c: uploading edit.bin ($BIG), the object the edit rows change"
    "$BENCH" raw-write --endpoint "$DIRECT" --bucket "$b" --key edit.bin --size "$BIG" >/dev/null || exit 1
    edit_rows_only "$c" && continue
    log "setup $SRV $c: creating $((DIRS * FILES)) objects in $DIRS directories, twice (with s3fs metadata)"
    "$BENCH" populate --endpoint "$DIRECT" --bucket "$b" --prefix tree \
      --dirs "$DIRS" --files "$FILES" >/dev/null || exit 1
    "$BENCH" populate --endpoint "$DIRECT" --bucket "$b" --prefix mtree \
      --dirs "$DIRS" --files "$FILES" --with-metadata >/dev/null || exit 1
    log "setup $SRV $c: creating $MANY_N objects of 1 MiB"
    "$BENCH" populate --endpoint "$DIRECT" --bucket "$b" --prefix many \
      --dirs 1 --files "$MANY_N" --size 1048576 --concurrency 8 >/dev/null || exit 1
  done
}
stop_server() {
  local p
  for p in "${SERVER_PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  SERVER_PIDS=()
  rm -rf "$FAST_DATA"
}
# The parallel read of PAR_N objects of BIG: on the fast server only (moto keeps objects in
# memory, and PAR_N more per client would not fit in it at --full sizes).
has_par() { [ "$SRV" = fast ]; }
# moto keeps objects in memory (bench/moto_server.py): drop each big written object once
# checked, straight at moto and untimed, so that memory does not grow with every run
forget() { [ "$SRV" = moto ] && curl -sf -X DELETE "$DIRECT/$(bucket "$1")/$2" >/dev/null; true; }

# The local tree `cp -r` copies into each mount: CP_DIRS × CP_FILES files of CP_SIZE bytes.
SMALL=$WORK/small
for d in $(seq -f '%03g' "$CP_DIRS"); do
  mkdir -p "$SMALL/d$d"
  for f in $(seq -f '%03g' "$CP_FILES"); do head -c "$CP_SIZE" /dev/urandom >"$SMALL/d$d/f$f"; done
done
CP_N=$((CP_DIRS * CP_FILES))

# ---------------------------------------------------------------- request accounting
# moto logs one line per request; each client has its own bucket and its own proxy, so the
# requests and new connections of one workload are the lines added while it ran.
MARK_M=0 MARK_P=0
# Every workload starts on a quiet machine: the previous workload's files may still be
# written back to disk, and moto may still be busy, when its last request has been answered;
# neither may slow down the next client.
DROP_CACHES=0
if [ -w /proc/sys/vm/drop_caches ] && echo 1 2>/dev/null >/proc/sys/vm/drop_caches; then
  DROP_CACHES=1
else
  echo "the page cache could not be dropped between workloads (needs root and a writable /proc/sys)" >>"$NOTES"
fi
quiesce() {
  sync
  # page cache only (not dentries and inodes, which the metadata rows measure): no workload
  # starts with another's data in memory or pays for reclaiming it
  [ "$DROP_CACHES" = 1 ] && echo 1 >/proc/sys/vm/drop_caches
  local cpu_ticks i a b
  cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER_PID/stat" 2>/dev/null || echo 0; }
  for i in $(seq 60); do
    a=$(cpu_ticks); sleep 0.5; b=$(cpu_ticks)
    [ $((b - a)) -le 2 ] && break
  done
}
mark() {
  quiesce
  MARK_M=$([ -n "$REQLOG" ] && wc -l <"$REQLOG" || echo 0)
  MARK_P=$(wc -l <"$WORK/proxy-$1.log")
  MARK_CPU=$(mounter_ticks)
}
# prints: total breakdown connections
count() {
  local c=$1 b
  b=$(bucket "$c")
  if [ -z "$REQLOG" ]; then   # no request log: new connections only
    printf '\t\t%d' $(($(wc -l <"$WORK/proxy-$c.log") - MARK_P))
    return
  fi
  # wait until the server is quiet (requests a file system issues after close land here)
  local a b2 i
  for i in $(seq 60); do
    a=$(wc -l <"$REQLOG"); sleep 0.5; b2=$(wc -l <"$REQLOG")
    [ "$a" = "$b2" ] && [ "$i" -gt 1 ] && break
  done
  tail -n +"$((MARK_M + 1))" "$REQLOG" | awk -v b="/$b" '
    match($0, /"[A-Z]+ [^ ]+ HTTP/) {
      split(substr($0, RSTART + 1, RLENGTH - 1), r, " "); m = r[1]; p = r[2]
      if (index(p, b) != 1) next
      rest = substr(p, length(b) + 1)
      if (m == "GET" && (rest == "" || rest ~ /^\/?\?/)) m = "LIST"
      else if (m == "POST" && rest ~ /\?delete/) m = "DELETEMULTI"
      n[m]++; t++
    }
    END { s = ""; for (k in n) s = s k ":" n[k] " "; printf "%d\t%s", t, (s == "" ? "-" : s) }'
  printf '\t%d' $(($(wc -l <"$WORK/proxy-$c.log") - MARK_P))
}
# bytes the client sent through its proxy so far (`s3bench proxy --bytes-file`)
proxy_bytes() { sleep 0.3; cat "$WORK/proxy-$1.bytes" 2>/dev/null || echo 0; }

# CPU time (user + sys, in clock ticks) the mount process has used so far; 0 without one
mounter_ticks() {
  [ -n "$MOUNTER" ] && awk '{ print $14 + $15 }' "/proc/$MOUNTER/stat" 2>/dev/null || echo 0
}
CLK_TCK=$(getconf CLK_TCK)
# record_cpu FS NAME BYTES: the mount process's CPU seconds per GiB moved since the last mark
record_cpu() {
  [ -n "$MOUNTER" ] || return 0
  record "$1" "$2" "$run" "$(awk -v a="$MARK_CPU" -v b="$(mounter_ticks)" -v t="$CLK_TCK" -v n="$3" \
    'BEGIN { printf "%.2f", (b - a) / t / (n / 1073741824) }')"
}

# record FS WORKLOAD RUN VALUE [requests]
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$SRV" "$1" "$2" "$3" "$4" "${5:-}" >>"$RES"; }
field() { sed -n "s/.*[ ]$1=\([^ ]*\).*/\1/p" | tail -1; }

run_timed() { # FS NAME RUN FIELD CMD... : runs CMD (a command or an exported function),
  # records FIELD of its RESULT line
  local fs=$1 name=$2 run=$3 f=$4 out v
  shift 4
  mark "$fs"
  out=$(timeout "$TMO" bash -c '"$@"' _ "$@" 2>"$WORK/err-$fs-$name-$run.txt")
  local rc=$?
  if { [ "$fs" = rclone-w ] || [ "$fs" = s3csi-wb ]; } && [ $rc -eq 0 ]; then
    # Their close does not wait for the upload: the row's time runs until it is done
    # (secs grows by the wait, rows_per_s is recomputed over the longer time).
    local wait
    if [ "$fs" = rclone-w ]; then wait=$(rclone_uploaded); else wait=$(s3csi_uploaded); fi
    out=$(echo "$out" | awk -v w="$wait" '/^RESULT/ {
        for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        s = v["secs"] + w
        line = "RESULT secs=" s
        if ("rows_per_s" in v) line = line " rows_per_s=" (v["rows_per_s"] * v["secs"] / s)
        print line " upload_wait=" w; next } { print }')
  fi
  local req
  req=$(count "$fs")
  if [ $rc -ne 0 ]; then
    v=$([ $rc = 124 ] && echo timeout || echo error)
    echo "$fs $name run $run: $v ($(head -c 300 "$WORK/err-$fs-$name-$run.txt" | tr '\n' ' '))" >>"$NOTES"
  else
    v=$(echo "$out" | field "$f")
  fi
  record "$fs" "$name" "$run" "$v" "$req"
  log "  $fs $name: $v  [requests: $req]"
}

# wall FS NAME RUN NUM EXPECT CMD...: times CMD (a command or one of the exported functions
# below) by the wall clock; records NUM / seconds, or the seconds if NUM is 0. With EXPECT,
# CMD's output must be exactly that (the bytes it read).
wall() {
  local fs=$1 name=$2 run=$3 num=$4 expect=$5 t0 t1 out rc v req
  shift 5
  mark "$fs"
  t0=$(now)
  out=$(timeout "$TMO" bash -c '"$@"' _ "$@" 2>"$WORK/err-$fs-$name-$run.txt")
  rc=$?
  t1=$(now)
  req=$(count "$fs")
  if [ $rc -ne 0 ] || { [ -n "$expect" ] && [ "$out" != "$expect" ]; }; then
    v=$([ $rc = 124 ] && echo timeout || echo error)
    echo "$fs $name run $run: $v (output '${out:0:80}', expected '$expect'; $(head -c 300 "$WORK/err-$fs-$name-$run.txt" | tr '\n' ' '))" >>"$NOTES"
  else
    v=$(awk -v a="$t0" -v b="$t1" -v n="$num" 'BEGIN { s = b - a; if (n > 0) printf "%.1f", n / s; else printf "%.3f", s }')
  fi
  record "$fs" "$name" "$run" "$v" "$req"
  log "  $fs $name: $v  [requests: $req]"
}
# The bytes of every file in DIR, read in name order by one process.
read_in_order() { cat "$1"/* | wc -c; }
# The same files shared round-robin among 8 readers running at once; prints the bytes read.
read_by_8() {
  local files=("$1"/*) w j sel
  for w in 0 1 2 3 4 5 6 7; do
    sel=()
    for ((j = w; j < ${#files[@]}; j += 8)); do sel+=("${files[j]}"); done
    [ ${#sel[@]} -gt 0 ] && cat "${sel[@]}" | wc -c &
  done | sum_lines
}
# Every file in DIR read by a process of its own, all at once; prints the bytes read.
read_each() {
  local f
  for f in "$1"/*; do cat "$f" | wc -c & done | sum_lines
}
# The sum of the numbers on stdin, one per line; %.0f because mawk prints 2^31 and more as
# 2.14748e+09.
sum_lines() { awk '{ n += $1 } END { printf "%.0f\n", n }'; }
# RESULT lines of processes that ran at once (each with start= and end=, seconds since the
# epoch) as one: N (the work they did in all, in units U) over the time from the first start
# to the last end, so that loading a binary the page-cache drop evicted is not timed.
together() { # N U
  awk -v n="$1" -v u="$2" '/^RESULT/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      if (!k || v["start"] < s) s = v["start"]; if (!k || v["end"] > e) e = v["end"]; k++ }
    END { if (k && e > s) printf "RESULT procs=%d secs=%.3f %s=%.1f\n", k, e - s, u, n / (e - s) }'
}
# A start time for processes that run at once, as mdtest's barrier: far enough ahead for
# all of them to have loaded the binary the page-cache drop evicted (~35 ms here) and set up.
start_at() { awk -v t="$(date +%s.%N)" 'BEGIN { printf "%.3f", t + 0.5 }'; }
# MD_PROCS `s3bench fs mdtest` processes, each on N files in a directory of its own (made
# before the phase starts, as mdtest does), all starting the phase at the same moment
mdtest_procs() { # DIR N PHASE
  local i pids=() rc=0 out=$WORK/mdtest at
  at=$(start_at)
  for i in $(seq "$MD_PROCS"); do
    "$BENCH" fs mdtest "$1/p$i" --n "$2" --phase "$3" --start-at "$at" >"$out-$i" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  [ $rc = 0 ] && cat "$out"-* | together "$((MD_PROCS * $2))" "${3}_ops"
  rm -f "$out"-*
  return $rc
}
export -f read_in_order read_by_8 read_each sum_lines mdtest_procs together start_at
export BENCH MD_PROCS

# ---------------------------------------------------------------- mounts
MNT=""
FSPID=""
MOUNTER=""   # the mount process itself (FSPID may be a subshell that started it)
# rclone mount of BUCKET through the proxy on PORT, with the given VFS flags
rclone_mount() { # BUCKET PORT FLAGS...
  local b=$1 p=$2
  shift 2
  : >"$WORK/rclone.conf"
  env -u AWS_CA_BUNDLE RCLONE_CONFIG_BENCH_TYPE=s3 RCLONE_CONFIG_BENCH_PROVIDER=Other \
    RCLONE_CONFIG_BENCH_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
    RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" \
    RCLONE_CONFIG_BENCH_ENDPOINT="http://127.0.0.1:$p" RCLONE_CONFIG_BENCH_REGION=us-east-1 \
    RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE=true \
    rclone mount "bench:$b" "$MNT" --config "$WORK/rclone.conf" "$@"
}
mount_fs() { # FS RUN
  local fs=$1 run=$2 b p
  b=$(bucket "$fs")
  p=${PPORT[$fs]}
  MNT=$WORK/mnt-$fs
  mkdir -p "$MNT"
  case $fs in
    s3csi)
      # shellcheck disable=SC2086 # S3CSI_ARGS: extra mount flags, split on spaces
      "$S3CSI" mount --foreground --endpoint-url "http://127.0.0.1:$p" --force-path-style \
        ${S3CSI_ARGS:-} --log-file "$WORK/s3csi-$run.log" "$b" "$MNT" >>"$WORK/s3csi-$run.log" 2>&1 &
      ;;
    s3csi-wb)
      # shellcheck disable=SC2086
      "$S3CSI" mount --foreground --endpoint-url "http://127.0.0.1:$p" --force-path-style \
        --write-back 50ms --cache-dir "$WORK/cache-wb" ${S3CSI_ARGS:-} \
        --log-file "$WORK/s3csi-wb-$run.log" "$b" "$MNT" >>"$WORK/s3csi-wb-$run.log" 2>&1 &
      ;;
    s3fs)
      printf '%s:%s\n' "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >"$WORK/passwd-s3fs"
      chmod 600 "$WORK/passwd-s3fs"
      s3fs "$b" "$MNT" -f -o "url=http://127.0.0.1:$p,use_path_request_style,passwd_file=$WORK/passwd-s3fs" \
        >"$WORK/s3fs-$run.log" 2>&1 &
      ;;
    rclone)
      rclone_mount "$b" "$p" --vfs-cache-mode off >"$WORK/rclone-$run.log" 2>&1 &
      ;;
    rclone-w)
      # Edits staged in rclone's disk cache, uploaded as soon as closed (no write-back delay);
      # its remote control answers how many uploads are still under way.
      RC_PORT=$(free_port)
      rclone_mount "$b" "$p" --vfs-cache-mode writes --vfs-write-back 0s \
        --cache-dir "$WORK/rclone-cache" --rc --rc-addr "127.0.0.1:$RC_PORT" --rc-no-auth \
        >"$WORK/rclone-w-$run.log" 2>&1 &
      ;;
  esac
  FSPID=$!
  for _ in $(seq 150); do
    mountpoint -q "$MNT" && break
    kill -0 "$FSPID" 2>/dev/null || break
    sleep 0.2
  done
  if ! mountpoint -q "$MNT"; then
    echo "$fs: mount failed in run $run (see logs)" >>"$NOTES"
    kill "$FSPID" 2>/dev/null
    return 1
  fi
  MOUNTED+=("$MNT")
  MOUNTER=$(pgrep -n -f -- "$MNT")
}
umount_fs() {
  fusermount3 -u "$MNT" 2>/dev/null || umount "$MNT" 2>/dev/null || umount -l "$MNT"
  for _ in $(seq 300); do kill -0 "$FSPID" 2>/dev/null || break; sleep 0.2; done
  kill "$FSPID" 2>/dev/null
  wait "$FSPID" 2>/dev/null
  MOUNTED=()
  MOUNTER=""
}

bench_ls() { # FS RUN TREE NAME
  local fs=$1 run=$2 tree=$3 name=$4 t0 t1 out rc req
  mark "$fs"
  t0=$(now)
  out=$(timeout "$TMO" ls -laR "$MNT/$tree" 2>"$WORK/err-$fs-$name-$run.txt" | grep -c '^-')
  rc=$?
  t1=$(now)
  req=$(count "$fs")
  if [ "$out" != "$((DIRS * FILES))" ]; then
    echo "$fs run $run: ls -laR $tree listed ${out:-0} files, expected $((DIRS * FILES))" >>"$NOTES"
    record "$fs" "$name" "$run" "$([ "$rc" = 124 ] && echo timeout || echo error)" "$req"
  else
    record "$fs" "$name" "$run" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')" "$req"
  fi
  log "  $fs $name: $(tail -1 "$RES" | cut -f5)  [requests: $req]"
}

# Waits until rclone-w has no upload queued or under way; prints the seconds it waited.
# rclone reports idle for a while after a close before its write-back queues the upload (a
# 1 GiB append's upload then landed in the next row), so the wait also lasts until nothing
# went through its proxy for 2 s; those 2 s are not counted.
rclone_uploaded() {
  local t0 t1 n quiet=0 last sent
  t0=$(now)
  last=$(cat "$WORK/proxy-rclone-w.bytes" 2>/dev/null)
  for _ in $(seq 30000); do
    n=$(rclone rc --url "http://127.0.0.1:$RC_PORT" vfs/stats 2>/dev/null | python3 -c '
import json, sys
c = json.load(sys.stdin).get("diskCache", {})
print(c.get("uploadsInProgress", 0) + c.get("uploadsQueued", 0))' 2>/dev/null)
    sleep 0.2
    sent=$(cat "$WORK/proxy-rclone-w.bytes" 2>/dev/null)
    if [ "$n" = 0 ] && [ "$sent" = "$last" ]; then
      quiet=$((quiet + 1))
      [ "$quiet" -ge 10 ] && break
    else
      quiet=0 last=$sent
    fi
  done
  t1=$(now)
  awk -v a="$t0" -v b="$t1" 'BEGIN { v = b - a - 2; printf "%.3f", v < 0 ? 0 : v }'
}

# Waits until s3csi-wb keeps no edit for upload (its cache dir holds no staged file);
# prints the seconds it waited.
s3csi_uploaded() {
  local t0 t1
  t0=$(now)
  for _ in $(seq 30000); do
    compgen -G "$WORK/cache-wb/*.staged" >/dev/null || break
    sleep 0.01
  done
  t1=$(now)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }'
}

# rclone-w, s3csi-wb: the edit rows only, each until its upload is done.
bench_edits() { # FS RUN
  local fs=$1 run=$2 sent
  mount_fs "$fs" "$run" || return
  log "run $run: $fs mounted (pid $FSPID)"
  sent=$(proxy_bytes "$fs")
  run_timed "$fs" edit_append "$run" secs python3 bench/edit_workloads.py append "$MNT/edit.bin" --size 1MiB
  record "$fs" edit_append_sent "$run" "$(awk -v a="$sent" -v b="$(proxy_bytes "$fs")" 'BEGIN { printf "%.1f", (b - a) / 1048576 }')"
  run_timed "$fs" edit_random "$run" secs python3 bench/edit_workloads.py random-writes "$MNT/edit.bin" --n 1000
  run_timed "$fs" sqlite "$run" rows_per_s python3 bench/edit_workloads.py sqlite "$MNT/db-$run.sqlite" --rows "$SQL_N"
  umount_fs
}

bench_mount() { # FS RUN
  local fs=$1 run=$2 t0 t1 out rc req size hwm
  mount_fs "$fs" "$run" || return
  log "run $run: $fs mounted (pid $FSPID)"
  # 1. sequential read; peak RSS of the file-system process (read is its first workload)
  run_timed "$fs" read "$run" mibps "$BENCH" fs seq-read "$MNT/big.bin"
  record_cpu "$fs" cpu_read "$BIG_BYTES"
  hwm=$(awk '/VmHWM/ {print $2}' "/proc/$MOUNTER/status" 2>/dev/null)
  record "$fs" rss "$run" "$([ -n "$hwm" ] && echo $((hwm / 1024)) || echo n/a)"
  # 2. sequential write, then the size as S3 reports it
  run_timed "$fs" write "$run" mibps "$BENCH" fs seq-write "$MNT/write-$run.bin" --size "$BIG"
  record_cpu "$fs" cpu_write "$BIG_BYTES"
  size=$("$BENCH" head --endpoint "$DIRECT" --bucket "$(bucket "$fs")" --key "write-$run.bin" 2>/dev/null | field size)
  if [ "$size" != "$BIG_BYTES" ]; then
    echo "$fs run $run: written file has size '${size:-missing}' in S3, expected $BIG_BYTES" >>"$NOTES"
    awk -F'\t' -v OFS='\t' -v n="$(wc -l <"$RES")" 'NR == n { $5 = "FAIL" } 1' "$RES" >"$RES.tmp" && mv "$RES.tmp" "$RES"
  fi
  forget "$fs" "write-$run.bin"
  # 3. touch
  mkdir -p "$MNT/touch-$run"
  run_timed "$fs" touch "$run" secs "$BENCH" fs touch "$MNT/touch-$run" --n "$TOUCH_N"
  # 4. ls -laR over the tree created through the S3 API, without and with s3fs metadata
  bench_ls "$fs" "$run" tree ls
  bench_ls "$fs" "$run" mtree ls_meta
  # 5. small write + unlink
  mkdir -p "$MNT/wu-$run"
  run_timed "$fs" write_unlink "$run" secs "$BENCH" fs write-unlink "$MNT/wu-$run" --n "$WU_N"
  # 6. mdtest-like create / stat / remove, one phase at a time so each is counted
  mkdir -p "$MNT/md-$run"
  for ph in create stat remove; do
    run_timed "$fs" "md_$ph" "$run" "${ph}_ops" "$BENCH" fs mdtest "$MNT/md-$run" --n "$MD_N" --phase "$ph"
  done
  # 7. many files and many readers: MANY_N objects of 1 MiB read once in name order, then by
  #    8 readers at once (a training data loader's two modes); PAR_N processes each reading
  #    its own $BIG object; cp -r of CP_N small files into the mount; mdtest with MD_PROCS
  #    processes sharing MD_N files
  wall "$fs" many_seq "$run" 0 "$((MANY_N << 20))" read_in_order "$MNT/many/d000"
  wall "$fs" many_par "$run" 0 "$((MANY_N << 20))" read_by_8 "$MNT/many/d000"
  if has_par; then
    wall "$fs" par_read "$run" "$((PAR_N * BIG_BYTES / 1048576))" "$((PAR_N * BIG_BYTES))" read_each "$MNT/par"
    record_cpu "$fs" cpu_par "$((PAR_N * BIG_BYTES))"
  fi
  wall "$fs" cp_small "$run" 0 "" cp -r "$SMALL" "$MNT/cp-$run"
  local copied
  copied=$(find "$MNT/cp-$run" -type f 2>/dev/null | wc -l)
  if [ "$copied" != "$CP_N" ]; then
    echo "$fs run $run: cp -r left $copied files in the mount, expected $CP_N" >>"$NOTES"
    awk -F'\t' -v OFS='\t' -v n="$(wc -l <"$RES")" 'NR == n { $5 = "FAIL" } 1' "$RES" >"$RES.tmp" && mv "$RES.tmp" "$RES"
  fi
  for ph in create stat remove; do
    run_timed "$fs" "md4_$ph" "$run" "${ph}_ops" mdtest_procs "$MNT/md4-$run" "$((MD_N / MD_PROCS))" "$ph"
  done
  # 7. editing in place: append 1 MiB to an existing $BIG object (and the MiB sent upstream
  #    for it, as its proxy counted them), 1000 random 4 KiB writes into it, SQLite inserts.
  #    Every time includes the close.
  local sent
  sent=$(proxy_bytes "$fs")
  run_timed "$fs" edit_append "$run" secs python3 bench/edit_workloads.py append "$MNT/edit.bin" --size 1MiB
  record "$fs" edit_append_sent "$run" "$(awk -v a="$sent" -v b="$(proxy_bytes "$fs")" 'BEGIN { printf "%.1f", (b - a) / 1048576 }')"
  run_timed "$fs" edit_random "$run" secs python3 bench/edit_workloads.py random-writes "$MNT/edit.bin" --n 1000
  run_timed "$fs" sqlite "$run" rows_per_s python3 bench/edit_workloads.py sqlite "$MNT/db-$run.sqlite" --rows "$SQL_N"
  umount_fs
}

bench_raw() { # RUN
  local run=$1 ep="http://127.0.0.1:${PPORT[raw]}"
  run_timed raw read "$run" mibps "$BENCH" raw-read --endpoint "$ep" --bucket "$(bucket raw)" --key big.bin
  run_timed raw write "$run" mibps "$BENCH" raw-write --endpoint "$ep" --bucket "$(bucket raw)" \
    --key "write-$run.bin" --size "$BIG"
  forget raw "write-$run.bin"
  if has_par; then
    run_timed raw par_read "$run" mibps raw_read_each "$ep" "$(bucket raw)"
  fi
}
# PAR_N `s3bench raw-read` processes at once, each reading its own par/pN.bin
raw_read_each() { # ENDPOINT BUCKET
  local i pids=() rc=0 out=$WORK/raw-par at
  at=$(start_at)
  for i in $(seq "$PAR_N"); do
    "$BENCH" raw-read --endpoint "$1" --bucket "$2" --key "par/p$i.bin" --start-at "$at" >"$out-$i" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  [ $rc = 0 ] && cat "$out"-* | together "$((PAR_N * BIG_BYTES / 1048576))" mibps
  rm -f "$out"-*
  return $rc
}
export -f raw_read_each
export PAR_N BIG_BYTES WORK

T_START=$(date +%s)
ELAPSED_BY=""
for srv in $SERVERS; do
  t_srv=$(date +%s)
  start_server "$srv"
  for run in $(seq "$RUNS"); do
    for c in $CLIENTS; do
      case $c in
        raw) bench_raw "$run" ;;
        rclone-w) [ "$run" -le "$PEER_RUNS" ] && bench_edits rclone-w "$run" ;;
        s3csi-wb) bench_edits s3csi-wb "$run" ;;
        s3csi) bench_mount "$c" "$run" ;;
        *) [ "$run" -le "$PEER_RUNS" ] && bench_mount "$c" "$run" ;;
      esac
    done
  done
  stop_server
  ELAPSED_BY="$ELAPSED_BY $srv:$(($(date +%s) - t_srv))"
done
ELAPSED=$(($(date +%s) - T_START))

mkdir -p bench/results
python3 bench/report.py "$RES" "$NOTES" \
  --rtt "$RTT" --big "$BIG" --touch "$TOUCH_N" --objects "$((DIRS * FILES))" --dirs "$DIRS" \
  --wu "$WU_N" --md "$MD_N" --sql "$SQL_N" --cpus "$CPUS" --dropped-caches "$DROP_CACHES" --runs "$RUNS" --peer-runs "$PEER_RUNS" --elapsed "$ELAPSED$ELAPSED_BY" \
  --many "$MANY_N" --par "$PAR_N" --cp "$CP_N" --cp-size "$CP_SIZE" --md-procs "$MD_PROCS" --servers "$SERVERS" \
  --versions "s3csi $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo '+dirty'); $(s3fs --version 2>/dev/null | head -1 | sed 's/ (commit.*//'); $(rclone version 2>/dev/null | head -1); moto $(python3 -c 'import moto;print(moto.__version__)')" \
  >bench/results/latest.md
cat bench/results/latest.md
cp "$RES" bench/results/latest.tsv
