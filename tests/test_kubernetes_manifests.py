"""Every overlay of deploy/kubernetes, and the example overlay of docs/operator/kubernetes.md,
renders (`kubectl kustomize`) and every object it makes is
valid for Kubernetes 1.30 and for the newest version kubernetes-validate knows, with unknown
fields refused (`kubernetes-validate --strict`, through its Python function). The command only
warns of an object whose kind it has no schema for; here that fails too, so that every object
really was checked. No API server runs here: nothing is applied."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_validate import utils as kubernetes_validate

from tests.kubernetes_support import DOCS_EXAMPLE, OVERLAYS, by_kind, needs_kustomize, rendered

pytestmark = needs_kustomize

OLDEST_SUPPORTED = "1.30.0"
VERSIONS = sorted({OLDEST_SUPPORTED, kubernetes_validate.latest_version()})
NAMESPACED_NOT = {"Namespace", "PriorityClass"}


@pytest.mark.parametrize("overlay", [*OVERLAYS, DOCS_EXAMPLE])
def test_the_overlay_renders_everything_into_the_bungee_namespace(overlay: str) -> None:
    objects = rendered(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "PriorityClass", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
            "Ingress", "DaemonSet"} <= kinds
    assert set(by_kind(objects, "Deployment")) >= {"bungee-portal", "bungee-worker", "bungee-beat"}
    assert set(by_kind(objects, "DaemonSet")) == {"bungee-agent"}
    for item in objects:
        namespace = item["metadata"].get("namespace")
        if item["kind"] in NAMESPACED_NOT:
            assert namespace is None, item["metadata"]
        else:
            assert namespace == "bungee", item["metadata"]


def test_trial_adds_its_stores_and_external_services_has_none() -> None:
    trial = rendered("trial")
    assert set(by_kind(trial, "StatefulSet")) == {"bungee-postgres"}
    assert {"bungee-redis", "bungee-postgres"} <= set(by_kind(trial, "Service"))
    external = rendered("external-services")
    assert not by_kind(external, "StatefulSet")
    assert {name for name in by_kind(external, "Service")} == {"bungee-portal"}


def test_the_docs_example_changes_what_it_says() -> None:
    """Its patches land: the image, the host, the storage class, four GPUs on the host's network."""
    objects = rendered(DOCS_EXAMPLE)
    agent = by_kind(objects, "DaemonSet")["bungee-agent"]["spec"]["template"]["spec"]
    [container] = agent["containers"]
    assert container["image"] == "registry.example.com/bungee:0.1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["limits"]["memory"] == "128Gi"
    assert agent["hostNetwork"] is True
    assert by_kind(objects, "PersistentVolumeClaim")["bungee-data"]["spec"]["storageClassName"] == "nfs-client"
    assert by_kind(objects, "Ingress")["bungee-portal"]["spec"]["rules"][0]["host"] == "bungee.my-lab.org"
    assert "bungee.my-lab.org" in by_kind(objects, "ConfigMap")["bungee-settings"]["data"]["ALLOWED_HOSTS"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", [*OVERLAYS, DOCS_EXAMPLE])
def test_every_object_is_valid_for_kubernetes_strictly(overlay: str, version: str) -> None:
    failures: list[str] = []
    for item in rendered(overlay):
        name = f"{item['kind']}/{item['metadata']['name']}"
        try:
            kubernetes_validate.validate(item, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{name}: {'.'.join(map(str, err.path))}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            failures.append(f"{name}: no schema for {version}: {err.message}")
    assert not failures, "\n".join(failures)


def test_the_validator_refuses_what_it_should() -> None:
    """The strict check finds an unknown field and a wrong type in a rendered object, so that a
    pass above means something."""
    portal: dict[str, Any] = by_kind(rendered("trial"), "Deployment")["bungee-portal"]
    container = portal["spec"]["template"]["spec"]["containers"][0]
    misspelt = {**portal, "spec": {**portal["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, OLDEST_SUPPORTED, strict=True)
    wrong_type = {**container, "ports": [{"name": "http", "containerPort": "eight thousand"}]}
    broken = {**portal, "spec": {**portal["spec"], "template": {**portal["spec"]["template"], "spec": {
        **portal["spec"]["template"]["spec"], "containers": [wrong_type]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_SUPPORTED, strict=True)
