#!/usr/bin/env bash
# Quick start without a cloud account: start a local S3 server (moto) on 127.0.0.1,
# create a bucket, and mount it with s3csi. Needs root (or FUSE access), fuse3 and
# `pip install 'moto[server]'`.
#   ./demo.sh [MOUNTPOINT]        default /tmp/s3csi-demo
# Stop with: umount MOUNTPOINT; kill the moto_server it prints.
set -euo pipefail
cd "$(dirname "$0")"
MNT=${1:-/tmp/s3csi-demo}
PORT=${S3_PORT:-9090}
cargo build --release --locked -q
if ! curl -s "http://127.0.0.1:$PORT" >/dev/null; then
  nohup moto_server -H 127.0.0.1 -p "$PORT" >/tmp/s3csi-demo-moto.log 2>&1 &
  echo "started local S3 server (moto) on 127.0.0.1:$PORT, pid $!"
  for _ in $(seq 50); do curl -s "http://127.0.0.1:$PORT" >/dev/null && break; sleep 0.2; done
fi
curl -sf -X PUT "http://127.0.0.1:$PORT/demo-bucket" >/dev/null || true
mkdir -p "$MNT"
# moto accepts any keys; real deployments use the AWS default credential chain.
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo
./target/release/s3csi mount --endpoint-url "http://127.0.0.1:$PORT" --force-path-style \
  --log-file /tmp/s3csi-demo.log demo-bucket "$MNT"
echo "hello from s3csi" > "$MNT/hello.txt"
mkdir -p "$MNT/docs"
ls -la "$MNT"
cat "$MNT/hello.txt"
echo "demo-bucket is mounted at $MNT (logs: /tmp/s3csi-demo.log); unmount with: umount $MNT"
