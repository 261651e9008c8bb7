"""Tests of the Helm chart (charts/s3csi), the rendered manifests and the examples.

No helm binary and no cluster: the chart is rendered and linted by Helm's Go SDK through PyPI
`helm-python-sdk`, every object is validated against the official Kubernetes schemas by PyPI
`kubernetes-validate --strict`, and the wiring that schemas cannot see (driver name, socket
paths, mount propagation, StorageClass parameters, ServiceAccounts) is asserted here.

Run from the repository root:  python3 -m pytest -q tests/chart
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from chartlib import (
    CHART_DIR,
    DRIVER_NAME,
    EXAMPLES_DIR,
    MANIFEST,
    NAMESPACE,
    REPO,
    container,
    default_manifest_text,
    find,
    flag,
    load_values_file,
    load_yaml_objects,
    one,
    render_chart,
    render_objects,
    schema_versions,
    validate_object,
)

GOOD_VALUES = [
    "defaults", "irsa", "two-buckets", "minio-secret", "metrics", "process-mode", "mounter-custom",
]
# Good values without the controller: the tests of the `case` fixture expect a controller, so
# these go through the lint, schema and Kubernetes-schema tests and tests of their own.
NODE_ONLY_VALUES = ["node-only"]
ALL_GOOD_VALUES = GOOD_VALUES + NODE_ONLY_VALUES
# The oldest Kubernetes release the chart supports (Chart.yaml's kubeVersion; its schemas are
# vendored in kube-schemas/, kubernetes-validate no longer bundles them), the last one before
# the version-dependent CSIDriver fields change (templates/csidriver.yaml), the first one after,
# and the newest one kubernetes-validate bundles. The chart is rendered for each (as
# .Capabilities.KubeVersion) and checked against that release's schemas.
OLDEST_KUBE = "1.20"
NEWEST_KUBE = kubernetes_validate.utils.major_minor(kubernetes_validate.latest_version())
KUBE_VERSIONS = [OLDEST_KUBE, "1.25", "1.26", NEWEST_KUBE]
EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))
ROLE_ARN = "eks.amazonaws.com/role-arn"


@pytest.fixture(scope="module", params=GOOD_VALUES)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(values file name, values, rendered objects) for each good values file."""
    values = load_values_file(request.param)
    return request.param, values, render_objects(values)


@pytest.fixture(scope="module")
def chart_values() -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.values


def merged(values: dict[str, Any]) -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(values)


def node_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet")["spec"]["template"]["spec"]


def controller_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def host_path(pod: dict[str, Any], volume: str) -> str:
    for v in pod["volumes"]:
        if v["name"] == volume:
            return v["hostPath"]["path"]
    raise AssertionError(f"no volume {volume}")


def mount_of(c: dict[str, Any], volume: str) -> dict[str, Any]:
    mounts = [m for m in c.get("volumeMounts", []) if m["name"] == volume]
    assert len(mounts) == 1, f"{c['name']} mounts {volume} {len(mounts)} times"
    return mounts[0]


def named(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    """The single object of `kind` whose name ends with `-suffix`."""
    found = [o for o in find(objects, kind) if o["metadata"]["name"].endswith(f"-{suffix}")]
    assert len(found) == 1, f"expected one {kind} *-{suffix}, found {len(found)}"
    return found[0]


def pod_mode(values: dict[str, Any]) -> bool:
    return merged(values)["mounter"]["mode"] == "pod"


def flag_present(args: list[str], name: str) -> bool:
    """Whether the switch `--name` (no value) is in an argument list."""
    return f"--{name}" in args


def socket_path(endpoint: str) -> str:
    assert endpoint.startswith("unix://"), endpoint
    return endpoint[len("unix://") :]


# --- Helm: lint, schema, render -------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_GOOD_VALUES)
@pytest.mark.parametrize("kube_version", ["v1.20.2", "v1.28.0", None])
def test_helm_lint_is_clean(name: str, kube_version: str | None) -> None:
    report = helm.lint(
        CHART_DIR,
        load_values_file(name),
        strict=True,
        namespace=NAMESPACE,
        kube_version=kube_version,
    )
    assert report["errors"] == []
    # Severity: 1 info, 2 warning, 3 error. Only the "icon is recommended" info is tolerated.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


@pytest.mark.parametrize("name", ALL_GOOD_VALUES)
def test_values_files_pass_the_schema(name: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(load_values_file(name))


def test_typo_values_fail_the_schema() -> None:
    values = load_values_file("typo")
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmValuesError) as schema_error:
            chart.validate_schema(values)
    message = str(schema_error.value)
    assert "kubletPath" in message and "reclaimPolicyy" in message
    # An install would refuse it too: rendering validates against the schema first,
    with pytest.raises(helm.HelmValuesError):
        render_chart(values)
    # and lint reports it as an error.
    report = helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    assert any("kubletPath" in e for e in report["errors"])


@pytest.mark.parametrize(
    "bad",
    [
        {"logLevel": "verbose"},
        {"s3": {"region": "eu west 1"}},
        {"s3": {"endpointUrl": "minio:9000"}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"node": {"kubeletPath": "relative/path"}},
        {"node": {"healthPort": 70000}},
        {"storageClasses": [{"name": "x"}]},  # no bucket
        {"storageClasses": [{"name": "x", "bucket": "b-1", "reclaimPolicy": "Recycle"}]},
        {"storageClasses": [{"name": "x", "bucket": "b-1", "volumeBindingMode": "Later"}]},
        {"storageClasses": [{"name": "x", "bucket": "b-1", "forcePathStyle": "yes"}]},
        {"storageClasses": [{"name": "x", "bucket": "b-1", "secretRef": {"namespace": "n"}}]},
        {"storageClasses": [{"name": "Not_A_Name", "bucket": "b-1"}]},
        {"awsCredentials": {"create": True}},  # keys missing
        {"serviceAccount": {"node": {"annotation": {}}}},
        {"sidecars": {"provisioner": {"image": {"tags": "v1"}}}},
        {"controller": {"resources": {"request": {"cpu": "1"}}}},
        {"node": {"tolerations": [{"operator": "Exists", "effects": "NoSchedule"}]}},
        {"metrics": {"enabled": True, "port": "9809"}},
        {"metrics": {"enabled": "true"}},
        {"metrics": {"port": 0}},
        {"metrics": {"port": 65536}},
        {"metrics": {"scrapeAnnotations": "yes"}},
        {"metrics": {"prot": 9809}},
        {"dashboard": {"enabled": "true"}},
        {"dashboard": {"enable": True}},
        {"dashboard": {"namespace": "Monitoring"}},
        {"dashboard": {"labels": {"grafana_dashboard": 1}}},
        {"dashboard": {"labels": ["grafana_dashboard"]}},
        {"dashboard": {"annotations": {"grafana_folder": True}}},
        {"mounter": {"mode": "bogus"}},
        {"mounter": {"mode": "Pod"}},
        {"mounter": {"mode": None}},
        {"mounter": {"image": {"pullPolicy": "Sometimes"}}},
        {"mounter": {"image": {"name": "s3csi"}}},
        {"mounter": {"serviceAccount": {"annotation": {}}}},
        {"mounter": {"serviceAccount": {"name": "Not_A_Name"}}},
        {"mounter": {"serviceAccount": {"annotations": {"a": 1}}}},
        {"mounter": {"priorityClassName": "System Node Critical"}},
        {"mounter": {"resources": {"limits": {"memory": "1 Gi"}}}},
        {"mounter": {"resources": {"limit": {"memory": "1Gi"}}}},
        {"mounter": {"terminationGracePeriodSeconds": -1}},
        {"mounter": {"terminationGracePeriodSeconds": "30"}},
        {"mounter": {"gracePeriod": 30}},
        {"mounter": {"hostNetwork": "true"}},
        {"mounter": {"hostNetwork": 1}},
        {"mounter": {"hostnetwork": True}},
        {"controller": {"enabled": "false"}},
        {"controller": {"enabled": None}},
        {"controller": {"enable": False}},
        {"cache": {"size": "lots"}},
        {"cache": {"size": 20}},
        {"cache": {"keep": "yes"}},
        {"cache": {"sise": "1GiB"}},
        {"cache": {"keptMaxIdle": "a week"}},
        {"cache": {"keptMaxIdle": 7}},
        {"storageClasses": [{"name": "x", "bucket": "b-1", "cacheSize": "1 TB"}]},
        {"storageClasses": [{"name": "x", "bucket": "b-1", "keepCache": "true"}]},
    ],
    ids=lambda b: json.dumps(b, sort_keys=True),
)
def test_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)


def _object_schemas(schema: Any, path: str = "$"):
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            yield path, schema
        for key, sub in schema.items():
            yield from _object_schemas(sub, f"{path}.{key}")
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _object_schemas(sub, f"{path}[{i}]")


def test_schema_rejects_unknown_keys_everywhere() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    for path, obj in _object_schemas(schema):
        if path == "$.properties.global":
            continue  # Helm's own `global` values, shared with parent charts
        if path.endswith(".if") or path.endswith(".then"):
            continue  # conditional constraints, not value shapes
        # Maps with free keys (annotations, nodeSelector, resource quantities) constrain their
        # values instead; every other object closes its key set.
        assert "additionalProperties" in obj, f"{path} accepts unknown keys"
        if "properties" in obj:
            assert obj["additionalProperties"] is False, f"{path} accepts unknown keys"


def test_every_values_key_is_commented() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    key_line = re.compile(r"^(\s*)([A-Za-z][\w.-]*):(\s|$)")
    uncommented = []
    for i, line in enumerate(lines):
        match = key_line.match(line)
        if not match:
            continue
        previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
        if "#" not in line and not previous.lstrip().startswith("#"):
            uncommented.append(f"values.yaml:{i + 1}: {line.strip()}")
    assert uncommented == []


def test_every_schema_key_appears_in_values_yaml(chart_values: dict[str, Any]) -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())

    def walk(node: dict[str, Any], values: Any, path: str) -> None:
        for key, sub in node.get("properties", {}).items():
            if path == "" and key == "global":
                continue
            assert isinstance(values, dict) and key in values, f"{path}.{key} not in values.yaml"
            if sub.get("type") == "object" and "properties" in sub and key != "resources":
                walk(sub, values[key], f"{path}.{key}")

    walk(schema, chart_values, "")


def test_chart_metadata() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert (meta["name"], meta["version"], meta["appVersion"]) == ("s3csi", "0.1.0", "0.1.0")
    cargo = (REPO / "Cargo.toml").read_text()
    cargo_version = re.search(r'^version\s*=\s*"([^"]+)"', cargo, re.MULTILINE)
    if cargo_version:
        assert meta["appVersion"] == cargo_version.group(1), "appVersion != Cargo.toml version"


# --- Kubernetes schemas ------------------------------------------------------------------------


def test_kube_versions_have_schemas() -> None:
    """Every release the tests render for is checked against its own schemas (not silently
    against the nearest older one), the oldest one from the vendored file."""
    assert set(KUBE_VERSIONS) <= set(schema_versions())
    assert OLDEST_KUBE not in {
        kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()
    }, "kubernetes-validate bundles 1.20 again: drop kube-schemas/v1.20.json"
    assert (REPO / "tests" / "chart" / "kube-schemas" / f"v{OLDEST_KUBE}.json").exists()


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", ALL_GOOD_VALUES)
def test_rendered_objects_are_valid_kubernetes(name: str, kube_version: str) -> None:
    """Rendered for `kube_version` (.Capabilities.KubeVersion) and validated against that
    release's strict schemas: no field a release does not know, for every values file."""
    objects = render_objects(load_values_file(name), kube_version=f"v{kube_version}.0")
    assert objects, f"{name}: nothing rendered"
    for obj in objects:
        try:
            validate_object(obj, kube_version)
        except jsonschema.ValidationError as error:
            where = "/".join(str(p) for p in error.absolute_path)
            pytest.fail(f"{name} on {kube_version}: {obj['kind']}/{obj['metadata']['name']} "
                        f"at {where}: {error.message}")


def test_schema_validation_refuses_fields_a_release_does_not_know() -> None:
    """The vendored 1.20 schemas are strict: a field added after 1.20 is refused there and
    accepted by a release that has it (so the 1.20 run above means something)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"hostUsers": False, "containers": [{"name": "c", "image": "i"}]}}
    validate_object(pod, "1.30")  # spec.hostUsers: 1.25+
    with pytest.raises(jsonschema.ValidationError, match="hostUsers"):
        validate_object(pod, "1.20")
    pod["spec"].pop("hostUsers")
    validate_object(pod, "1.20")
    pod["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate_object(pod, "1.20")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_are_valid_kubernetes(example: str, kube_version: str) -> None:
    for obj in load_yaml_objects(EXAMPLES_DIR / example):
        try:
            validate_object(obj, kube_version)
        except jsonschema.ValidationError as error:
            where = "/".join(str(p) for p in error.absolute_path)
            pytest.fail(f"{example}: {obj['kind']}/{obj['metadata']['name']} at {where}: {error.message}")


def test_examples_exist() -> None:
    assert {"dynamic.yaml", "static.yaml", "s3-compatible.yaml"} <= set(EXAMPLES)


# --- Wiring ----------------------------------------------------------------------------------


def test_driver_name_agrees_everywhere(case) -> None:
    _, _, objects = case
    driver = one(objects, "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME
    for pod in (node_pod(objects), controller_pod(objects)):
        assert flag(container(pod, "s3csi")["args"], "driver-name") == DRIVER_NAME
    for sc in find(objects, "StorageClass"):
        assert sc["provisioner"] == DRIVER_NAME


def test_csidriver_spec(case) -> None:
    """A current Kubernetes (the SDK's default .Capabilities.KubeVersion)."""
    _, _, objects = case
    spec = one(objects, "CSIDriver")["spec"]
    assert spec == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "fsGroupPolicy": "File",
        "tokenRequests": [
            {"audience": "sts.amazonaws.com", "expirationSeconds": 3600},
            {"audience": "pods.eks.amazonaws.com", "expirationSeconds": 3600},
        ],
        "requiresRepublish": True,
        "volumeLifecycleModes": ["Persistent"],
    }


def test_pod_credentials_can_be_turned_off_and_grant_only_get_on_serviceaccounts() -> None:
    on = render_objects({})
    role = one(
        [o for o in find(on, "ClusterRole") if o["metadata"]["name"].endswith("-pod-credentials")],
        "ClusterRole",
    )
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get"]}
    ]
    binding = [
        b
        for b in find(on, "ClusterRoleBinding")
        if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert len(binding) == 1
    node_sa = node_pod(on)["serviceAccountName"]
    assert binding[0]["subjects"] == [
        {"kind": "ServiceAccount", "name": node_sa, "namespace": binding[0]["subjects"][0]["namespace"]}
    ]
    off = render_objects({"podCredentials": {"enabled": False}})
    spec = one(off, "CSIDriver")["spec"]
    assert "tokenRequests" not in spec and spec["requiresRepublish"] is False
    spec = one(render_objects({"podCredentials": {"enabled": False}}, kube_version="v1.20.2"),
               "CSIDriver")["spec"]
    assert "tokenRequests" not in spec and "requiresRepublish" not in spec
    assert not [
        o for o in find(off, "ClusterRole") if o["metadata"]["name"].endswith("-pod-credentials")
    ]
    custom = render_objects(
        {"podCredentials": {"audiences": ["sts.example.com"], "expirationSeconds": 900}}
    )
    assert one(custom, "CSIDriver")["spec"]["tokenRequests"] == [
        {"audience": "sts.example.com", "expirationSeconds": 900}
    ]


def test_storage_classes_pass_the_authentication_source_on() -> None:
    objects = render_objects(
        {
            "storageClasses": [
                {
                    "name": "tenant",
                    "bucket": "bucket-b",
                    "authenticationSource": "pod",
                    "stsEndpointUrl": "https://sts.example.com",
                },
                {"name": "shared", "bucket": "bucket-b"},
            ]
        }
    )
    by_name = {sc["metadata"]["name"]: sc for sc in find(objects, "StorageClass")}
    assert by_name["tenant"]["parameters"]["authenticationSource"] == "pod"
    assert by_name["tenant"]["parameters"]["stsEndpointUrl"] == "https://sts.example.com"
    assert "authenticationSource" not in by_name["shared"]["parameters"]
    with pytest.raises(helm.HelmError, match=r"authenticationSource pod takes each pod's own"):
        render_chart({"storageClasses": [{"name": "t", "bucket": "bucket-b",
                                          "authenticationSource": "pod",
                                          "secretRef": {"name": "keys"}}]})


@pytest.mark.parametrize(
    "kube_version, fs_group_policy, requires_republish",
    [
        # 1.20: no fsGroup delegation to CSI drivers, so "File" would make the kubelet chown
        # every object; requiresRepublish and tokenRequests are alpha fields there
        # (CSIServiceAccountToken), dropped by an API server without the gate.
        ("v1.20.2", "None", True),
        ("v1.20.0", "None", True),
        ("v1.20.15-eks-1234abc", "None", True),  # vendor builds: pre-release semver
        ("v1.21.0", "None", True),
        ("v1.25.16", "None", True),
        # 1.26: DelegateFSGroupToCSIDriver is GA, the kubelet passes fsGroup to the driver.
        ("v1.26.0", "File", True),
        ("v1.26.0-gke.100", "File", True),
        ("v1.37.0", "File", True),
    ],
)
def test_csidriver_spec_follows_the_kubernetes_version(
    kube_version: str, fs_group_policy: str, requires_republish: bool | None
) -> None:
    spec = one(render_objects({}, kube_version=kube_version), "CSIDriver")["spec"]
    assert spec["fsGroupPolicy"] == fs_group_policy
    assert spec.get("requiresRepublish") == requires_republish
    assert spec["attachRequired"] is False and spec["podInfoOnMount"] is True
    assert spec["volumeLifecycleModes"] == ["Persistent"]


def test_only_the_csidriver_depends_on_the_kubernetes_version(case) -> None:
    """Everything but the CSIDriver renders the same for 1.20 and for a current release."""
    name, values, objects = case
    old = render_objects(values, kube_version="v1.20.2")
    strip = [o for o in objects if o["kind"] != "CSIDriver"]
    assert [o for o in old if o["kind"] != "CSIDriver"] == strip, name


def _semver_admits(constraint: str, version: str, tmp_path) -> bool:
    """Helm's own semverCompare (the library that checks Chart.yaml's kubeVersion)."""
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True, exist_ok=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "probe.yaml").write_text(
        "admitted: {{ semverCompare .Values.constraint .Capabilities.KubeVersion.Version }}\n")
    import helm_python._native as native  # noqa: PLC0415 (render with a kube version)
    with helm.Chart.load(chart) as c:
        out = json.loads(native.call_string(
            "helm_render", c._raw(), json.dumps({"constraint": constraint}),
            json.dumps({"kube_version": version})))
    return yaml.safe_load(out["probe/templates/probe.yaml"])["admitted"]


def test_chart_kube_version_admits_1_20_and_current_releases(tmp_path) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        constraint = chart.metadata["kubeVersion"]
    assert constraint == ">=1.20.0-0"
    for version in ("v1.20.0", "v1.20.2", "v1.20.15-eks-1234abc", "v1.26.0",
                    f"v{NEWEST_KUBE}.0"):
        assert _semver_admits(constraint, version, tmp_path), version
    for version in ("v1.19.16", "v1.19.0-eks-1"):
        assert not _semver_admits(constraint, version, tmp_path), version
    # The tests render for the oldest admitted release.
    assert constraint.startswith(f">={OLDEST_KUBE}.0")


def test_node_plugin_command_line(case) -> None:
    _, values, objects = case
    pod = node_pod(objects)
    s3csi = container(pod, "s3csi")
    args = s3csi["args"]
    assert args[0] == "csi"
    assert flag(args, "mode") == "node"
    assert flag(args, "node-id") == "$(NODE_NAME)"
    env = {e["name"]: e for e in s3csi["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert flag(args, "log-level") == merged(values)["logLevel"]
    assert flag(args, "kept-cache-max-idle") == merged(values)["cache"]["keptMaxIdle"]
    for extra in merged(values)["node"]["extraArgs"]:
        assert extra in args


def test_node_socket_paths_agree(case) -> None:
    _, values, objects = case
    kubelet = merged(values)["node"]["kubeletPath"].rstrip("/")
    pod = node_pod(objects)
    s3csi = container(pod, "s3csi")
    registrar = container(pod, "node-driver-registrar")
    probe = container(pod, "liveness-probe")

    # The plugin's socket, as the plugin, the registrar and the probe see it (in /csi) ...
    plugin_dir_in_pod = mount_of(s3csi, "plugin-dir")["mountPath"]
    endpoint_socket = socket_path(flag(s3csi["args"], "endpoint"))
    assert endpoint_socket == plugin_dir_in_pod.rstrip("/") + "/csi.sock"
    for sidecar in (registrar, probe):
        assert mount_of(sidecar, "plugin-dir")["mountPath"] == plugin_dir_in_pod
        assert flag(sidecar["args"], "csi-address") == endpoint_socket

    # ... and as the kubelet sees it on the host: the registration path.
    host_dir = host_path(pod, "plugin-dir").rstrip("/")
    assert host_dir == f"{kubelet}/plugins/{DRIVER_NAME}"
    registration_path = flag(registrar["args"], "kubelet-registration-path")
    assert registration_path == host_dir + "/csi.sock"
    assert registration_path in registrar["livenessProbe"]["exec"]["command"][1]

    # The registrar's registration socket goes to the kubelet's plugin registry.
    assert host_path(pod, "registration-dir").rstrip("/") == f"{kubelet}/plugins_registry"
    assert mount_of(registrar, "registration-dir")["mountPath"] == "/registration"


def test_node_kubelet_dir_is_bidirectional_and_privileged(case) -> None:
    _, values, objects = case
    kubelet = merged(values)["node"]["kubeletPath"].rstrip("/")
    pod = node_pod(objects)
    s3csi = container(pod, "s3csi")
    assert host_path(pod, "kubelet-dir") == kubelet
    mount = mount_of(s3csi, "kubelet-dir")
    assert mount["mountPath"] == kubelet, "pod volume paths must be identical inside and out"
    assert mount["mountPropagation"] == "Bidirectional"
    # Bidirectional propagation is only allowed for privileged containers; only s3csi is.
    assert s3csi["securityContext"]["privileged"] is True
    for c in pod["containers"]:
        if c["name"] != "s3csi":
            assert not c.get("securityContext", {}).get("privileged", False), c["name"]
            for m in c.get("volumeMounts", []):
                assert m.get("mountPropagation", "None") == "None", c["name"]


def test_node_devices_and_state(case) -> None:
    _, _, objects = case
    pod = node_pod(objects)
    s3csi = container(pod, "s3csi")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["fuse-device"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mount_of(s3csi, "fuse-device")["mountPath"] == "/dev/fuse"
    # Mounter Pods mount their handoff directory (under the state dir) by its host path, so
    # the state dir is a hostPath at the same path on the host and in the container.
    assert volumes["state-dir"]["hostPath"] == {"path": "/var/lib/s3csi", "type": "DirectoryOrCreate"}
    assert mount_of(s3csi, "state-dir")["mountPath"] == "/var/lib/s3csi"
    assert flag(s3csi["args"], "state-dir") == "/var/lib/s3csi"
    # Shared mounts live under the kubelet directory, mounted Bidirectional: they reach the
    # host, so a restarted node plugin (a new mount namespace) still finds them.
    shared = flag(s3csi["args"], "shared-mounts-dir")
    kubelet = mount_of(s3csi, "kubelet-dir")
    assert kubelet["mountPropagation"] == "Bidirectional"
    assert shared.startswith(kubelet["mountPath"] + "/plugins/"), shared


def test_node_scheduling(case) -> None:
    _, values, objects = case
    pod = node_pod(objects)
    node_values = merged(values)["node"]
    assert pod["priorityClassName"] == node_values["priorityClassName"]
    assert pod.get("tolerations", []) == node_values["tolerations"]
    assert pod.get("nodeSelector", {}) == node_values["nodeSelector"]
    assert pod.get("hostNetwork", False) == node_values["hostNetwork"]


def test_defaults_run_everywhere_with_critical_priority() -> None:
    objects = render_objects({})
    assert node_pod(objects)["tolerations"] == [{"operator": "Exists"}]
    assert node_pod(objects)["priorityClassName"] == "system-node-critical"
    assert controller_pod(objects)["priorityClassName"] == "system-cluster-critical"


def test_health_ports_agree(case) -> None:
    """The livenessprobe sidecar listens where the kubelet's probe of the s3csi container
    looks: on the host's network (node.hostNetwork) 127.0.0.1 only, probed at 127.0.0.1 (the
    httpGet host would default to the pod IP, the node's address there); in a pod network
    namespace every interface of it, probed at the pod IP. --http-endpoint, never the
    deprecated --health-port."""
    _, values, objects = case
    m = merged(values)
    for pod, port in ((node_pod(objects), m["node"]["healthPort"]),
                      (controller_pod(objects), m["controller"]["healthPort"])):
        probe = container(pod, "liveness-probe")
        assert not any(a.startswith("--health-port") for a in probe["args"])
        assert flag(probe["args"], "csi-address") == "/csi/csi.sock"
        s3csi = container(pod, "s3csi")
        ports = {p["name"]: p["containerPort"] for p in s3csi["ports"]}
        assert ports["healthz"] == port
        if pod.get("hostNetwork", False):
            assert flag(probe["args"], "http-endpoint") == f"127.0.0.1:{port}"
            assert s3csi["livenessProbe"]["httpGet"] == {
                "host": "127.0.0.1", "path": "/healthz", "port": "healthz"}
        else:
            assert flag(probe["args"], "http-endpoint") == f":{port}"
            assert s3csi["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # The controller never runs on the host's network.
    assert "hostNetwork" not in controller_pod(objects)


@pytest.mark.parametrize("host_network", [True, False])
def test_node_liveness_endpoint_follows_host_network(host_network: bool) -> None:
    values = {"node": {"hostNetwork": host_network, "healthPort": 9900}}
    pod = node_pod(render_objects(values))
    probe_args = container(pod, "liveness-probe")["args"]
    http_get = container(pod, "s3csi")["livenessProbe"]["httpGet"]
    if host_network:
        assert "--http-endpoint=127.0.0.1:9900" in probe_args
        assert http_get["host"] == "127.0.0.1"
    else:
        assert "--http-endpoint=:9900" in probe_args
        assert "host" not in http_get
    assert http_get["port"] == "healthz"


def test_metrics_wiring(case) -> None:
    _, values, objects = case
    m = merged(values)["metrics"]
    for pod, template in ((node_pod(objects), one(objects, "DaemonSet")),
                          (controller_pod(objects), one(objects, "Deployment"))):
        s3csi = container(pod, "s3csi")
        ports = {p["name"]: p for p in s3csi["ports"]}
        annotations = template["spec"]["template"]["metadata"].get("annotations", {})
        address_flags = [a for a in s3csi["args"] if a.startswith("--metrics-address")]
        if not m["enabled"]:
            assert address_flags == []
            assert "metrics" not in ports
            assert not any(k.startswith("prometheus.io/") for k in annotations)
            continue
        # Every interface of the pod, on the configured port, declared as a named port.
        assert address_flags == [f"--metrics-address=:{m['port']}"]
        assert ports["metrics"] == {"name": "metrics", "containerPort": m["port"],
                                    "protocol": "TCP"}
        assert m["port"] != ports["healthz"]["containerPort"]
        # No sidecar claims the port.
        for c in pod["containers"]:
            if c["name"] != "s3csi":
                assert all(p.get("containerPort") != m["port"] for p in c.get("ports", []))
        if m.get("scrapeAnnotations"):
            assert annotations == {"prometheus.io/scrape": "true",
                                   "prometheus.io/port": str(m["port"]),
                                   "prometheus.io/path": "/metrics"}
        else:
            assert annotations == {}


def test_metrics_are_off_by_default(chart_values: dict[str, Any]) -> None:
    assert chart_values["metrics"] == {"enabled": False, "port": 9809, "scrapeAnnotations": False}
    objects = render_objects({})
    for pod in (node_pod(objects), controller_pod(objects)):
        s3csi = container(pod, "s3csi")
        assert not any("metrics" in a for a in s3csi["args"])
        assert [p["name"] for p in s3csi["ports"]] == ["healthz"]


def test_metrics_enabled_with_the_default_port() -> None:
    objects = render_objects({"metrics": {"enabled": True}})
    for pod in (node_pod(objects), controller_pod(objects)):
        s3csi = container(pod, "s3csi")
        assert flag(s3csi["args"], "metrics-address") == ":9809"
        assert {"name": "metrics", "containerPort": 9809, "protocol": "TCP"} in s3csi["ports"]
    # Annotations only when asked for.
    assert "annotations" not in one(objects, "DaemonSet")["spec"]["template"]["metadata"]
    notes = render_chart({"metrics": {"enabled": True}})["s3csi/templates/NOTES.txt"]
    assert "/metrics on port 9809" in notes


@pytest.mark.parametrize("component", ["node", "controller"])
def test_metrics_port_must_not_be_the_health_port(component: str) -> None:
    values = {"metrics": {"enabled": True, "port": 9900}, component: {"healthPort": 9900}}
    with pytest.raises(helm.HelmError, match="healthPort"):
        render_chart(values)
    # Disabled metrics do not care.
    render_chart({"metrics": {"port": 9900}, component: {"healthPort": 9900}})


# --- Mounters (mounter.mode) -------------------------------------------------------------------

NODE_SERVICE_ROLE_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get", "list", "delete"]},
    # The Events about a mounter Pod that does not start, listed by field selector.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
]
NODE_SERVICE_CLUSTER_ROLE_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]


def mounter_flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--mounter")]


def test_mounter_defaults(chart_values: dict[str, Any]) -> None:
    assert chart_values["mounter"] == {
        "mode": "pod",
        "image": {"repository": "", "tag": "", "pullPolicy": ""},
        "serviceAccount": {"create": True, "name": "", "annotations": {}},
        "priorityClassName": "system-node-critical",
        "resources": {
            "requests": {"cpu": "10m", "memory": "64Mi"},
            # The default max-prefetch-memory (512MiB) plus upload buffers and overhead.
            "limits": {"memory": "1Gi"},
        },
        "terminationGracePeriodSeconds": 30,
        # null: follow node.hostNetwork.
        "hostNetwork": None,
    }


def test_default_render_runs_mounters_as_pods() -> None:
    objects = render_objects({})
    s3csi = container(node_pod(objects), "s3csi")
    args = s3csi["args"]
    assert flag(args, "mounter") == "pod"
    # By default the mounters run the node plugin's own image.
    assert flag(args, "mounter-image") == s3csi["image"] == "ghcr.io/s3csi/s3csi:0.1.0"
    assert flag(args, "mounter-image-pull-policy") == s3csi["imagePullPolicy"]
    assert flag(args, "mounter-namespace") == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in s3csi["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert flag(args, "mounter-service-account") == "s3csi-mounter"
    assert flag(args, "mounter-priority-class") == "system-node-critical"
    assert json.loads(flag(args, "mounter-resources")) == {
        "requests": {"cpu": "10m", "memory": "64Mi"},
        "limits": {"memory": "1Gi"},
    }
    assert flag(args, "mounter-grace-seconds") == "30"
    assert not flag_present(args, "mounter-host-network")

    role = one(objects, "Role", "s3csi-mounters")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == NODE_SERVICE_ROLE_RULES
    cluster_role = one(objects, "ClusterRole", "s3csi-node")
    assert cluster_role["rules"] == NODE_SERVICE_CLUSTER_ROLE_RULES
    node_sa = {"kind": "ServiceAccount", "name": "s3csi-node", "namespace": NAMESPACE}
    assert node_pod(objects)["serviceAccountName"] == "s3csi-node"
    binding = one(objects, "RoleBinding", "s3csi-mounters")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["subjects"] == [node_sa]
    assert binding["roleRef"] == {
        "kind": "Role", "name": "s3csi-mounters", "apiGroup": "rbac.authorization.k8s.io"}
    cluster_binding = one(objects, "ClusterRoleBinding", "s3csi-node")
    assert cluster_binding["subjects"] == [node_sa]
    assert cluster_binding["roleRef"] == {
        "kind": "ClusterRole", "name": "s3csi-node", "apiGroup": "rbac.authorization.k8s.io"}


def test_mounter_command_line(case) -> None:
    name, values, objects = case
    m = merged(values)
    s3csi = container(node_pod(objects), "s3csi")
    args = s3csi["args"]
    env = {e["name"]: e for e in s3csi["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    if not pod_mode(values):
        assert mounter_flags(args) == ["--mounter=process"], name
        return
    mounter = m["mounter"]
    assert mounter_flags(args)[0] == "--mounter=pod"
    assert len([a for a in args if a.startswith("--mounter=")]) == 1
    repository = mounter["image"]["repository"] or m["image"]["repository"]
    tag = mounter["image"]["tag"] or m["image"]["tag"] or "0.1.0"
    assert flag(args, "mounter-image") == f"{repository}:{tag}"
    if not mounter["image"]["repository"] and not mounter["image"]["tag"]:
        assert flag(args, "mounter-image") == s3csi["image"]
    assert flag(args, "mounter-image-pull-policy") == (
        mounter["image"]["pullPolicy"] or m["image"]["pullPolicy"])
    # The binary the mounter Pods run is the image's entrypoint.
    entrypoint = re.search(r'^ENTRYPOINT \["([^"]+)"\]', (REPO / "Containerfile").read_text(), re.M)
    assert flag(args, "mounter-command") == entrypoint.group(1)
    assert flag(args, "mounter-namespace") == "$(POD_NAMESPACE)"
    fullname = one(objects, "DaemonSet")["metadata"]["name"].removesuffix("-node")
    sa = mounter["serviceAccount"]["name"] or f"{fullname}-mounter"
    assert flag(args, "mounter-service-account") == sa
    if mounter["priorityClassName"]:
        assert flag(args, "mounter-priority-class") == mounter["priorityClassName"]
    else:
        assert not any(a.startswith("--mounter-priority-class") for a in args)
    assert flag(args, "mounter-grace-seconds") == str(mounter["terminationGracePeriodSeconds"])
    host_network = mounter.get("hostNetwork")  # null (Helm drops it): node.hostNetwork
    if host_network is None:
        host_network = m["node"]["hostNetwork"]
    assert flag_present(args, "mounter-host-network") == host_network, name
    resources = json.loads(flag(args, "mounter-resources"))
    # Quantities are JSON strings (what k8s-openapi's Quantity parses), numbers included.
    expected = {
        section: {k: v if isinstance(v, str) else f"{v:g}" for k, v in quantities.items()}
        for section, quantities in mounter["resources"].items()
    }
    assert resources == expected


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_mounter_resources_are_valid_resource_requirements(case, kube_version: str) -> None:
    """--mounter-resources is opaque to the schemas: validate it as a Pod's container resources."""
    name, values, objects = case
    if not pod_mode(values):
        return
    args = container(node_pod(objects), "s3csi")["args"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "s3csi-mounter-x-1", "namespace": NAMESPACE},
        "spec": {
            "containers": [{
                "name": "mounter",
                "image": flag(args, "mounter-image"),
                "imagePullPolicy": flag(args, "mounter-image-pull-policy"),
                "resources": json.loads(flag(args, "mounter-resources")),
            }],
        },
    }
    if flag_present(args, "mounter-host-network"):
        pod["spec"]["hostNetwork"] = True
        pod["spec"]["dnsPolicy"] = "ClusterFirstWithHostNet"
    try:
        validate_object(pod, kube_version)
    except jsonschema.ValidationError as error:
        pytest.fail(f"{name}: mounter pod: {error.message}")


def test_node_service_rbac_only_in_pod_mode(case) -> None:
    name, values, objects = case
    node_sa = node_pod(objects)["serviceAccountName"]
    rbac_kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    # The pod-credentials grant (get serviceaccounts) is in every mode; see its own test.
    node_rbac = [
        o for o in objects
        if o["kind"] in rbac_kinds
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "node"
        and not o["metadata"]["name"].endswith("-pod-credentials")
    ]
    if not pod_mode(values):
        assert node_rbac == [], name
        return
    assert sorted(o["kind"] for o in node_rbac) == sorted(rbac_kinds)
    role = named(objects, "Role", "mounters")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == NODE_SERVICE_ROLE_RULES
    assert named(objects, "ClusterRole", "node")["rules"] == NODE_SERVICE_CLUSTER_ROLE_RULES
    for kind, suffix, ref_kind in (("RoleBinding", "mounters", "Role"),
                                   ("ClusterRoleBinding", "node", "ClusterRole")):
        binding = named(objects, kind, suffix)
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": node_sa, "namespace": NAMESPACE}]
        assert binding["roleRef"]["kind"] == ref_kind
        assert binding["roleRef"]["name"] == named(objects, ref_kind, suffix)["metadata"]["name"]


def test_mounter_service_account(case) -> None:
    name, values, objects = case
    m = merged(values)
    mounters = [sa for sa in find(objects, "ServiceAccount")
                if sa["metadata"]["labels"]["app.kubernetes.io/component"] == "mounter"]
    if not pod_mode(values) or not m["mounter"]["serviceAccount"]["create"]:
        assert mounters == [], name
        return
    assert len(mounters) == 1
    sa = mounters[0]
    args = container(node_pod(objects), "s3csi")["args"]
    assert sa["metadata"]["name"] == flag(args, "mounter-service-account")
    assert sa["metadata"]["namespace"] == NAMESPACE
    assert sa["metadata"].get("annotations", {}) == m["mounter"]["serviceAccount"]["annotations"]
    assert sa["automountServiceAccountToken"] is False
    # Mounter Pods name no imagePullSecrets of their own: they get the account's.
    assert sa.get("imagePullSecrets", []) == m["imagePullSecrets"]
    assert sa["metadata"]["name"] not in (node_pod(objects)["serviceAccountName"],
                                          controller_pod(objects)["serviceAccountName"])


def test_irsa_role_for_the_buckets_is_on_the_mounter_service_account() -> None:
    values = load_values_file("irsa")
    objects = render_objects(values)
    sa = one(objects, "ServiceAccount", "s3csi-mounter")
    assert sa["metadata"]["annotations"] == {
        ROLE_ARN: "arn:aws:iam::111122223333:role/s3csi-mounter"}
    args = container(node_pod(objects), "s3csi")["args"]
    assert flag(args, "mounter-service-account") == "s3csi-mounter"
    # The mounters run the driver's ECR image, pulled with the same secret.
    assert flag(args, "mounter-image") == "111122223333.dkr.ecr.eu-west-1.amazonaws.com/s3csi:0.1.0-rc1"
    assert sa["imagePullSecrets"] == [{"name": "ecr-pull"}]


def test_process_mode_renders_no_mounter_objects() -> None:
    values = load_values_file("process-mode")
    objects = render_objects(values)
    args = container(node_pod(objects), "s3csi")["args"]
    assert "--mounter=process" in args
    assert mounter_flags(args) == ["--mounter=process"]
    assert find(objects, "Role", "s3csi-mounters") == []
    assert find(objects, "RoleBinding", "s3csi-mounters") == []
    assert find(objects, "ClusterRole", "s3csi-node") == []
    assert find(objects, "ClusterRoleBinding", "s3csi-node") == []
    assert find(objects, "ServiceAccount", "s3csi-mounter") == []
    # The only RBAC left is the provisioner's, and the node's read of ServiceAccounts.
    assert {o["metadata"]["name"] for o in find(objects, "ClusterRole")} == {
        "s3csi-provisioner", "s3csi-pod-credentials"}
    notes = render_chart(values)["s3csi/templates/NOTES.txt"]
    assert "mounter.mode: process" in notes and "WARNING" not in notes


@pytest.mark.parametrize(
    "node_host_network, mounter_host_network, expected",
    [
        (False, None, False),  # the defaults
        (True, None, True),  # null follows node.hostNetwork
        (True, False, False),
        (False, True, True),
        (True, True, True),
        (False, False, False),
    ],
)
def test_mounter_host_network(
    node_host_network: bool, mounter_host_network: bool | None, expected: bool
) -> None:
    values: dict[str, Any] = {"node": {"hostNetwork": node_host_network}}
    if mounter_host_network is not None:
        values["mounter"] = {"hostNetwork": mounter_host_network}
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values)
    args = container(node_pod(render_objects(values)), "s3csi")["args"]
    assert flag_present(args, "mounter-host-network") == expected
    assert [a for a in args if a.startswith("--mounter-host-network")] == (
        ["--mounter-host-network"] if expected else [])
    notes = render_chart(values)["s3csi/templates/NOTES.txt"]
    assert ("They run on the host's network" in notes) == expected
    # The node plugin's own hostNetwork is node.hostNetwork alone.
    assert node_pod(render_objects(values)).get("hostNetwork", False) == node_host_network


def test_mounter_host_network_is_pod_mode_only() -> None:
    values = {"mounter": {"mode": "process", "hostNetwork": True}, "node": {"hostNetwork": True}}
    args = container(node_pod(render_objects(values)), "s3csi")["args"]
    assert mounter_flags(args) == ["--mounter=process"]
    # An explicit null (what `--set mounter.hostNetwork=null` gives) follows node.hostNetwork.
    values = {"mounter": {"hostNetwork": None}, "node": {"hostNetwork": True}}
    assert flag_present(container(node_pod(render_objects(values)), "s3csi")["args"],
                        "mounter-host-network")


def test_mounter_host_network_flag_exists_in_the_binary() -> None:
    """--mounter-host-network is a switch (clap bool) of `s3csi csi`, and the Pod it makes
    asks for the host's network with ClusterFirstWithHostNet DNS."""
    src = (REPO / "src" / "mounter" / "pod.rs").read_text()
    assert re.search(r"#\[arg\(long\)\]\s*pub mounter_host_network: bool,", src)
    assert 'spec["hostNetwork"] = json!(true);' in src
    assert 'spec["dnsPolicy"] = json!("ClusterFirstWithHostNet");' in src


def test_mounter_image_fields_fall_back_one_by_one() -> None:
    def image(values: dict[str, Any]) -> tuple[str, str]:
        args = container(node_pod(render_objects(values)), "s3csi")["args"]
        return flag(args, "mounter-image"), flag(args, "mounter-image-pull-policy")

    assert image({"image": {"tag": "v9"}}) == ("ghcr.io/s3csi/s3csi:v9", "IfNotPresent")
    assert image({"mounter": {"image": {"tag": "v8"}}}) == ("ghcr.io/s3csi/s3csi:v8", "IfNotPresent")
    assert image({"mounter": {"image": {"repository": "r.io/m"}}}) == ("r.io/m:0.1.0", "IfNotPresent")
    assert image({"image": {"pullPolicy": "Always"}}) == ("ghcr.io/s3csi/s3csi:0.1.0", "Always")
    assert image({"image": {"pullPolicy": "Always"},
                  "mounter": {"image": {"pullPolicy": "Never"}}}) == ("ghcr.io/s3csi/s3csi:0.1.0", "Never")


def test_default_region_and_endpoint_reach_the_mounters(case) -> None:
    """Mounter Pods do not inherit the node container's AWS_* variables: the node service's own
    defaults (S3CSI_REGION, S3CSI_ENDPOINT_URL) travel to them as mount options."""
    _, values, objects = case
    s3 = merged(values)["s3"]
    env = {e["name"]: e.get("value") for e in container(node_pod(objects), "s3csi")["env"]}
    assert env.get("S3CSI_REGION") == (s3["region"] or None)
    assert env.get("S3CSI_ENDPOINT_URL") == (s3["endpointUrl"] or None)


def test_static_keys_notes_in_pod_mode() -> None:
    values = load_values_file("minio-secret")
    assert pod_mode(values)
    notes = render_chart(values)["s3csi/templates/NOTES.txt"]
    assert "Mounter Pods get them through a per-volume Secret" in notes
    values = {**values, "mounter": {"mode": "process"}}
    assert "per-volume Secret" not in render_chart(values)["s3csi/templates/NOTES.txt"]


def _rust_sources() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "src").rglob("*.rs")))


def test_flags_and_variables_of_the_s3csi_containers_exist_in_the_binary(case) -> None:
    """Every `--flag` the chart passes to `s3csi csi` is a clap field of the binary, and every
    S3CSI_*/POD_NAMESPACE variable one it reads: a renamed flag would crash-loop the pods."""
    _, values, objects = case
    src = _rust_sources()
    m = merged(values)
    extra = set(m["node"]["extraArgs"]) | set(m["controller"]["extraArgs"])
    for pod in (node_pod(objects), controller_pod(objects)):
        s3csi = container(pod, "s3csi")
        assert s3csi["args"][0] == "csi"
        for arg in s3csi["args"][1:]:
            if arg in extra:
                continue
            assert arg.startswith("--"), arg
            name = arg[2:].split("=", 1)[0]
            assert re.search(rf"\bpub {name.replace('-', '_')}:", src), f"s3csi csi has no --{name}"
        for e in s3csi.get("env", []):
            if e["name"].startswith("S3CSI_") or e["name"] == "POD_NAMESPACE":
                assert f'env = "{e["name"]}"' in src, e["name"]


def test_controller_wiring(case) -> None:
    _, values, objects = case
    m = merged(values)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == m["controller"]["replicas"]
    pod = controller_pod(objects)
    s3csi = container(pod, "s3csi")
    provisioner = container(pod, "csi-provisioner")
    args = s3csi["args"]
    assert args[0] == "csi"
    assert flag(args, "mode") == "controller"
    assert flag(args, "node-id") == "controller"
    endpoint_socket = socket_path(flag(args, "endpoint"))
    assert endpoint_socket == mount_of(s3csi, "socket-dir")["mountPath"] + "/csi.sock"
    for sidecar in (provisioner, container(pod, "liveness-probe")):
        assert flag(sidecar["args"], "csi-address") == endpoint_socket
        assert mount_of(sidecar, "socket-dir")["mountPath"] == "/csi"
    assert "--leader-election" in provisioner["args"]
    assert "--extra-create-metadata" in provisioner["args"]
    assert {"name": "socket-dir", "emptyDir": {}} in pod["volumes"]
    for c in pod["containers"]:
        assert not c.get("securityContext", {}).get("privileged", False)


def test_images(case) -> None:
    _, values, objects = case
    m = merged(values)
    tag = m["image"]["tag"] or "0.1.0"
    expected = f"{m['image']['repository']}:{tag}"
    for pod in (node_pod(objects), controller_pod(objects)):
        assert container(pod, "s3csi")["image"] == expected
        assert container(pod, "s3csi")["imagePullPolicy"] == m["image"]["pullPolicy"]
        assert pod.get("imagePullSecrets", []) == m["imagePullSecrets"]
    sidecars = m["sidecars"]
    registrar = container(node_pod(objects), "node-driver-registrar")
    assert registrar["image"].startswith("registry.k8s.io/sig-storage/csi-node-driver-registrar:")
    assert registrar["image"] == "{repository}:{tag}".format(**sidecars["nodeDriverRegistrar"]["image"])
    provisioner = container(controller_pod(objects), "csi-provisioner")
    assert provisioner["image"] == "{repository}:{tag}".format(**sidecars["provisioner"]["image"])


def test_provisioner_rbac(case) -> None:
    _, _, objects = case
    sa = controller_pod(objects)["serviceAccountName"]
    role = named(objects, "ClusterRole", "provisioner")
    rules = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    # kubernetes-csi/external-provisioner deploy/kubernetes/rbac.yaml (minus snapshots and
    # capacity, which s3csi does not support).
    required = {
        ("", "persistentvolumes"): {"get", "list", "watch", "create", "delete", "patch"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch", "update"},
        ("storage.k8s.io", "storageclasses"): {"get", "list", "watch"},
        ("", "events"): {"list", "watch", "create", "update", "patch"},
        ("storage.k8s.io", "csinodes"): {"get", "list", "watch"},
        ("", "nodes"): {"get", "list", "watch"},
        ("storage.k8s.io", "volumeattachments"): {"get", "list", "watch"},
        ("", "secrets"): {"get"},  # provisioner-secret-name of StorageClasses
    }
    for key, verbs in required.items():
        assert verbs <= rules.get(key, set()), f"ClusterRole lacks {key} {verbs}"
    binding = named(objects, "ClusterRoleBinding", "provisioner")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]

    lease_role = named(objects, "Role", "provisioner-leader-election")
    assert lease_role["metadata"]["namespace"] == NAMESPACE
    assert {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "watch", "list", "delete", "update", "create"],
    } in lease_role["rules"]
    role_binding = named(objects, "RoleBinding", "provisioner-leader-election")
    assert role_binding["roleRef"]["name"] == lease_role["metadata"]["name"]
    assert role_binding["subjects"][0]["name"] == sa


def test_pods_use_the_rendered_service_accounts(case) -> None:
    _, _, objects = case
    accounts = {sa["metadata"]["name"] for sa in find(objects, "ServiceAccount")}
    assert node_pod(objects)["serviceAccountName"] in accounts
    assert controller_pod(objects)["serviceAccountName"] in accounts
    assert node_pod(objects)["serviceAccountName"] != controller_pod(objects)["serviceAccountName"]


def test_irsa_annotations_land_on_the_pods_service_accounts() -> None:
    values = load_values_file("irsa")
    objects = render_objects(values)
    for pod, component in ((node_pod(objects), "node"), (controller_pod(objects), "controller")):
        sa = one(objects, "ServiceAccount", pod["serviceAccountName"])
        expected = values["serviceAccount"][component]["annotations"]
        assert sa["metadata"]["annotations"] == expected
        assert sa["metadata"]["annotations"][ROLE_ARN].endswith(f"role/s3csi-{component}")
        assert sa["metadata"]["namespace"] == NAMESPACE
        # IRSA: no static keys in the environment, so the SDK's chain finds the web identity.
        env = {e["name"]: e for e in container(pod, "s3csi").get("env", [])}
        assert "AWS_ACCESS_KEY_ID" not in env
        assert env["AWS_REGION"]["value"] == "eu-west-1"


def test_existing_service_accounts_are_used_not_created() -> None:
    values = {
        "serviceAccount": {
            "node": {"create": False, "name": "my-node-sa"},
            "controller": {"create": False, "name": "my-controller-sa"},
        },
        "mounter": {"serviceAccount": {"create": False, "name": "my-mounter-sa"}},
    }
    objects = render_objects(values)
    assert find(objects, "ServiceAccount") == []
    assert node_pod(objects)["serviceAccountName"] == "my-node-sa"
    assert controller_pod(objects)["serviceAccountName"] == "my-controller-sa"
    binding = one(objects, "ClusterRoleBinding", "s3csi-provisioner")
    assert binding["subjects"][0]["name"] == "my-controller-sa"
    for kind, name in (("ClusterRoleBinding", "s3csi-node"), ("RoleBinding", "s3csi-mounters")):
        assert one(objects, kind, name)["subjects"][0]["name"] == "my-node-sa"
    args = container(node_pod(objects), "s3csi")["args"]
    assert flag(args, "mounter-service-account") == "my-mounter-sa"


def _secret_env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_default_chain_means_no_static_keys() -> None:
    objects = render_objects({})
    assert find(objects, "Secret") == []
    for pod in (node_pod(objects), controller_pod(objects)):
        assert _secret_env(container(pod, "s3csi")) == {}


def test_created_secret_is_wired_into_both_components() -> None:
    values = load_values_file("minio-secret")
    objects = render_objects(values)
    secret = one(objects, "Secret")
    name = secret["metadata"]["name"]
    assert name == "s3csi-minio-aws-credentials"
    assert secret["metadata"]["namespace"] == NAMESPACE
    assert secret["stringData"] == {
        "accessKeyId": "minioadmin",
        "secretAccessKey": "minioadmin-secret",
    }
    for pod in (node_pod(objects), controller_pod(objects)):
        s3csi = container(pod, "s3csi")
        assert _secret_env(s3csi) == {
            "AWS_ACCESS_KEY_ID": {"name": name, "key": "accessKeyId"},
            "AWS_SECRET_ACCESS_KEY": {"name": name, "key": "secretAccessKey"},
            "AWS_SESSION_TOKEN": {"name": name, "key": "sessionToken", "optional": True},
        }
        env = {e["name"]: e.get("value") for e in s3csi["env"]}
        assert env["AWS_ENDPOINT_URL"] == values["s3"]["endpointUrl"]
        assert env["AWS_REGION"] == values["s3"]["region"]
        # Keys are only referenced, never inlined.
        assert "minioadmin-secret" not in json.dumps(pod)


def test_existing_secret_is_referenced_not_created() -> None:
    objects = render_objects({"awsCredentials": {"secretName": "my-keys"}})
    assert find(objects, "Secret") == []
    for pod in (node_pod(objects), controller_pod(objects)):
        refs = _secret_env(container(pod, "s3csi"))
        assert {r["name"] for r in refs.values()} == {"my-keys"}
        assert refs["AWS_SESSION_TOKEN"]["optional"] is True


def test_session_token_is_stored_when_given() -> None:
    values = copy.deepcopy(load_values_file("minio-secret"))
    values["awsCredentials"]["sessionToken"] = "tok"
    secret = one(render_objects(values), "Secret")
    assert secret["stringData"]["sessionToken"] == "tok"


def test_one_storage_class_per_entry(case) -> None:
    name, values, objects = case
    entries = values.get("storageClasses", [])
    classes = {sc["metadata"]["name"]: sc for sc in find(objects, "StorageClass")}
    assert sorted(classes) == sorted(e["name"] for e in entries), name
    for entry in entries:
        sc = classes[entry["name"]]
        assert sc["provisioner"] == DRIVER_NAME
        params = sc["parameters"]
        expected = {"bucket": entry["bucket"]}
        for key in ("basePrefix", "region", "endpointUrl"):
            if entry.get(key):
                expected[key] = entry[key]
        if "forcePathStyle" in entry:
            expected["forcePathStyle"] = "true" if entry["forcePathStyle"] else "false"
        cache = values.get("cache", {})
        size = entry.get("cacheSize", cache.get("size", ""))
        if size:
            expected["cacheSize"] = str(size)
        if entry.get("keepCache", cache.get("keep", False)):
            expected["keepCache"] = "true"
        if "secretRef" in entry:
            ref = entry["secretRef"]
            ns = ref.get("namespace", NAMESPACE)
            for stage in ("provisioner", "node-publish"):
                expected[f"csi.storage.k8s.io/{stage}-secret-name"] = ref["name"]
                expected[f"csi.storage.k8s.io/{stage}-secret-namespace"] = ns
        assert params == expected
        assert all(isinstance(v, str) for v in params.values())
        assert sc["reclaimPolicy"] == entry.get("reclaimPolicy", "Delete")
        assert sc["volumeBindingMode"] == entry.get("volumeBindingMode", "Immediate")
        assert sc.get("mountOptions", []) == entry.get("mountOptions", [])
        assert sc["allowVolumeExpansion"] is False
        annotations = sc["metadata"].get("annotations", {})
        if entry.get("isDefault"):
            assert annotations["storageclass.kubernetes.io/is-default-class"] == "true"
        else:
            assert "storageclass.kubernetes.io/is-default-class" not in annotations


def test_objects_are_unique_and_namespaced(case) -> None:
    _, _, objects = case
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))
    cluster_scoped = {"CSIDriver", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
    for o in objects:
        if o["kind"] in cluster_scoped:
            assert "namespace" not in o["metadata"]
        else:
            assert o["metadata"]["namespace"] == NAMESPACE, o["kind"]


def test_workload_selectors_match_their_pods(case) -> None:
    _, _, objects = case
    for kind in ("DaemonSet", "Deployment"):
        workload = one(objects, kind)
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()


def test_release_name_and_namespace_flow_through() -> None:
    objects = render_objects({}, release="storage", namespace="s3csi-system")
    assert one(objects, "DaemonSet")["metadata"]["name"] == "storage-s3csi-node"
    assert one(objects, "DaemonSet")["metadata"]["namespace"] == "s3csi-system"
    for kind, name in (
        ("ClusterRoleBinding", "storage-s3csi-provisioner"),
        ("ClusterRoleBinding", "storage-s3csi-node"),
        ("RoleBinding", "storage-s3csi-mounters"),
    ):
        assert one(objects, kind, name)["subjects"][0]["namespace"] == "s3csi-system"
    assert one(objects, "Role", "storage-s3csi-mounters")["metadata"]["namespace"] == "s3csi-system"
    assert one(objects, "ServiceAccount", "storage-s3csi-mounter")["metadata"]["namespace"] == "s3csi-system"
    provisioner = container(controller_pod(objects), "csi-provisioner")
    assert flag(provisioner["args"], "leader-election-namespace") == "s3csi-system"


def test_notes_render(case) -> None:
    name, values, _ = case
    notes = render_chart(values)["s3csi/templates/NOTES.txt"]
    assert DRIVER_NAME in notes
    if pod_mode(values):
        assert "app.kubernetes.io/name=s3csi-mounter" in notes, name
    else:
        assert "mounter.mode: process" in notes, name
    for entry in values.get("storageClasses", []):
        assert entry["name"] in notes, name


# --- Node-only installs (controller.enabled) --------------------------------------------------


def _component_objects(objects: list[dict[str, Any]], component: str) -> list[tuple[str, str]]:
    return sorted(
        (o["kind"], o["metadata"]["name"]) for o in objects
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    )


def test_controller_is_enabled_by_default(chart_values: dict[str, Any]) -> None:
    assert chart_values["controller"]["enabled"] is True
    objects = render_objects({})
    assert _component_objects(objects, "controller") == [
        ("ClusterRole", "s3csi-provisioner"),
        ("ClusterRoleBinding", "s3csi-provisioner"),
        ("Deployment", "s3csi-controller"),
        ("Role", "s3csi-provisioner-leader-election"),
        ("RoleBinding", "s3csi-provisioner-leader-election"),
        ("ServiceAccount", "s3csi-controller"),
    ]


def test_node_only_install_renders_no_controller() -> None:
    values = load_values_file("node-only")
    objects = render_objects(values)
    # No Deployment (nor its csi-provisioner sidecar), no controller ServiceAccount, no
    # provisioner RBAC, even though serviceAccount.controller.create is true by default.
    assert merged(values)["serviceAccount"]["controller"]["create"] is True
    assert find(objects, "Deployment") == []
    assert _component_objects(objects, "controller") == []
    assert not any("provisioner" in o["metadata"]["name"] for o in objects)
    assert find(objects, "StorageClass") == []
    # The node side is all there: driver, DaemonSet, pod-mode RBAC and accounts.
    assert one(objects, "CSIDriver")["metadata"]["name"] == DRIVER_NAME
    pod = node_pod(objects)
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    args = container(pod, "s3csi")["args"]
    assert flag(args, "mounter") == "pod" and flag_present(args, "mounter-host-network")
    assert flag(container(pod, "liveness-probe")["args"], "http-endpoint") == "127.0.0.1:9808"
    assert {o["metadata"]["name"] for o in find(objects, "ServiceAccount")} == {
        "s3csi-node", "s3csi-mounter"}
    assert _component_objects(objects, "node") == [
        ("ClusterRole", "s3csi-node"),
        ("ClusterRole", "s3csi-pod-credentials"),
        ("ClusterRoleBinding", "s3csi-node"),
        ("ClusterRoleBinding", "s3csi-pod-credentials"),
        ("DaemonSet", "s3csi-node"),
        ("Role", "s3csi-mounters"),
        ("RoleBinding", "s3csi-mounters"),
        ("ServiceAccount", "s3csi-node"),
    ]
    notes = render_chart(values)["s3csi/templates/NOTES.txt"]
    assert "Node-only install" in notes and "deployment" not in notes
    assert "s3csi-controller" not in notes
    assert "with controller.enabled: true" in notes


def test_node_only_install_in_process_mode() -> None:
    objects = render_objects({"controller": {"enabled": False}, "mounter": {"mode": "process"}})
    assert sorted(o["kind"] for o in objects) == [
        "CSIDriver", "ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]
    objects = render_objects({"controller": {"enabled": False}, "mounter": {"mode": "process"},
                              "podCredentials": {"enabled": False}})
    assert sorted(o["kind"] for o in objects) == ["CSIDriver", "DaemonSet", "ServiceAccount"]


@pytest.mark.parametrize("kube_version", ["v1.20.2", None])
def test_node_only_install_refuses_storage_classes(kube_version: str | None) -> None:
    values = {"controller": {"enabled": False},
              "storageClasses": [{"name": "s3", "bucket": "my-bucket"}]}
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values)  # the shape is fine; the combination is not
    with pytest.raises(helm.HelmError, match=r"storageClasses need the controller"):
        render_chart(values, kube_version=kube_version)
    # (helm lint renders in lint mode, where `fail` only logs: install and template refuse.)
    # With the controller they render, and without StorageClasses the node-only install does.
    render_chart({**values, "controller": {"enabled": True}}, kube_version=kube_version)
    render_chart({"controller": {"enabled": False}, "storageClasses": []},
                 kube_version=kube_version)


def test_storage_classes_carry_the_cache_defaults_unless_they_set_their_own() -> None:
    values = {"cache": {"size": "20GiB", "keep": True},
              "storageClasses": [{"name": "a", "bucket": "bucket-a"},
                                 {"name": "b", "bucket": "bucket-b", "cacheSize": "0",
                                  "keepCache": False},
                                 {"name": "c", "bucket": "bucket-c", "cacheSize": "5GiB"}]}
    classes = {sc["metadata"]["name"]: sc["parameters"]
               for sc in find(render_objects(values), "StorageClass")}
    assert classes["a"]["cacheSize"] == "20GiB" and classes["a"]["keepCache"] == "true"
    assert classes["b"]["cacheSize"] == "0" and "keepCache" not in classes["b"]
    assert classes["c"]["cacheSize"] == "5GiB" and classes["c"]["keepCache"] == "true"
    # Without chart defaults no class asks for a cache.
    plain = find(render_objects({"storageClasses": [{"name": "a", "bucket": "bucket-a"}]}),
                 "StorageClass")
    assert "cacheSize" not in plain[0]["parameters"]


def test_node_only_install_ignores_the_controller_service_account_settings() -> None:
    values = {"controller": {"enabled": False},
              "serviceAccount": {"controller": {"create": True, "name": "ctl",
                                                "annotations": {ROLE_ARN: "arn:x"}}}}
    objects = render_objects(values)
    assert find(objects, "ServiceAccount", "ctl") == []
    assert "ctl" not in json.dumps(objects)


# --- manifests/ ------------------------------------------------------------------------------


def test_rendered_manifest_is_up_to_date() -> None:
    expected = default_manifest_text()
    actual = MANIFEST.read_text() if MANIFEST.exists() else ""
    if actual != expected:
        pytest.fail(
            "manifests/s3csi.yaml is stale: run `python3 tests/chart/render_manifests.py` "
            "and commit the result",
            pytrace=False,
        )


def test_rendered_manifest_parses_to_the_default_objects() -> None:
    if load_yaml_objects(MANIFEST) != render_objects({}):
        pytest.fail("manifests/s3csi.yaml does not hold the default objects", pytrace=False)


def test_example_dynamic() -> None:
    objects = load_yaml_objects(EXAMPLES_DIR / "dynamic.yaml")
    sc = one(objects, "StorageClass")
    assert sc["provisioner"] == DRIVER_NAME
    pvc = one(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]
    pod = one(objects, "Pod")
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_example_static() -> None:
    objects = load_yaml_objects(EXAMPLES_DIR / "static.yaml")
    pv = one(objects, "PersistentVolume")
    csi = pv["spec"]["csi"]
    assert csi["driver"] == DRIVER_NAME
    assert csi["volumeHandle"] == "my-bucket/some/prefix"
    attrs = csi["volumeAttributes"]
    assert f"{attrs['bucket']}/{attrs['prefix']}" == csi["volumeHandle"]
    assert set(attrs) == {"bucket", "prefix", "region"}
    pvc = one(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "" == pv["spec"]["storageClassName"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    pod = one(objects, "Pod")
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_example_s3_compatible() -> None:
    objects = load_yaml_objects(EXAMPLES_DIR / "s3-compatible.yaml")
    secret = one(objects, "Secret")
    assert set(secret["stringData"]) <= {"accessKeyId", "secretAccessKey", "sessionToken"}
    assert {"accessKeyId", "secretAccessKey"} <= set(secret["stringData"])
    sc = one(objects, "StorageClass")
    params = sc["parameters"]
    assert sc["provisioner"] == DRIVER_NAME
    assert params["endpointUrl"].startswith("http")
    assert params["forcePathStyle"] == "true"
    for stage in ("provisioner", "node-publish"):
        assert params[f"csi.storage.k8s.io/{stage}-secret-name"] == secret["metadata"]["name"]
        assert params[f"csi.storage.k8s.io/{stage}-secret-namespace"] == secret["metadata"]["namespace"]
    pvc = one(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]


def test_chart_storage_class_matches_the_example_shape() -> None:
    """The chart renders the s3-compatible example's StorageClass from values alone."""
    example = one(load_yaml_objects(EXAMPLES_DIR / "s3-compatible.yaml"), "StorageClass")
    params = example["parameters"]
    values = {
        "storageClasses": [
            {
                "name": example["metadata"]["name"],
                "bucket": params["bucket"],
                "region": params["region"],
                "endpointUrl": params["endpointUrl"],
                "forcePathStyle": params["forcePathStyle"] == "true",
                "reclaimPolicy": example["reclaimPolicy"],
                "volumeBindingMode": example["volumeBindingMode"],
                "secretRef": {
                    "name": params["csi.storage.k8s.io/node-publish-secret-name"],
                    "namespace": params["csi.storage.k8s.io/node-publish-secret-namespace"],
                },
            }
        ]
    }
    rendered = one(render_objects(values), "StorageClass")
    rendered["metadata"].pop("labels")
    assert rendered == example


# --- Containerfile ---------------------------------------------------------------------------


def test_containerfile() -> None:
    """The Containerfile and tests/e2e (which has no container engine) build the same image:
    image/rootfs.sh lays out its file system in both."""
    text = (REPO / "Containerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE | re.IGNORECASE)
    assert len(stages) >= 2, "multi-stage build expected"
    assert stages[0][0].endswith("rust:1-bookworm")
    assert stages[-1][0] == "scratch"
    assert "cargo build --release --locked" in text
    assert re.search(r"apt-get install[^\n]*fuse3", text)
    assert re.search(r"apt-get install[^\n]*ca-certificates", text)
    assert "sh image/rootfs.sh /rootfs target/release/s3csi" in text
    assert "COPY --from=builder /rootfs/ /" in text
    assert 'ENTRYPOINT ["/usr/local/bin/s3csi"]' in text
    assert "image/rootfs.sh" in (REPO / "tests" / "e2e" / "run.sh").read_text()


# --- switches for clusters without sidecar images (tests/e2e uses them) ----------------------

E2E_VALUES = REPO / "tests" / "e2e" / "values.yaml"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_e2e_values_render_valid_kubernetes(kube_version: str) -> None:
    values = yaml.safe_load(E2E_VALUES.read_text())
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values)
    for obj in render_objects(values, kube_version=f"v{kube_version}.0"):
        validate_object(obj, kube_version)


def test_builtin_kubelet_registration() -> None:
    values = {"node": {"kubeletRegistration": "builtin", "kubeletPath": "/var/lib/k0s/kubelet"}}
    pod = node_pod(render_objects(values))
    assert [c["name"] for c in pod["containers"]] == ["s3csi", "liveness-probe"]
    s3csi = container(pod, "s3csi")
    assert flag(s3csi["args"], "register-with-kubelet") == "/registration"
    assert mount_of(s3csi, "registration-dir")["mountPath"] == "/registration"
    assert host_path(pod, "registration-dir").rstrip("/") == "/var/lib/k0s/kubelet/plugins_registry"
    # The kubelet calls the CSI socket by its host path: the plugin dir's socket.
    assert flag(s3csi["args"], "kubelet-registration-path") == (
        host_path(pod, "plugin-dir").rstrip("/") + "/csi.sock")
    assert socket_path(flag(s3csi["args"], "endpoint")) == (
        mount_of(s3csi, "plugin-dir")["mountPath"] + "/csi.sock")
    src = _rust_sources()
    for name in ("register_with_kubelet", "kubelet_registration_path"):
        assert re.search(rf"\bpub {name}:", src), name
    # The sidecar stays the default.
    default = node_pod(render_objects({}))
    assert "node-driver-registrar" in [c["name"] for c in default["containers"]]
    assert not flag_present(container(default, "s3csi")["args"], "register-with-kubelet")


def test_sidecars_can_be_switched_off() -> None:
    values = {"sidecars": {"livenessProbe": {"enabled": False}, "provisioner": {"enabled": False}}}
    objects = render_objects(values)
    for pod in (node_pod(objects), controller_pod(objects)):
        names = [c["name"] for c in pod["containers"]]
        assert "liveness-probe" not in names and "csi-provisioner" not in names, names
        s3csi = container(pod, "s3csi")
        assert "livenessProbe" not in s3csi and "ports" not in s3csi
    assert [c["name"] for c in controller_pod(objects)["containers"]] == ["s3csi"]
    # No provisioner, no provisioner RBAC; the controller and its ServiceAccount stay.
    assert not [o for o in objects if o["metadata"]["name"].endswith("-provisioner")]
    assert named(objects, "ServiceAccount", "controller")
    # With metrics on, the metrics port is still declared.
    metrics = render_objects({**values, "metrics": {"enabled": True}})
    ports = container(node_pod(metrics), "s3csi")["ports"]
    assert [p["name"] for p in ports] == ["metrics"]


@pytest.mark.parametrize("liveness", [True, False])
def test_controller_host_network(liveness: bool) -> None:
    values = {"controller": {"hostNetwork": True, "healthPort": 9810},
              "sidecars": {"livenessProbe": {"enabled": liveness}}}
    pod = controller_pod(render_objects(values))
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    if liveness:
        assert "--http-endpoint=127.0.0.1:9810" in container(pod, "liveness-probe")["args"]
        assert container(pod, "s3csi")["livenessProbe"]["httpGet"]["host"] == "127.0.0.1"


def test_node_state_dir_and_extra_env() -> None:
    env = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
           {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]
    pod = node_pod(render_objects({"node": {"stateDir": "/srv/s3csi", "extraEnv": env}}))
    s3csi = container(pod, "s3csi")
    assert flag(s3csi["args"], "state-dir") == "/srv/s3csi"
    assert host_path(pod, "state-dir") == "/srv/s3csi"
    assert mount_of(s3csi, "state-dir")["mountPath"] == "/srv/s3csi"
    assert s3csi["env"][-2:] == env


# --- Grafana dashboard (dashboard.*, dashboards/s3csi.json) -----------------------------------

DASHBOARD = CHART_DIR / "dashboards" / "s3csi.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
# What every panel and query asks for: the Prometheus chosen in the `datasource` variable.
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
_METRIC_KINDS = ("Counter", "Gauge", "Histogram")
_STRING = r'"(?:[^"\\]|\\.)*"'


def _rust_sources_without_tests() -> dict[str, str]:
    """src/**/*.rs, path -> text up to its `#[cfg(test)] mod` (tests register made-up names)."""
    return {
        str(p.relative_to(REPO)): re.split(r"#\[cfg\(test\)\]\s*mod \w+\s*\{", p.read_text())[0]
        for p in sorted((REPO / "src").rglob("*.rs"))
    }


def _declared_kind(ident: str, src: str) -> str:
    """Counter, Gauge or Histogram: the type of the field or binding `ident`
    (`ident: Family<L, Counter>`, `let ident = Family::<L, Gauge>::default()`, `ident: Counter`)."""
    kinds = "|".join(_METRIC_KINDS)
    pattern = rf"\b{re.escape(ident)}\s*(?::|=)\s*(?:Family(?:::)?<\s*\w+\s*,\s*({kinds})\b|({kinds})\b)"
    found = {a or b for a, b in re.findall(pattern, src)}
    assert len(found) == 1, f"metric {ident!r}: cannot tell its type from src/ (found {found})"
    return found.pop()


def exported_metrics() -> dict[str, str]:
    """Every metric family the Rust code registers, name as registered -> Counter, Gauge or
    Histogram, read from src/ (so that it follows the code):
    - `register("name", "help", x.clone())`: prometheus-client's registry; x's declared type;
    - `gauge("name", ...)` / `counter("name", ...)`: metrics::Registry's and Sampled's
      collectors read at scrape time;
    - `let table: [...] = [("name", "help", ...), ...]; for (..) in table { ...counter(name...`.
    Every "s3csi_..." string literal outside tests must be one of these."""
    sources = _rust_sources_without_tests()
    src = "\n".join(sources.values())
    kinds: dict[str, str] = {}
    for name, value in re.findall(
        rf'\bregister\(\s*"(s3csi_\w+)"\s*,\s*{_STRING}\s*,\s*([\w.]+?)(?:\.clone\(\))?\s*,?\s*\)', src
    ):
        kinds[name] = _declared_kind(value.rsplit(".", 1)[-1], src)
    for kind, name in re.findall(r'\b(gauge|counter)\(\s*"(s3csi_\w+)"', src):
        kinds[name] = kind.capitalize()
    for table, body in re.findall(r"let (\w+)\s*:\s*\[[^=]*=\s*\[(.*?)\];", src, re.DOTALL):
        loop = re.search(rf"\bin\s+{table}\b(.{{0,600}})", src, re.DOTALL)
        kind = loop and re.search(r"\b(gauge|counter)\(", loop.group(1))
        for name in re.findall(r'\(\s*"(s3csi_\w+)"', body):
            assert kind, f"{name}: in table {table}, registered in no way the test knows"
            kinds[name] = kind.group(1).capitalize()
    literals = {m for text in sources.values() for m in re.findall(r'"(s3csi_\w+)"', text)}
    assert literals - kinds.keys() == set(), "s3csi_* names registered in a way the test does not know"
    return kinds


def exported_series_names() -> set[str]:
    """The names in the exposition: counters get `_total` (prometheus-client appends it),
    histograms `_bucket`, `_sum` and `_count`."""
    names = set()
    for name, kind in exported_metrics().items():
        if kind == "Counter":
            assert not name.endswith("_total"), f"{name}: the encoder appends _total itself"
            names.add(f"{name}_total")
        elif kind == "Histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                    "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are no function (not
    followed by "("), keyword, label (in {...} or by/without/on/ignoring (...)), string,
    range or Grafana variable."""
    s = re.sub(_STRING, '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    found = re.findall(r"(?<![\w$.:])([A-Za-z_:][\w:]*)\b(?!\s*\()", s)
    return {n for n in found if n.lower() not in _PROMQL_KEYWORDS}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    panels = []
    for p in dashboard()["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    return panels


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    queries = [(f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
               for p in dashboard_panels() for t in p.get("targets", [])]
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            call = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
            assert call, f"variable {v['name']}: {query!r} is not label_values(METRIC, label)"
            queries.append((f"variable {v['name']}", call.group(1)))
    return queries


def test_promql_metric_names_extraction() -> None:
    """The extraction itself, on the shapes the dashboard uses."""
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (operation, le) (rate(a_bucket{instance=~"$instance", '
        'x!~"ok|b"}[$__rate_interval]))) / on (job) group_left (v) b_total offset 5m > bool 1e3'
    ) == {"a_bucket", "b_total"}
    assert promql_metric_names("sum(rate(x[5m])) by (le) or vector(0)") == {"x"}


def test_exported_metrics_are_found_in_the_code() -> None:
    """The scan sees every kind of registration (a sample of each), with its type."""
    kinds = exported_metrics()
    assert kinds["s3csi_build_info"] == "Gauge"  # register(), a Family of gauges
    assert kinds["s3csi_grpc_requests"] == "Counter"  # register(), a Family of counters
    assert kinds["s3csi_s3_request_duration_seconds"] == "Histogram"
    assert kinds["s3csi_mounter_scrape_errors"] == "Counter"  # register(), a bare Counter
    assert kinds["s3csi_mounters"] == "Gauge"  # Registry::gauge()
    assert kinds["s3csi_mounter_replacements"] == "Counter"  # Registry::counter()
    assert kinds["s3csi_open_file_handles"] == "Gauge"  # Sampled::gauge()
    assert kinds["s3csi_cache_misses"] == "Counter"  # a table of Sampled::counter()
    names = exported_series_names()
    assert {"s3csi_s3_requests_total", "s3csi_s3_request_duration_seconds_bucket",
            "s3csi_mounts"} <= names
    assert "s3csi_s3_requests" not in names


def test_dashboard_queries_use_only_metrics_the_code_exports() -> None:
    exported = exported_series_names()
    queries = dashboard_queries()
    assert len(queries) >= 10
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= exported, f"{where}: {sorted(names - exported)} not exported by src/"


def test_dashboard_shape() -> None:
    d = dashboard()
    assert d["uid"] == "s3csi" and d["title"]
    assert d["schemaVersion"] >= 36  # datasource references as {type, uid} objects
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v.get("datasource") == DATASOURCE_REF, v["name"]
    # Every $variable the dashboard uses is defined ($__interval and the like are Grafana's).
    used = set(re.findall(r"\$\{?([A-Za-z]\w*)", DASHBOARD.read_text()))
    assert used <= set(variables), f"undefined variables: {used - set(variables)}"
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        grid = p["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panels {cells.get((x, y))} and {p['id']} overlap"
                cells[(x, y)] = p["id"]
        if p["type"] == "row":
            assert "targets" not in p, f"row {p['title']!r} has queries"
            continue
        assert p.get("datasource") == DATASOURCE_REF, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("datasource") == DATASOURCE_REF, f"{p['title']} {t['refId']}"


def test_dashboard_panels_and_metrics_are_documented() -> None:
    """docs/metrics.md, "Dashboard", names every panel and the metrics it shows."""
    doc = METRICS_DOC.read_text()
    parts = re.split(r"^## Dashboard\n", doc, maxsplit=1, flags=re.MULTILINE)
    assert len(parts) == 2, "docs/metrics.md has no \"## Dashboard\" section"
    section = re.split(r"^#{1,2} ", parts[1], maxsplit=1, flags=re.MULTILINE)[0]
    for p in dashboard_panels():
        if p["type"] != "row":
            assert p["title"] in section, f"panel {p['title']!r} not in docs/metrics.md, Dashboard"
    metrics = exported_metrics()
    for _, expr in dashboard_queries():
        for name in promql_metric_names(expr):
            family = next(m for m in metrics if name in (m, f"{m}_total") or
                          re.fullmatch(rf"{m}_(bucket|sum|count)", name))
            assert f"`{family}" in section, f"{family} not in docs/metrics.md, Dashboard"


def test_dashboard_is_off_by_default(chart_values: dict[str, Any]) -> None:
    assert chart_values["dashboard"] == {"enabled": False, "namespace": "",
                                         "labels": {"grafana_dashboard": "1"}, "annotations": {}}
    assert find(render_objects({}), "ConfigMap") == []
    assert "s3csi/templates/dashboard-configmap.yaml" not in {
        k for k, v in render_chart({}).items() if v.strip()}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_dashboard_config_map(kube_version: str) -> None:
    objects = render_objects({"dashboard": {"enabled": True}}, kube_version=f"v{kube_version}.0")
    cm = one(objects, "ConfigMap")
    vendored = REPO / "tests" / "chart" / "kube-schemas" / f"v{kube_version}.json"
    if not vendored.exists() or "v1/ConfigMap" in json.loads(vendored.read_text())["kinds"]:
        validate_object(cm, kube_version)
    # else: the vendored schemas of that release have no ConfigMap (vendor_kube_schemas.py's
    # KINDS); the rest is checked all the same.
    assert cm["metadata"]["name"] == "s3csi-dashboard"
    assert cm["metadata"]["namespace"] == NAMESPACE
    labels = cm["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"
    assert labels["app.kubernetes.io/name"] == "s3csi"
    assert "annotations" not in cm["metadata"]
    assert list(cm["data"]) == ["s3csi.json"]  # the sidecar loads *.json keys
    assert json.loads(cm["data"]["s3csi.json"]) == dashboard()
    # Nothing else changes.
    others = [(o["kind"], o["metadata"]["name"]) for o in objects if o is not cm]
    assert others == [(o["kind"], o["metadata"]["name"])
                      for o in render_objects({}, kube_version=f"v{kube_version}.0")]


def test_dashboard_namespace_labels_and_annotations() -> None:
    values = {"dashboard": {"enabled": True, "namespace": "monitoring",
                            "labels": {"grafana_dashboard": None, "dashboards": "storage"},
                            "annotations": {"grafana_folder": "Storage"}}}
    cm = one(render_objects(values, release="storage", namespace="s3csi-system"), "ConfigMap")
    validate_object(cm, NEWEST_KUBE)
    assert cm["metadata"]["name"] == "storage-s3csi-dashboard"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["dashboards"] == "storage"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]  # null drops the default
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Storage"}


@pytest.mark.parametrize("kube_version", ["v1.20.2", None])
def test_dashboard_lint_is_clean(kube_version: str | None) -> None:
    report = helm.lint(CHART_DIR, {"dashboard": {"enabled": True}}, strict=True,
                       namespace=NAMESPACE, kube_version=kube_version)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
