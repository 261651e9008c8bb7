# Shared by bench/ls_fast.sh, bench/edit_fast.sh and bench/cache_fast.sh (sourced, not run): the embedded
# `s3csi s3-server` on a free loopback port behind one latency proxy, pinned to the last
# CPU like run.sh's server side (clients on the others), and the helpers both use.
# Needs WORK (holding copies of s3csi and s3bench) and RTT; sets DIRECT (the server),
# PPORT (the proxy's port; bytes sent through it are counted in $WORK/sent, requests by
# kind in $WORK/requests), MNT, SERVER
# and CLIENT (taskset prefixes) and FSPID (by wait_mounted).
export AWS_ACCESS_KEY_ID=s3csi-demo AWS_SECRET_ACCESS_KEY=s3csi-demo-secret AWS_REGION=us-east-1
export S3CSI_S3_SECRET_KEY=$AWS_SECRET_ACCESS_KEY RUST_BACKTRACE=0
log() { echo "[$(date +%T)] $*" >&2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
NCPU=$(nproc)
SERVER=() CLIENT=()
if [ "$NCPU" -ge 2 ] && command -v taskset >/dev/null; then
  SERVER=(taskset -c "$((NCPU - 1))") CLIENT=(taskset -c "0-$((NCPU - 2))")
fi
PIDS=() MNT=$WORK/mnt
cleanup() {
  mountpoint -q "$MNT" && { fusermount3 -u "$MNT" 2>/dev/null || umount -l "$MNT"; }
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK/data" "$WORK/cache-wb" "$WORK/rclone-cache"
}
trap cleanup EXIT

"${SERVER[@]}" "$WORK/s3csi" s3-server --listen 127.0.0.1:0 --dir "$WORK/data" --bucket bench \
  --log-level warn >"$WORK/server.out" 2>"$WORK/server.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q '^listening on' "$WORK/server.out" && break; sleep 0.1; done
DIRECT=$(sed -n 's/^listening on //p' "$WORK/server.out" | head -1)
[ -n "$DIRECT" ] || { echo "the embedded server did not start" >&2; cat "$WORK/server.log" >&2; exit 1; }
PPORT=$(free_port)
"${SERVER[@]}" "$WORK/s3bench" proxy --listen "127.0.0.1:$PPORT" --upstream "${DIRECT#http://}" \
  --delay-ms $((RTT / 2)) --bytes-file "$WORK/sent" --requests-file "$WORK/requests" >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.3
printf '%s:%s\n' "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >"$WORK/passwd-s3fs"
chmod 600 "$WORK/passwd-s3fs"
mkdir -p "$MNT"

# `rclone mount` of the bench bucket through the proxy on $MNT, in the foreground, with
# rclone's own options after it (the remote `b:` is configured by environment).
rclone_mount() { # OPTIONS...
  : >"$WORK/rclone.conf"
  RCLONE_CONFIG_B_TYPE=s3 RCLONE_CONFIG_B_PROVIDER=Other RCLONE_CONFIG_B_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
  RCLONE_CONFIG_B_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" RCLONE_CONFIG_B_ENDPOINT="http://127.0.0.1:$PPORT" \
  RCLONE_CONFIG_B_REGION=us-east-1 RCLONE_CONFIG_B_FORCE_PATH_STYLE=true \
    "${CLIENT[@]}" env -u AWS_CA_BUNDLE rclone mount b:bench "$MNT" --config "$WORK/rclone.conf" "$@"
}

# After a mount command was started in the background: waits until $MNT is mounted.
wait_mounted() { # NAME
  FSPID=$!
  for _ in $(seq 150); do mountpoint -q "$MNT" && return 0; kill -0 "$FSPID" 2>/dev/null || break; sleep 0.1; done
  echo "$1 did not mount (see $WORK/$1.log)" >&2
  return 1
}
umount_one() {
  fusermount3 -u "$MNT" 2>/dev/null || umount "$MNT" 2>/dev/null || umount -l "$MNT"
  for _ in $(seq 600); do kill -0 "$FSPID" 2>/dev/null || break; sleep 0.1; done
  kill "$FSPID" 2>/dev/null; wait "$FSPID" 2>/dev/null
}
# Requests sent through the proxy since the snapshot BEFORE (an earlier `requests_now`):
# `HEAD:1000 LIST:100`, or `-` for none.
requests_now() { sleep 0.3; cat "$WORK/requests" 2>/dev/null; echo; }
requests_since() { # BEFORE
  { echo "$1" | tr ' ' '\n' | sed 's/^/- /'; requests_now | tr ' ' '\n' | sed 's/^/+ /'; } | awk -F'[ :]' '
    NF == 3 { n[$2] += ($1 == "+" ? $3 : -$3) }
    END { s = ""; for (k in n) if (n[k] > 0) s = s k ":" n[k] " "; print (s == "" ? "-" : substr(s, 1, length(s) - 1)) }'
}
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { if (NR) print a[int((NR + 1) / 2)] }'; }
