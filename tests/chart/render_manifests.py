#!/usr/bin/env python3
"""Regenerate manifests/s3csi.yaml: the chart's default rendering as plain YAML.

Run from anywhere after `pip install -r tests/chart/requirements.txt`:

    python3 tests/chart/render_manifests.py

tests/chart/test_chart.py fails while the committed file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chartlib import MANIFEST, REPO, default_manifest_text  # noqa: E402


def main() -> int:
    text = default_manifest_text()
    MANIFEST.parent.mkdir(parents=True, exist_ok=True)
    if MANIFEST.exists() and MANIFEST.read_text() == text:
        print(f"{MANIFEST.relative_to(REPO)} is up to date")
        return 0
    MANIFEST.write_text(text)
    print(f"wrote {MANIFEST.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
