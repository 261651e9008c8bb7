"""Shared helpers of the chart tests and of render_manifests.py.

The chart is rendered with Helm's own Go SDK (PyPI `helm-python-sdk`, imported as `helm_python`,
which bundles `libhelm_c` in its wheel: no helm binary, no network) and the objects are checked
with PyPI `kubernetes-validate`, which bundles the official JSON schemas of each Kubernetes
release.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from helm_python import _native

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART_DIR = REPO / "charts" / "s3csi"
VALUES_DIR = HERE / "values"
MANIFEST = REPO / "manifests" / "s3csi.yaml"
EXAMPLES_DIR = REPO / "manifests" / "examples"
# Schemas of Kubernetes releases older than those kubernetes-validate bundles (written by
# vendor_kube_schemas.py).
KUBE_SCHEMAS_DIR = HERE / "kube-schemas"

RELEASE = "s3csi"
NAMESPACE = "kube-system"
DRIVER_NAME = "s3csi.dev"

# Helm's install order (pkg/release/util/kind_sorter.go, the kinds this chart uses); kinds it
# does not know (CSIDriver) go last, as Helm puts them.
_KIND_ORDER = [
    "Namespace",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "DaemonSet",
    "Pod",
    "Deployment",
]

_DOC_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)


def load_values_file(name: str) -> dict[str, Any]:
    """A values file from tests/chart/values/ (`name` without .yaml)."""
    data = yaml.safe_load((VALUES_DIR / f"{name}.yaml").read_text())
    return data or {}


def render_chart(
    values: dict[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    kube_version: str | None = None,
) -> dict[str, str]:
    """Render the chart offline: template path -> rendered text (NOTES.txt included).

    `kube_version` (e.g. "v1.20.2") is what .Capabilities.KubeVersion says, as with
    `helm template --kube-version`; None: the SDK's default (a current release). Like
    `helm template`, rendering does not check the chart's kubeVersion constraint.
    """
    with helm.Chart.load(CHART_DIR) as chart:
        if kube_version is None:
            return chart.render(values or {}, name=release, namespace=namespace, is_install=True)
        # helm-python-sdk 0.2.2's Chart.render does not expose it, but its native render
        # takes the same `kube_version` option as its lint.
        opts = {"name": release, "namespace": namespace, "is_install": True,
                "kube_version": kube_version}
        rendered = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts))
        return json.loads(rendered)


def split_documents(text: str) -> list[str]:
    """The non-empty YAML documents of a multi-document text, stripped."""
    docs = []
    for doc in _DOC_SEPARATOR.split(text):
        body = doc.strip("\n")
        meaningful = [
            line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")
        ]
        if meaningful:
            docs.append(body)
    return docs


def rendered_documents(rendered: dict[str, str]) -> list[tuple[str, str]]:
    """(template path, document text) of every manifest, in Helm's install order."""
    docs = []
    for source in sorted(rendered):
        if not source.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in split_documents(rendered[source]):
            docs.append((source, doc))

    def order(item: tuple[str, str]) -> tuple[int, str, str]:
        kind = yaml.safe_load(item[1]).get("kind", "")
        rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
        return (rank, kind, item[0])

    return sorted(docs, key=order)  # stable: keeps the order within a template


def render_objects(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Render the chart and parse every manifest into an object."""
    return [yaml.safe_load(doc) for _, doc in rendered_documents(render_chart(values, **kwargs))]


@lru_cache(maxsize=None)
def _vendored_schemas(major_minor: str) -> dict[str, Any] | None:
    path = KUBE_SCHEMAS_DIR / f"v{major_minor}.json"
    return json.loads(path.read_text()) if path.exists() else None


def schema_versions() -> list[str]:
    """Every Kubernetes release (major.minor) that validate_object can check against."""
    vendored = [p.stem[1:] for p in KUBE_SCHEMAS_DIR.glob("v*.json")]
    bundled = [kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()]
    return sorted(set(vendored) | set(bundled), key=lambda v: tuple(int(x) for x in v.split(".")))


def validate_object(obj: dict[str, Any], kube_version: str) -> None:
    """Validate `obj` against the strict official schema of Kubernetes `kube_version`
    ("1.20", "1.37", ...): kubernetes-validate's bundled schemas, else the vendored ones of
    kube-schemas/. Raises jsonschema.ValidationError (kubernetes_validate.ValidationError is
    one) on an invalid object, KeyError for a kind the vendored file lacks."""
    version = kubernetes_validate.utils.major_minor(kube_version.lstrip("v"))
    vendored = _vendored_schemas(version)
    if vendored is None:
        kubernetes_validate.validate(obj, version, strict=True)
        return
    root = vendored["kinds"][f"{obj['apiVersion']}/{obj['kind']}"]
    schema = {"$ref": f"#/definitions/{root}", "definitions": vendored["definitions"]}
    jsonschema.Draft7Validator(schema).validate(obj)


def load_yaml_objects(path: Path) -> list[dict[str, Any]]:
    """Every object of a multi-document YAML file."""
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


def default_manifest_text() -> str:
    """The content manifests/s3csi.yaml must have: the chart's default rendering."""
    with helm.Chart.load(CHART_DIR) as chart:
        version = chart.version
    header = (
        f"# s3csi {version}: the Helm chart charts/s3csi rendered with its default values\n"
        f'# (release "{RELEASE}", namespace "{NAMESPACE}"), for `kubectl apply -f`, as for a current\n'
        "# Kubernetes (1.26 or later). On 1.20-1.25 set the CSIDriver's fsGroupPolicy to None (Helm\n"
        "# does that itself from the cluster's version).\n"
        "# Generated by tests/chart/render_manifests.py; do not edit by hand: change the chart\n"
        "# and run `python3 tests/chart/render_manifests.py`.\n"
    )
    parts = [header]
    for source, doc in rendered_documents(render_chart()):
        parts.append(f"---\n# Source: {source}\n{doc}\n")
    return "".join(parts)


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """Objects of `kind` (and `name`, when given)."""
    return [
        o
        for o in objects
        if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single object of `kind` (and `name`); fails when there is not exactly one."""
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The container `name` of a pod spec."""
    matches = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"container {name!r} not found exactly once"
    return matches[0]


def flag(args: list[str], name: str) -> str:
    """The value of `--name=value` (or `--name value`) in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args) and not args[i + 1].startswith("--"):
            return args[i + 1]
    raise AssertionError(f"--{name} not in {args}")
