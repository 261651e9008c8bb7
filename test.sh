#!/usr/bin/env bash
# The test suite: unit tests, real FUSE mounts against a local moto S3 server, the CSI
# services over a unix socket, and the Helm chart rendered and validated offline.
# Needs root, /dev/fuse, fuse3, moto_server and the packages in tests/chart/requirements.txt
# (.ci/run installs them on a fresh Debian 12 machine).
set -euo pipefail
cd "$(dirname "$0")"
cargo fmt --check
cargo test --release --locked
python3 -m pytest -q tests/chart
