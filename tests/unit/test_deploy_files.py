"""Static checks of deploy/: nothing there can run in CI, so every file is validated.

Schemas come from maintained validators that ship them offline: check-jsonschema's
vendored compose-spec for the compose file, kubernetes-validate's Kubernetes schemas
for the manifests. On top of the schemas, the wiring between files is checked: the
dashboard queries only metrics the stages register, Prometheus scrapes exactly the
compose services that serve metrics, and the probes, ports, labels and variables of
the manifests refer to things that exist: for the gateway, each replica is named after
its pod and its flags parse with the gateway's own parser, and the router reaches every
replica by the names the StatefulSet gives them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from pipeline.auth.credentials import AGENT_KEY_FILE, ROLE_FILES, Role
from pipeline.auth.gate import PUBLIC, ROLLOUT_PARAM
from pipeline.commands import gateway as gateway_command
from pipeline.gateway.app import gateway_policy
from pipeline.gateway.main import GatewayConfig
from pipeline.gateway.settings import GatewaySettings
from pipeline.kafka.retention import ROLES, retention_from_args, retention_setting
from pipeline.process.flags import from_flags
from pipeline.stagehost.metrics import StageMetrics
from stages.ledger.stage import LedgerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # oldest and newest Kubernetes the manifests are held to
STAGES = ("tokentrail-ledger", "tokentrail-finalizer")  # the stage StatefulSets
GRAFANA_VARIABLES = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")


_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry can expose, with or without samples yet.

    A dashboard or alert may query any of these (``_bucket`` of a histogram, ``_total``
    of a counter); anything else it names does not exist.
    """
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return document


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml_documents(path):
            yield path, doc


def manifest(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def flag(args: list[str] | str, name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in an argument list or shell line."""
    words = shlex.split(args) if isinstance(args, str) else args
    for i, word in enumerate(words):
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(words):
            return words[i + 1]
    return None


def command_words(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(" ".join(command) if isinstance(command, list) else command)


# -- every file -------------------------------------------------------------------


def test_every_deploy_file_parses_and_is_documented() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    readme = (DEPLOY / "README.md").read_text()
    for path in files:
        relative = path.relative_to(DEPLOY.parent).as_posix()
        if path.suffix in {".yaml", ".yml"}:
            assert yaml_documents(path), f"{relative} has no YAML document"
        elif path.suffix == ".json":
            json.loads(path.read_text())
        if path.name != "README.md":
            assert f"`{relative}`" in readme, f"deploy/README.md does not name {relative}"


# -- compose ------------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_compose_matches_the_compose_spec(tmp_path: Path) -> None:
    result = check_compose(DEPLOY / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    broken = compose()
    broken["services"]["ledger"]["replica_count"] = 2  # not a compose key: must be refused
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert check_compose(tmp_path / "compose.yaml").returncode != 0


def test_compose_wiring() -> None:
    document = compose()
    services: dict[str, Any] = document["services"]
    assert {"kafka", "ray-head", "ledger", "finalizer", "prometheus", "grafana"} <= services.keys()
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in document.get("volumes", {}), f"{name} mounts undeclared volume {source}"
        build = service.get("build")
        if build is not None:
            context = DEPLOY / build["context"]
            assert (context / build["dockerfile"]).is_file()
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    for stage in ("ledger", "finalizer"):
        service = services[stage]
        assert service["deploy"]["replicas"] >= 2
        words = command_words(service)
        assert ["stage", stage] == words[words.index("stage") : words.index("stage") + 2]
        port = flag(words, "--metrics-port")
        assert port is not None and flag(words, "--metrics-host") == "0.0.0.0"
        assert f":{port}/healthz" in " ".join(service["healthcheck"]["test"])
    assert "transferqueue_head.py" in " ".join(command_words(services["ray-head"]))


def metrics_ports() -> dict[str, int]:
    """Compose services that serve metrics, and on which port."""
    ports: dict[str, int] = {}
    for name, service in compose()["services"].items():
        port = flag(command_words(service), "--metrics-port")
        if port is not None:
            ports[name] = int(port)
    return ports


def test_prometheus_scrapes_every_metrics_service_of_compose() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                scraped[name] = sd["port"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[host] = int(port)
    assert scraped == metrics_ports()


# -- Grafana -----------------------------------------------------------------------


def dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana's variables taken as 5m)."""
    parsed = promql_parser.parse(GRAFANA_VARIABLES.sub("5m", expr))
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(parsed, visit)
    return names


def test_metric_names_are_read_from_the_expressions() -> None:
    expr = 'sum by (le) (rate(a_bucket{x="1"}[$__rate_interval])) / on() group_left b + c_total offset 5m'
    assert metric_names(expr) == {"a_bucket", "b", "c_total"}


def test_dashboard_queries_only_registered_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "tokentrail.json").read_text())
    registered = exposed_names(StageMetrics("ledger").registry) | exposed_names(
        StageMetrics("finalizer").registry
    )
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = datasource["datasources"][0]["uid"]
    used: set[str] = set()
    for panel in dashboard_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], f"panel {panel['title']} has no query"
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            unknown = {n for n in names if n.startswith("tokentrail_")} - registered
            assert not unknown, f"panel {panel['title']} queries unknown metrics {sorted(unknown)}"
            used |= names
    for needed in (  # lag, throughput, latency, rejections
        "tokentrail_consumer_lag",
        "tokentrail_stage_events_in_total",
        "tokentrail_stage_events_out_total",
        "tokentrail_seal_to_finalized_seconds_bucket",
        "tokentrail_rollouts_finalized_total",
        "tokentrail_receipts_poisoned_total",
    ):
        assert needed in used


def test_grafana_provisioning_finds_the_dashboard() -> None:
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tokentrail.yaml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/tokentrail.json:{folder}/tokentrail.json:ro" in mounts


# -- Kubernetes ------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kinds = set()
    for path, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']}: {exc}")
        kinds.add(doc["kind"])
    assert {"ConfigMap", "Deployment", "Service", "StatefulSet", "NetworkPolicy"} <= kinds


def test_the_kubernetes_validator_refuses_a_broken_manifest() -> None:
    deployment = next(doc for _, doc in manifests() if doc["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_manifest_wiring() -> None:
    docs = [doc for _, doc in manifests()]
    config = manifest("ConfigMap", "tokentrail")
    service = manifest("Service", "tokentrail-stages-metrics")
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"} == {"tokentrail-gateway-router"}
    for name in STAGES:
        stage = manifest("StatefulSet", name)
        pod = stage["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert stage["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert stage["spec"]["serviceName"] == service["metadata"]["name"], name
        assert service["spec"]["selector"].items() <= labels.items(), f"the metrics Service misses {name}"
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert service["spec"]["ports"][0]["targetPort"] in ports
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, f"{name} {probe}"
        words = [*container.get("command", []), *container["args"]]
        line = " ".join(words)
        assert flag(shlex.split(line), "--metrics-port") == str(ports["metrics"])
        assert {ref["configMapRef"]["name"] for ref in container["envFrom"]} == {config["metadata"]["name"]}
        from_pod = field_refs(container)
        member = re.fullmatch(r"\$\((\w+)\)", flag(shlex.split(line), "--instance-id") or "")
        assert member and from_pod.get(member.group(1)) == "metadata.name", (
            f"{name}: --instance-id must be the pod's name, stable across its restarts (a static member)"
        )
        for variable in re.findall(r"\$\((\w+)\)", line):
            assert variable in config["data"] or variable in from_pod, (
                f"{name} uses $({variable}), defined nowhere"
            )


def retention_settings(words: list[str], variables: dict[str, str]) -> list[tuple[str, int]]:
    """Every ``--retention`` of a command line, ``$(VAR)`` read from ``variables``, parsed as the CLI does."""
    values = [
        word.split("=", 1)[1] if word.startswith("--retention=") else words[i + 1]
        for i, word in enumerate(words)
        if word.startswith("--retention=") or word == "--retention"
    ]
    return [retention_setting(re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], v)) for v in values]


def test_both_stages_keep_every_topic_as_long_as_the_pipeline_needs() -> None:
    """Compose and Kubernetes set every topic's retention, the same in both stages (a stage
    reports another retention on existing topics at every start), never below --max-open
    plus 1h (the stage would refuse to start)."""
    lines = [command_words(compose()["services"][stage]) for stage in ("ledger", "finalizer")]
    config = manifest("ConfigMap", "tokentrail")["data"]
    for name in STAGES:
        (container,) = manifest("StatefulSet", name)["spec"]["template"]["spec"]["containers"]
        lines.append(shlex.split(" ".join([*container.get("command", []), *container["args"]])))
    seen = set()
    for words in lines:
        settings = retention_settings(words, config)
        assert sorted(role for role, _ in settings) == sorted(ROLES), words
        retention = retention_from_args(settings)
        max_open = float(flag(words, "--max-open") or LedgerConfig().max_open_s)
        assert retention.shortfalls(max_open) == []
        seen.add(retention)
    assert len(seen) == 1, "the stages ask for different retentions"


# -- the gateway on Kubernetes ------------------------------------------------------

GATEWAY = "tokentrail-gateway"  # the StatefulSet of replicas, and the Service agents call (the router's)
ROUTER = "tokentrail-gateway-router"  # nginx: its Deployment and its ConfigMap


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels``, ``matchExpressions`` with ``In``) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def pod_labels(kind: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = manifest(kind, name)["spec"]["template"]["metadata"]["labels"]
    return labels


def field_refs(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables taken from the pod (downward API), and the field of each."""
    return {
        env["name"]: env["valueFrom"]["fieldRef"]["fieldPath"]
        for env in container.get("env", [])
        if "fieldRef" in env.get("valueFrom", {})
    }


def expanded(words: list[str], variables: dict[str, str]) -> list[str]:
    """``$(VAR)`` replaced as the kubelet does; a variable defined nowhere fails the test."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in variables, f"$({match.group(1)}) is defined nowhere"
        return variables[match.group(1)]

    return [re.sub(r"\$\((\w+)\)", value, word) for word in words]


def gateway_arguments(words: list[str]) -> argparse.Namespace:
    """``words`` (``gateway ...``) parsed by the real ``tokentrail gateway`` parser."""
    parser = argparse.ArgumentParser(prog="tokentrail")
    gateway_command.add_parser(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(words)


def nginx_conf() -> str:
    text: str = manifest("ConfigMap", ROUTER)["data"]["nginx.conf"]
    return text


def test_every_gateway_replica_is_named_after_its_pod() -> None:
    statefulset = manifest("StatefulSet", GATEWAY)
    labels = pod_labels("StatefulSet", GATEWAY)
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "gateway"
    assert {ref["configMapRef"]["name"] for ref in container["envFrom"]} == {"tokentrail"}
    replica = re.fullmatch(r"\$\((\w+)\)", flag(container["args"], "--replica") or "")
    assert replica is not None, "--replica must be $(VAR) of the pod's name"
    assert field_refs(container).get(replica.group(1)) == "metadata.name", "--replica must be the pod's name"
    config = manifest("ConfigMap", "tokentrail")["data"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (ledger,) = manifest("StatefulSet", "tokentrail-ledger")["spec"]["template"]["spec"]["containers"]
    names = set()
    for ordinal in range(statefulset["spec"]["replicas"]):
        pod = f"{GATEWAY}-{ordinal}"  # a StatefulSet's pod names
        args = gateway_arguments(expanded(container["args"], {**config, replica.group(1): pod}))
        settings = from_flags(GatewaySettings, args)
        config_of_replica = GatewayConfig(workers=settings.worker_urls, replica=settings.replica)
        names.add(config_of_replica.replica)
        assert settings.port == ports["http"] and settings.host == "0.0.0.0"
        assert settings.max_open_s == float(flag(ledger["args"], "--max-open") or LedgerConfig().max_open_s)
    assert len(names) == statefulset["spec"]["replicas"], "two replicas share a name (and a bookmark)"


def test_gateway_probes_and_credentials_are_what_the_gateway_serves_and_reads() -> None:
    pod = manifest("StatefulSet", GATEWAY)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    policy = gateway_policy()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert policy.get(get["path"]) == PUBLIC, f"{probe}: the gateway serves no public {get['path']}"
        assert get["port"] == "http"
    directory = flag(container["args"], "--credentials-dir")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    needed = {ROLE_FILES[role] for role in (Role.ENVIRONMENT, Role.OPERATOR, Role.SERVICE)} | {AGENT_KEY_FILE}
    assert {item["path"] for item in secret["items"]} == needed  # and not api.key
    context = pod["securityContext"]  # the Secret's files are the group's: the user must be in it
    assert secret["defaultMode"] & 0o040 and context["fsGroup"] == context["runAsUser"]


def test_the_router_sends_each_rollout_to_one_replica_by_its_id() -> None:
    statefulset = manifest("StatefulSet", GATEWAY)
    headless = manifest("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert headless["spec"]["selector"].items() <= pod_labels("StatefulSet", GATEWAY).items()
    (gateway,) = statefulset["spec"]["template"]["spec"]["containers"]
    (port,) = headless["spec"]["ports"]
    assert port["port"] == {p["name"]: p["containerPort"] for p in gateway["ports"]}[port["targetPort"]]
    conf = nginx_conf()
    upstream = re.search(r"^\s*upstream (\w+) \{(.*?)^\s*\}", conf, re.M | re.S)
    assert upstream is not None
    name, body = upstream.groups()
    assert re.search(r"^\s*hash \$rollout consistent;", body, re.M)
    servers = re.findall(r"^\s*server (\S+)", body, re.M)
    assert servers == [
        f"{GATEWAY}-{i}.{headless['metadata']['name']}.${{POD_NAMESPACE}}.svc.cluster.local:{port['port']}"
        for i in range(statefulset["spec"]["replicas"])
    ], "the upstream must list every replica of the StatefulSet, at its port"
    assert f"proxy_pass http://{name};" in conf
    assert "proxy_set_header Host $http_host;" in conf  # the base URLs a new rollout gets name the router
    # The map takes the id out of every route of one rollout, and out of no other route.
    (rollout_map,) = re.findall(r"map \$uri \$rollout \{(.*?)\}", conf, re.S)
    (pattern,) = re.findall(r"^\s*~(\S+) \$1;", rollout_map, re.M)
    placeholder = "{" + ROLLOUT_PARAM + "}"
    for path in gateway_policy():
        match = re.match(pattern, path.replace(placeholder, "rollout-7"))
        if placeholder in path:
            assert match is not None and match.group(1) == "rollout-7", path
        else:
            assert match is None, f"{path} would be routed by a rollout id"


def test_the_router_runs_the_config_it_is_given() -> None:
    router = manifest("Deployment", ROUTER)
    assert router["spec"]["selector"]["matchLabels"].items() <= pod_labels("Deployment", ROUTER).items()
    pod = router["spec"]["template"]["spec"]
    (nginx,) = pod["containers"]
    image, tag = nginx["image"].split(":")
    assert image == "nginx" and tuple(map(int, tag.split("."))) >= (1, 27, 3)  # `resolve` in an upstream
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == ROUTER]
    (mount,) = [m for m in nginx["volumeMounts"] if m["name"] == volume["name"]]
    line = " ".join(nginx["args"])
    assert f"< {mount['mountPath']}/nginx.conf " in line and "envsubst '$POD_NAMESPACE'" in line
    assert field_refs(nginx) == {"POD_NAMESPACE": "metadata.namespace"}
    ports = {p["name"]: p["containerPort"] for p in nginx["ports"]}
    assert sorted(int(p) for p in re.findall(r"listen (\d+);", nginx_conf())) == sorted(ports.values())
    for probe in ("livenessProbe", "readinessProbe"):
        get = nginx[probe]["httpGet"]
        served = rf"listen {ports[get['port']]};\s*location = {get['path']} \{{\s*return 200"
        assert re.search(served, nginx_conf()), f"{probe}: nginx serves no {get['path']} on that port"
    service = manifest("Service", GATEWAY)
    assert service["spec"]["selector"].items() <= pod_labels("Deployment", ROUTER).items()
    assert [ports[p["targetPort"]] for p in service["spec"]["ports"]] == [ports["http"]]


def test_agents_reach_the_router_and_only_the_router_reaches_the_replicas() -> None:
    policies = [doc["spec"] for _, doc in manifests() if doc["kind"] == "NetworkPolicy"]

    def admitted(source: dict[str, str], target: dict[str, str], port: int) -> bool:
        chosen = [p for p in policies if selects(p["podSelector"], target)]
        assert chosen, f"no policy (not even deny-by-default) covers {target}"
        return any(
            any(selects(peer.get("podSelector", {}), source) for peer in rule.get("from", [{}]))
            and any(p["port"] == port for p in rule.get("ports", [{"port": port}]))
            for policy in chosen
            for rule in policy.get("ingress", [])
        )

    sandbox = {"tokentrail.io/role": "agent-sandbox"}
    environment = {"tokentrail.io/role": "environment"}
    gateway, router = pod_labels("StatefulSet", GATEWAY), pod_labels("Deployment", ROUTER)
    gateway_port = manifest("Service", f"{GATEWAY}-replicas")["spec"]["ports"][0]["port"]
    router_port = manifest("Service", GATEWAY)["spec"]["ports"][0]["port"]
    assert admitted(sandbox, router, router_port) and admitted(environment, router, router_port)
    assert admitted(router, gateway, gateway_port)
    assert not admitted(sandbox, gateway, gateway_port), "agents must not bypass the routing by rollout id"
    assert not admitted(environment, gateway, gateway_port)
    for url in manifest("ConfigMap", "tokentrail")["data"]["TOKENTRAIL_WORKERS"].split(","):
        port = urlsplit(url).port
        assert port is not None and admitted(gateway, {"app.kubernetes.io/component": "worker"}, port), url


# -- image -----------------------------------------------------------------------


def test_dockerfile_copies_what_exists_and_exposes_the_metrics_port() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    for line in lines:
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (DEPLOY.parent / source).exists(), f"Dockerfile copies missing {source}"
    assert "EXPOSE 9464" in lines
    assert set(metrics_ports().values()) == {9464}
