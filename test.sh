#!/usr/bin/env bash
# The test suite: unit tests, real FUSE mounts against local S3 servers, the CSI services
# over a unix socket, pod mode against a fake API server, and the Helm chart rendered and
# validated offline. Needs root and /dev/fuse; installs the rest when missing
# (tests/setup.sh: fuse3, curl, moto, the chart tools). S3CSI_SKIP_SETUP=1 skips that step.
set -euo pipefail
cd "$(dirname "$0")"
[ "${S3CSI_SKIP_SETUP:-}" = 1 ] || tests/setup.sh
cargo fmt --check
cargo test --release --locked
python3 -m pytest -q tests/chart
