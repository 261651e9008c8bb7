#!/usr/bin/env bash
# Installs what the test suite needs and is missing, on Debian 12 (root): fuse3, curl,
# python3 + pip, git, rsync, the moto S3 server, the chart test tools and the e2e harness's. Quick
# when all is there
# (one `pip install` that finds everything satisfied). Called by test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
# Debian 12's own python3 refuses system-wide pip installs without this (PEP 668).
export PIP_BREAK_SYSTEM_PACKAGES=1
need_apt=()
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
command -v curl >/dev/null || need_apt+=(curl)
command -v unshare >/dev/null || need_apt+=(util-linux)
# Real programs the edit-in-place tests run on a mount.
command -v git >/dev/null || need_apt+=(git)
command -v tar >/dev/null || need_apt+=(tar)
command -v rsync >/dev/null || need_apt+=(rsync)
command -v setfacl >/dev/null || need_apt+=(acl)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}"
fi

# The local S3 server the integration tests start (moto), the chart test tools and the e2e
# harness's (grpcio-tools, boto3; the cluster's own packages come from tests/e2e/k8s.sh deps).
python3 -m pip install -q --disable-pip-version-check 'moto[server]==5.2.1' \
  -r tests/chart/requirements.txt -r tests/e2e/requirements.txt
