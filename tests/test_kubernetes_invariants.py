"""What the schema cannot say about deploy/kubernetes, checked on what `kubectl kustomize` renders
for every overlay and for the docs' example overlay: probes, resources and a locked-down securityContext on every container; the
agent's GPUs, tolerations, hostPID and a grace that covers its drain; its pool token and a node
name per pod; exactly one beat; no Secret with a value anywhere, and every Secret it names listed
in the operator's docs; one image for every Bungee process, the stores' images those of
docker-compose.yml; every name an object refers to defined; the commands those of
docker-compose.yml."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.urls import Resolver404, resolve
from pydantic import ValidationError

from elastic.wire import POOL_NAME_PATTERN, NodeRegistration
from portal.accounts.models import ApiToken
from tests.kubernetes_support import (
    BUNGEE_COMPONENTS,
    DOCS,
    DOCS_EXAMPLE,
    KUBERNETES,
    OVERLAYS,
    ROOT,
    by_kind,
    component,
    env_value,
    needs_kustomize,
    pods,
    rendered,
)

pytestmark = needs_kustomize

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(params=[*OVERLAYS, DOCS_EXAMPLE])
def objects(request: pytest.FixtureRequest) -> tuple[dict[str, Any], ...]:
    return rendered(request.param)


def test_every_container_has_resources_and_a_locked_down_security_context(objects: tuple[dict[str, Any], ...]) -> None:
    for pod in pods(objects):
        security = pod.spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, pod.name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, pod.name
        assert pod.spec["automountServiceAccountToken"] is False, pod.name
        assert pod.spec["enableServiceLinks"] is False, pod.name
        for container in pod.containers():
            where = f"{pod.name} {container['name']}"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), where
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, where


def test_every_container_has_probes_that_ask_something_real(objects: tuple[dict[str, Any], ...]) -> None:
    """Readiness and liveness everywhere (init containers take none). An HTTP probe asks a path
    of the portal's URLs with a Host the portal accepts; a liveness-file probe reads the file the
    container's BUNGEE_LIVENESS_FILE names; the portal's liveness asks no store."""
    allowed_hosts = env_value(component(objects, "portal").containers(init=False)[0], "ALLOWED_HOSTS", objects)
    assert allowed_hosts is not None
    for pod in pods(objects):
        for container in pod.containers(init=False):
            where = f"{pod.name} {container['name']}"
            probes = {kind: container.get(kind) for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
            assert probes["livenessProbe"] and probes["readinessProbe"], where
            for kind, probe in probes.items():
                if probe is None:
                    continue
                if "httpGet" in probe:
                    get = probe["httpGet"]
                    try:
                        resolve(get["path"])
                    except Resolver404:
                        pytest.fail(f"{where} {kind}: no view at {get['path']}")
                    [host] = [h["value"] for h in get.get("httpHeaders", []) if h["name"] == "Host"]
                    assert host in allowed_hosts.split(","), (where, kind, host)
                command = probe.get("exec", {}).get("command", [])
                if command[:3] == ["python", "-m", "elastic.liveness"]:
                    assert command[3] == env_value(container, "BUNGEE_LIVENESS_FILE", objects), (where, kind)
                    assert command[4] == "--max-age" and float(command[5]) > 0, (where, kind)
    portal = component(objects, "portal").containers(init=False)[0]
    assert portal["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert portal["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_agent_holds_gpus_sees_host_pids_and_drains_before_it_is_killed(objects: tuple[dict[str, Any], ...]) -> None:
    agent = component(objects, "agent")
    assert agent.workload["kind"] == "DaemonSet"
    spec = agent.spec
    assert spec["hostPID"] is True
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"]
    [container] = agent.containers()
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]

    drain = env_value(container, "BUNGEE_DRAIN_DEADLINE_S", objects)
    stop = env_value(container, "BUNGEE_STOP_GRACE_S", objects)
    assert drain is not None and stop is not None
    # After the deadline the workers get the stop grace to save: the kubelet's SIGKILL must wait
    # for both.
    assert spec["terminationGracePeriodSeconds"] > float(drain) + float(stop)

    address = "status.hostIP" if spec.get("hostNetwork") else "status.podIP"
    assert downward_fields(container)["BUNGEE_NODE_ADDRESS"] == address

    opportunistic = by_kind(objects, "PriorityClass")[spec["priorityClassName"]]
    assert opportunistic["value"] < 0 and opportunistic["preemptionPolicy"] == "Never"
    for name in ("portal", "worker", "beat"):
        control = by_kind(objects, "PriorityClass")[component(objects, name).spec["priorityClassName"]]
        assert control["value"] > opportunistic["value"]


def test_the_agent_registers_with_the_pool_token_under_a_name_per_pod(objects: tuple[dict[str, Any], ...]) -> None:
    """Every agent pod reads one pool token, the key `token` of a Secret mounted read-only, and
    no other Secret: no token per node. The node token a pool token's registration returns is
    kept in the state directory, an emptyDir that dies with the pod, and a pool token never
    registers a name a token holds: so the node's name carries the pod's, both from the downward
    API, after the prefix of the pool the docs' create_token names. Filled in with the longest
    Kubernetes node name the docs promise, it meets the portal's rule for node names; one
    character more does not."""
    agent = component(objects, "agent")
    [container] = agent.containers()
    secrets = {v["name"]: v["secret"] for v in agent.spec["volumes"] if "secret" in v}
    assert [secret["secretName"] for secret in secrets.values()] == ["bungee-agent-pool"]
    [(volume, secret)] = secrets.items()
    assert secret["items"] == [{"key": "token", "path": "token"}]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume]
    assert mount["readOnly"] is True
    assert env_value(container, "BUNGEE_AGENT_TOKEN_FILE", objects) == f"{mount['mountPath']}/token"
    assert not [v for v in container["env"] if "secretKeyRef" in v.get("valueFrom", {})]
    assert "BUNGEE_AGENT_TOKEN" not in {v["name"] for v in container["env"]}

    state_dir = env_value(container, "BUNGEE_AGENT_STATE_DIR", objects)
    [state] = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
    assert "emptyDir" in {v["name"]: v for v in agent.spec["volumes"]}[state["name"]]

    downward = downward_fields(container)
    name = env_value(container, "BUNGEE_NODE_NAME", objects)
    assert name is not None
    parts = {used: downward.get(used, "not the downward API") for used in VARIABLE.findall(name)}
    assert sorted(parts.values()) == ["metadata.name", "spec.nodeName"], parts
    docs = DOCS.read_text()
    found = re.search(r"manage\.py create_token ADMIN --role pool --pool (\S+)", docs)
    assert found is not None, f"no pool token made in {DOCS.name}"
    pool = found.group(1)
    assert re.fullmatch(POOL_NAME_PATTERN, pool), pool
    assert name.startswith(ApiToken(role=ApiToken.Role.POOL, pool=pool).node_prefix), (name, pool)

    promised = re.search(r"a Kubernetes node name of up to (\d+) characters", docs)
    assert promised is not None, f"{DOCS.name} says no longest Kubernetes node name"
    longest = int(promised.group(1))
    pod_name = f"{agent.workload['metadata']['name']}-x7k2p"  # a DaemonSet's pod: its name, -, 5 characters

    def registration(node_name: str, template: str = name) -> NodeRegistration:
        fields = {"spec.nodeName": node_name, "metadata.name": pod_name}
        filled = VARIABLE.sub(lambda m: fields[downward[m.group(1)]], template)
        return NodeRegistration(name=filled, address="10.0.0.7", backend="nvml", devices=[])

    registration("ip-10-0-1-23.eu-west-1.compute.internal")
    registration("g" * longest)
    with pytest.raises(ValidationError):
        registration("g" * (longest + 1))


def downward_fields(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables from the downward API, and the field each reads."""
    return {v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
            for v in container.get("env", []) if "fieldRef" in v.get("valueFrom", {})}


def test_exactly_one_beat_and_it_runs_the_migrations(objects: tuple[dict[str, Any], ...]) -> None:
    beat = component(objects, "beat")
    assert beat.workload["spec"]["replicas"] == 1
    assert beat.workload["spec"]["strategy"] == {"type": "Recreate"}
    [migrate] = beat.spec["initContainers"]
    assert migrate["command"] == ["python", "manage.py", "migrate", "--noinput"]
    for name in ("portal", "worker"):
        [wait] = component(objects, name).spec["initContainers"]
        assert "manage.py migrate --check" in wait["command"][-1]
        assert "manage.py migrate --noinput" not in " ".join(wait["command"])


def test_no_secret_has_a_value_and_every_secret_named_is_in_the_docs(objects: tuple[dict[str, Any], ...]) -> None:
    for item in objects:
        assert item["kind"] != "Secret", f"a Secret is made by the manifests: {item['metadata']['name']}"
        assert "data" not in item or item["kind"] == "ConfigMap", item["metadata"]
    for kustomization in KUBERNETES.rglob("kustomization.yaml"):
        assert "secretGenerator" not in yaml.safe_load(kustomization.read_text()), kustomization

    documented = documented_secrets()
    named: set[tuple[str, str | None]] = set()
    for pod in pods(objects):
        for volume in pod.spec.get("volumes", []):
            if "secret" in volume:
                secret = volume["secret"]
                named |= {(secret["secretName"], item["key"]) for item in secret.get("items", [])}
                named.add((secret["secretName"], None))
        for container in pod.containers():
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    named.add((ref["name"], ref["key"]))
            for source in container.get("envFrom", []):
                assert "secretRef" not in source, "envFrom a Secret hides a missing key: name each key"
    for ingress in by_kind(objects, "Ingress").values():
        named |= {(tls["secretName"], None) for tls in ingress["spec"].get("tls", [])}
    assert named
    for name, key in named:
        assert name in documented, f"Secret {name} is not in the table of {DOCS.name}"
        assert key is None or key in documented[name], f"key {key} of Secret {name} is not in {DOCS.name}"
        assert re.search(rf"kubectl -n bungee create secret \w+ {name} ", DOCS.read_text()), f"how to make {name}"


def documented_secrets() -> dict[str, set[str]]:
    """The docs' table of Secrets: `| \\`name\\` | \\`KEY\\`, ... | ... |` rows."""
    secrets: dict[str, set[str]] = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`bungee-[a-z-]+`", cells[0]):
            secrets[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return secrets


def test_one_image_for_bungee_and_the_stores_of_docker_compose(objects: tuple[dict[str, Any], ...]) -> None:
    bungee = {container["image"] for pod in pods(objects) if pod.component in BUNGEE_COMPONENTS
              for container in pod.containers()}
    assert len(bungee) == 1, bungee
    for pod in pods(objects):
        if pod.component in ("postgres", "redis"):
            assert [c["image"] for c in pod.containers()] == [COMPOSE["services"][pod.component]["image"]]


def test_every_name_referred_to_is_defined(objects: tuple[dict[str, Any], ...]) -> None:
    config_maps = by_kind(objects, "ConfigMap")
    claims = by_kind(objects, "PersistentVolumeClaim")
    services = by_kind(objects, "Service")
    priorities = by_kind(objects, "PriorityClass")
    for pod in pods(objects):
        labels = pod.workload["spec"]["template"]["metadata"]["labels"]
        assert pod.workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), pod.name
        assert pod.spec["priorityClassName"] in priorities, pod.name
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, pod.name
        if pod.workload["kind"] == "StatefulSet":
            assert pod.workload["spec"]["serviceName"] in services, pod.name
        for container in pod.containers():
            where = f"{pod.name} {container['name']}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, (where, mount)
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, where
            defined: set[str] = {n for s in container.get("envFrom", []) for n in config_maps[s["configMapRef"]["name"]]["data"]}
            for variable in container.get("env", []):
                for used in VARIABLE.findall(variable.get("value", "")):
                    assert used in defined, f"{where}: {variable['name']} uses $({used}) before it is defined"
                defined.add(variable["name"])
            for used in VARIABLE.findall(" ".join(container.get("command", []) + container.get("args", []))):
                assert used in defined, f"{where}: its command uses $({used}), which it does not define"
    for service in services.values():
        selector = service["spec"]["selector"].items()
        assert any(selector <= pod.workload["spec"]["template"]["metadata"]["labels"].items()
                   for pod in pods(objects)), service["metadata"]["name"]
    for ingress in by_kind(objects, "Ingress").values():
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] in services


def test_every_setting_is_one_the_code_reads(objects: tuple[dict[str, Any], ...]) -> None:
    """A mistyped key would be ignored without a word: each key of the ConfigMap is read by the
    portal's code or used by a command of the manifests."""
    sources = "\n".join(path.read_text() for folder in ("portal", "agent", "elastic") for path in (ROOT / folder).rglob("*.py"))
    commands = " ".join(" ".join(c.get("command", [])) for pod in pods(objects) for c in pod.containers())
    for config_map in by_kind(objects, "ConfigMap").values():
        for key in config_map["data"]:
            assert f'"{key}"' in sources or f"$({key})" in commands, f"{key} is read by nothing"


def test_the_commands_are_those_of_docker_compose(objects: tuple[dict[str, Any], ...]) -> None:
    """The processes start as docker-compose.yml starts them, but for the one-process portal
    (pods scale it), the queue's variable, and beat's liveness scheduler and schedule file."""
    def expanded(container: dict[str, Any]) -> list[str]:
        return [VARIABLE.sub(lambda m: str(env_value(container, m.group(1), objects)), part)
                for part in container["command"]]

    services = COMPOSE["services"]
    [worker] = component(objects, "worker").containers(init=False)
    assert expanded(worker) == services["worker"]["command"]
    [beat] = component(objects, "beat").containers(init=False)
    compose_beat = services["beat"]["command"]
    schedule = compose_beat.index("-s") + 1
    assert expanded(beat) == [*compose_beat[:schedule], beat["command"][schedule], *compose_beat[schedule + 1:],
                              "-S", "portal.liveness:LivenessScheduler"]
    [portal] = component(objects, "portal").containers(init=False)
    assert portal["command"][:4] == ["python", "-m", "uvicorn", "portal.asgi:application"]
    assert "--workers" not in portal["command"]
    [agent] = component(objects, "agent").containers(init=False)
    assert agent["command"] == services["agent"]["command"][:3]
    assert env_value(agent, "BUNGEE_DEVICE_BACKEND", objects) == "nvml"
    assert env_value(agent, "BUNGEE_PORTAL_URL", objects) == "http://bungee-portal:8000"


def test_the_beat_scheduler_and_the_probe_module_exist() -> None:
    """What the manifests name by module: beat's -S class and the exec probes' module."""
    from celery.beat import PersistentScheduler

    from elastic import liveness
    from portal.liveness import LivenessScheduler

    assert issubclass(LivenessScheduler, PersistentScheduler)
    assert callable(liveness.main)
    assert Path(liveness.__file__).is_file()
