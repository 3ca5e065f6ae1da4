"""Static checks of deploy/: nothing there can run in CI, so every file is validated.

Schemas come from maintained validators that ship them offline: check-jsonschema's
vendored compose-spec for the compose file, kubernetes-validate's Kubernetes schemas
for the manifests. On top of the schemas, the wiring between files is checked: the
dashboard queries only metrics the stages register, Prometheus scrapes exactly the
compose services that serve metrics, and the probes, ports, labels and variables of
the manifests refer to things that exist.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from pipeline.kafka.retention import ROLES, retention_from_args, retention_setting
from pipeline.stagehost.metrics import StageMetrics
from stages.ledger.stage import LedgerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # oldest and newest Kubernetes the manifests are held to
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
    assert {"ConfigMap", "Deployment", "Service"} <= kinds


def test_the_kubernetes_validator_refuses_a_broken_manifest() -> None:
    deployment = next(doc for _, doc in manifests() if doc["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_manifest_wiring() -> None:
    docs = [doc for _, doc in manifests()]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    service = next(d for d in docs if d["kind"] == "Service")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"tokentrail-ledger", "tokentrail-finalizer"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
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
        for variable in re.findall(r"\$\((\w+)\)", line):
            assert variable in config["data"], f"{name} uses $({variable}), which the ConfigMap lacks"


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
    docs = [doc for _, doc in manifests()]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
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
