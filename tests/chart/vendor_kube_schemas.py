#!/usr/bin/env python3
"""Write tests/chart/kube-schemas/v<MAJOR.MINOR>.json: the strict JSON schemas of the kinds the
chart, its examples and the mounter Pods use, for a Kubernetes release that the pinned
kubernetes-validate no longer ships (it bundles only its latest dozen releases).

The source is an older kubernetes-validate wheel, which bundles the same official schemas
(yannh/kubernetes-json-schema, "-local-strict" flavour) for older releases; 1.28.3 has
1.20-1.28:

    python3 -m pip download --no-deps -d /tmp/kv kubernetes-validate==1.28.3
    python3 tests/chart/vendor_kube_schemas.py /tmp/kv/kubernetes_validate-1.28.3-py3-none-any.whl 1.20

Only the definitions those kinds reach are kept, without their descriptions, so the file stays
small; chartlib.validate_object reads it. Nothing else is changed: a field the release does not
know is still refused, and every type and enum is the release's own.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "kube-schemas"

# apiVersion/kind -> the schema file of kubernetes-json-schema's naming.
KINDS = {
    "v1/ServiceAccount": "serviceaccount-v1",
    "v1/Secret": "secret-v1",
    "v1/Pod": "pod-v1",
    "v1/PersistentVolume": "persistentvolume-v1",
    "v1/PersistentVolumeClaim": "persistentvolumeclaim-v1",
    "apps/v1/DaemonSet": "daemonset-apps-v1",
    "apps/v1/Deployment": "deployment-apps-v1",
    "rbac.authorization.k8s.io/v1/ClusterRole": "clusterrole-rbac-v1",
    "rbac.authorization.k8s.io/v1/ClusterRoleBinding": "clusterrolebinding-rbac-v1",
    "rbac.authorization.k8s.io/v1/Role": "role-rbac-v1",
    "rbac.authorization.k8s.io/v1/RoleBinding": "rolebinding-rbac-v1",
    "storage.k8s.io/v1/StorageClass": "storageclass-storage-v1",
    "storage.k8s.io/v1/CSIDriver": "csidriver-storage-v1",
}

_REF = re.compile(r"^(?:_definitions\.json)?#/definitions/(.+)$")


def _strip(node: Any) -> Any:
    """The schema without descriptions, with references local to the one file."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                continue
            if key == "$ref" and isinstance(value, str):
                match = _REF.match(value)
                assert match, value
                out[key] = f"#/definitions/{match.group(1)}"
                continue
            out[key] = _strip(value)
        return out
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield _REF.match(value).group(1)
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def main() -> int:
    wheel, version = Path(sys.argv[1]), sys.argv[2]
    prefix = f"kubernetes_validate/kubernetes-json-schema/v{version}.0-local-strict/"
    with zipfile.ZipFile(wheel) as z:
        definitions = json.loads(z.read(prefix + "_definitions.json"))["definitions"]
        roots = {}
        for key, name in KINDS.items():
            ref = json.loads(z.read(f"{prefix}{name}.json"))["$ref"]
            roots[key] = _REF.match(ref).group(1)
    keep: set[str] = set()
    todo = list(roots.values())
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(_refs(definitions[name]))
    data = {
        "source": f"{wheel.name}: kubernetes-json-schema v{version}.0-local-strict",
        "kinds": roots,
        "definitions": {name: _strip(definitions[name]) for name in sorted(keep)},
    }
    OUT_DIR.mkdir(exist_ok=True)
    out = OUT_DIR / f"v{version}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(HERE.parent.parent)}: {len(keep)} definitions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
