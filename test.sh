#!/usr/bin/env bash
# The test suite: unit tests, real FUSE mounts against local S3 servers, the CSI services
# over a unix socket, pod mode against a fake API server, the Helm chart rendered and
# validated offline, and the end-to-end suite on a real one-node Kubernetes (tests/e2e;
# S3CSI_SKIP_E2E=1 skips it). Needs root and /dev/fuse; installs the rest when missing
# (tests/setup.sh: fuse3, curl, moto, the chart and e2e tools; tests/e2e/k8s.sh: the
# cluster's Debian packages). S3CSI_SKIP_SETUP=1 skips tests/setup.sh.
set -euo pipefail
cd "$(dirname "$0")"
[ "${S3CSI_SKIP_SETUP:-}" = 1 ] || tests/setup.sh
cargo fmt --check
cargo test --release --locked
python3 -m pytest -q tests/chart
tests/e2e/run.sh
