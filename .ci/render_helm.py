"""Lints deploy/helm/devplug and renders it offline into OUT_DIR, one multi-document YAML file
per set of values, for the strict manifest checks (crates/deploy-check, devplug-cli's
tests/deploy_config.rs). Any lint warning or error, or a render failure, exits non-zero."""

import json
import re
import sys
from pathlib import Path

import helm_python as helm

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "devplug"
# The chart serves nothing by default and refuses to render without a resource; the demo's
# values name one.
DEMO = helm.values_from_yaml((CHART / "examples" / "demo-values.yaml").read_text())

# Each set of values becomes one release. "all-options" turns on every optional block of the
# templates, so that each `if`/`with` branch is rendered and checked at least once;
# the demo runs the full /devplug for refusedPods (delete-replaced); "lite" turns that off,
# the device-plugin-only /devplug-lite; "node-events" is that one cluster feature alone.
RELEASES = {
    "demo": DEMO,
    "lite": {**DEMO, "refusedPods": "off"},
    "node-events": {**DEMO, "nodeEvents": {"enabled": True}, "refusedPods": "off"},
    # Every monitoring object (the Prometheus Operator's, the dashboard), with its labels.
    "monitoring": {
        **DEMO,
        "podResources": {"enabled": True},
        "monitoring": {
            "labels": {"release": "kube-prometheus-stack"},
            "podMonitor": {"enabled": True},
            "serviceMonitor": {"enabled": True, "interval": "15s"},
            "rules": {"enabled": True, "extraLabels": {"team": "platform"}},
            "dashboard": {"enabled": True, "namespace": "monitoring"},
        },
    },
    # A dra: resource alone: full /devplug, NODE_NAME, the plugins/ and CDI folders, DRA RBAC.
    "dra": {
        "config": {
            "resources": [
                {"name": "example.com/npu", "virtual": {"count": 4}, "dra": {"driver": "npu.example.com"}},
            ]
        }
    },
    # GPU nodes: one value per vendor (the nvidia one also with its settings and a resource
    # beside the GPUs); the image, mounts, privilege and node selector follow the vendor.
    "gpu-nvidia": {
        "gpu": {
            "vendor": "nvidia",
            "driverRoot": "/run/nvidia/driver",
            "settings": {"replicas": 2},
            "extraResources": [{"name": "example.com/a", "virtual": {"count": 2}}],
        }
    },
    # Where NVIDIA's container toolkit is a RuntimeClass: unprivileged under it, the driver's
    # files left to the toolkit, its own resource name and mount propagation, an image tag
    # already naming the GPU image, and a dra: resource beside it (one CDI folder for both).
    "gpu-nvidia-toolkit": {
        "gpu": {
            "vendor": "nvidia",
            "privileged": False,
            "driverRootPropagation": "None",
            "resourceName": "nvidia.com/h100",
            "settings": {"driver_files": False},
            "extraResources": [
                {"name": "example.com/npu", "virtual": {"count": 4}, "dra": {"driver": "npu.example.com"}},
            ],
        },
        "image": {"repository": "registry.example.com/devplug", "tag": "0.1.0-gpu"},
        "runtimeClassName": "nvidia",
        "extraEnv": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    },
    # GPUs shared by capacity through MPS: a DRA driver for the GPU resource, the MPS folder.
    "gpu-nvidia-mps": {
        "gpu": {"vendor": "nvidia", "settings": {"share": {}}, "dra": {"driver": "gpu.nvidia.example.com"}}
    },
    # The vendor's node labels ORed, each ANDed with a node affinity of the operator's own.
    "gpu-amdgpu": {
        "gpu": {"vendor": "amdgpu"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "example.com/pool", "operator": "In", "values": ["gpu"]}]}
                    ]
                }
            }
        },
    },
    # Node labels for Node Feature Discovery: a NodeFeature object per node, its Role, and the
    # uninstall's (the GPU releases above write them directly: nodeLabels auto).
    "node-labels-nfd": {"gpu": {"vendor": "nvidia"}, "nodeLabels": "node-feature"},
    "gpu-intel": {
        "gpu": {"vendor": "intel-gpu", "settings": {"driver": "xe"}, "nodeSelector": {"example.com/gpu": "intel"}}
    },
    "all-options": {
        "hostdev": {"enabled": True},
        "podResources": {"enabled": True},
        "nodeEvents": {"enabled": True},
        "nodeLabels": "direct",
        "dra": {"cdiDir": "/var/run/cdi", "deviceClasses": True, "extendedResources": True},
        "kubeletDir": "/var/snap/microk8s/common/var/lib/kubelet/",
        "serviceAccount": {"annotations": {"example.com/owner": "platform"}},
        "imagePullSecrets": [{"name": "registry"}],
        "podAnnotations": {"example.com/scrape": "true"},
        "podLabels": {"example.com/team": "devices"},
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "hostNetwork": True,
        "extraVolumes": [{"name": "colas", "hostPath": {"path": "/etc/colas", "type": "DirectoryOrCreate"}}],
        "extraVolumeMounts": [{"name": "colas", "mountPath": "/etc/colas", "readOnly": True}],
        "uninstall": {"hostNetwork": True, "extraEnv": [{"name": "EXTRA", "value": "1"}]},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                    ]
                }
            }
        },
        "priorityClassName": "",
        "config": {
            "resources": [
                {"name": "example.com/a", "virtual": {"count": 2}},
                {"name": "example.com/b", "virtual": {"count": 3, "numa_nodes": 2}, "registration": "watcher"},
                {"name": "example.com/dongle", "advertise": {"count": 4}},
                {"name": "example.com/c", "virtual": {"count": 2}, "dra": {"driver": "c.example.com", "device_plugin": True}},
                {"name": "amd.com/gpu", "amdgpu": {}},
            ]
        },
    },
}

# Values the chart must refuse to render: name -> (values, what is wrong, words the refusal must
# say). The template's own refusals are reported at templates/values-check.yaml (never at a
# template that reads as another problem, such as uninstall.yaml); values.schema.json refuses
# unknown keys, naming the key, and for a key that looks like one of the chart's, the ones meant.
REFUSALS = {
    # No config: the chart refuses, naming the value and the demo's file.
    "defaults": (
        {},
        "no resources configured",
        ["templates/values-check.yaml", "config.resources", "demo-values.yaml"],
    ),
    # An account of the operator's own that is not named: the roles would go to the namespace's
    # "default" account, which every other pod there runs as.
    "no-service-account-name": (
        {**DEMO, "serviceAccount": {"create": False}},
        "serviceAccount.create false and no serviceAccount.name",
        ["templates/values-check.yaml", "serviceAccount.name is required when serviceAccount.create is false"],
    ),
    "same-ports": (
        {**DEMO, "probes": {"port": 8080}},
        "probes.port equal to metrics.port",
        ["templates/values-check.yaml", "probes.port must differ from metrics.port"],
    ),
    # monitoring.enabled is not a key: the four that are are named.
    "monitoring-enabled": (
        {**DEMO, "monitoring": {"enabled": True}},
        "monitoring.enabled (not a key)",
        ["/monitoring/enabled", "monitoring.podMonitor.enabled", "monitoring.serviceMonitor.enabled",
         "monitoring.rules.enabled", "monitoring.dashboard.enabled"],
    ),
    "gpu-enabled": (
        {**DEMO, "gpu": {"enabled": True}},
        "gpu.enabled (not a key)",
        ["/gpu/enabled", "gpu.vendor"],
    ),
    # A misspelt key, at the top and nested: named, with where it is.
    "misspelt-top-level-key": (
        {**DEMO, "nodeSelctor": {"example.com/pool": "a"}},
        "nodeSelctor (misspelt)",
        ["additional properties 'nodeSelctor' not allowed"],
    ),
    "misspelt-nested-key": (
        {**DEMO, "monitoring": {"podMonitor": {"enable": True}}},
        "monitoring.podMonitor.enable (misspelt)",
        ["/monitoring/podMonitor", "additional properties 'enable' not allowed"],
    ),
    "unknown-vendor": (
        {"gpu": {"vendor": "nvidia-gpu"}},
        "gpu.vendor not a vendor",
        ["/gpu/vendor", "nvidia", "amdgpu", "intel-gpu"],
    ),
}

# The --set and --set-json keys the docs show (`--set monitoring.rules.enabled=true`): each must
# be one values.schema.json defines, so that a command copied from the docs is not refused.
SET_FLAG = re.compile(r"--set(?:-json|-string)?[ =]'?([A-Za-z][A-Za-z0-9_.]*)=")


def schema_has(schema, key):
    node = schema
    for part in key.split("."):
        props = node.get("properties", {})
        if part in props and "const" not in props[part]:
            node = props[part]
        elif node.get("additionalProperties", True) is not False and "properties" not in node:
            return True  # an open map (nodeSelector, config, ...): any key
        else:
            return False
    return True


def docs_set_keys_problems():
    root = CHART.parent.parent.parent
    schema = json.loads((CHART / "values.schema.json").read_text())
    problems, seen = [], 0
    for doc in [root / "README.md", root / "deploy" / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for key in SET_FLAG.findall(line):
                seen += 1
                if not schema_has(schema, key):
                    problems.append(f"{doc.relative_to(root)}:{n}: --set {key}: not a key of values.schema.json")
    if seen < 5:
        problems.append(f"only {seen} --set flags found in the docs: is the pattern still right?")
    return problems


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.yaml"):
        old.unlink()

    report = helm.lint(str(CHART), DEMO, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + [
        {"severity": 3, "path": "", "error": e} for e in report["errors"]
    ]
    for m in report["messages"]:
        print(f"helm lint: {m['path']}: {m['error']}")
    if problems:
        print("helm lint failed", file=sys.stderr)
        return 1

    # The chart's ci/ values files (chart-testing's convention), each a release named after the
    # file: the whole-node tests install these.
    releases = dict(RELEASES)
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        releases[path.name.removesuffix("-values.yaml")] = helm.values_from_yaml(path.read_text())

    problems = docs_set_keys_problems()
    if problems:
        print(*problems, sep="\n", file=sys.stderr)
        return 1
    print("the docs' --set keys are all keys of values.schema.json")

    with helm.Chart.load(str(CHART)) as chart:
        for name, (values, why, words) in REFUSALS.items():
            try:
                chart.render(values, name="devplug", namespace="kube-system")
            except Exception as refused:  # the SDK raises its own error type for a template's fail
                if not all(word in str(refused) for word in words):
                    print(f"{name}: refused for another reason: {refused}", file=sys.stderr)
                    return 1
                print(f"{name}: refused as it should be ({why})")
            else:
                print(f"{name}: the chart rendered with {why}", file=sys.stderr)
                return 1
        # An account of the operator's own, named: the chart makes none and the pods run as it.
        own = chart.render(
            {**DEMO, "serviceAccount": {"create": False, "name": "devplug-operator"}},
            name="devplug",
            namespace="kube-system",
        )
        made = [t for p, t in own.items() if p.endswith("/serviceaccount.yaml") and t.strip()]
        pods = "".join(t for p, t in own.items() if p.endswith("/daemonset.yaml"))
        if made or "serviceAccountName: devplug-operator" not in pods:
            print(
                "existing-service-account: the chart made an account or did not use the one named",
                file=sys.stderr,
            )
            return 1
        print("existing-service-account: rendered as it should be (no account made, the one named used)")
        for name, values in releases.items():
            manifests = chart.render(values, name="devplug", namespace="kube-system")
            docs = [
                f"# Source: {path}\n{text.strip()}\n"
                for path, text in sorted(manifests.items())
                if path.endswith((".yaml", ".yml")) and text.strip()
            ]
            if not docs:
                print(f"{name}: the chart rendered no manifests", file=sys.stderr)
                return 1
            target = out_dir / f"{name}.yaml"
            target.write_text("---\n".join(docs))
            print(f"rendered {target} ({len(docs)} manifests, Helm {helm.helm_sdk_version()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
