"""The compose stack, haproxy, Prometheus and Grafana files reference only what exists: files, services, ports,
settings, routes, and metrics with their exact names and labels (the real programs run in test_stack.py)."""

from __future__ import annotations

import json
import re

import yaml

from tests.deploy.facts import ROOT, metric_names_in, settings_env_names

DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
REPLICAS = sorted(name for name, service in SERVICES.items() if service.get("image", "").startswith("linserve"))
DASHBOARD = json.loads((DOCKER / "grafana" / "linserve.json").read_text())


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]


def test_the_stack_has_replicas_redis_balancer_prometheus_grafana():
    assert len(REPLICAS) >= 2
    assert {"redis", "lb", "prometheus", "grafana"} <= set(SERVICES)
    ports = {name: service.get("ports", []) for name, service in SERVICES.items()}
    assert "8000:8000" in ports["lb"] and "3000:3000" in ports["grafana"] and "9090:9090" in ports["prometheus"]
    assert all(not ports[name] for name in REPLICAS)  # replicas are reached through the balancer only


def test_files_the_stack_mounts_or_builds_exist():
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name}: named volume {source}"


def test_replica_settings_are_real_settings_and_point_at_the_stacks_redis():
    for name in REPLICAS:
        environment = SERVICES[name]["environment"]
        assert set(environment) <= settings_env_names(), name
        store = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", environment["LINSERVE_SESSION_STORE"])
        assert store and store[1] in SERVICES and store[2] == "6379"
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_haproxy_hashes_sessions_over_every_replica_with_ready_checks(server_routes):
    """Consistent hashing on the affinity key (session id, X-Session-Id, a create's Idempotency-Key; round robin
    without one) — no cookies or source stickiness: a moved session resumes from Redis (tests/docker/test_stack)."""
    config = (DOCKER / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server\s+(\S+)\s+([\w-]+):(\d+)", config, re.M)
    assert sorted(host for _, host, _ in servers) == REPLICAS and {port for *_, port in servers} == {"8000"}
    assert re.search(r"^\s*balance\s+hdr\(X-Linserve-Affinity\)", config, re.M)
    assert re.search(r"^\s*hash-type\s+consistent\s*$", config, re.M)
    assert not re.search(r"^\s*(stick|cookie|balance\s+source)", config, re.M)
    check = re.search(r"option httpchk GET (\S+)", config)[1]
    assert check == "/ready" and check in server_routes
    assert re.search(r"^\s*bind\s+:8000\s*$", config, re.M)


def test_prometheus_scrapes_every_replica():
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert sorted(targets) == [f"{name}:8000" for name in REPLICAS] and job["metrics_path"] == "/metrics"


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard():
    provisioning = DOCKER / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "linserve.yaml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert mounts["./grafana/linserve.json"].rsplit("/", 1)[0] == provider["options"]["path"]
    assert (
        SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        == mounts["./grafana/linserve.json"]
    )
    uids = {t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


def test_every_dashboard_query_names_exported_metrics_and_labels(exported_metrics):
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        names = metric_names_in(expr)
        assert names and names <= set(exported_metrics), expr
        labels = set(re.findall(r"by \(([^)]*)\)", expr))
        used = {label.strip() for group in labels for label in group.split(",")} | set(re.findall(r"(\w+)!?=\"", expr))
        known = set().union(*(exported_metrics[n] for n in names)) | {"instance", "job"}
        assert used <= known, (expr, used - known)


def test_the_dashboard_has_the_panels_operators_look_for():
    titles = " | ".join(panel["title"].lower() for panel in DASHBOARD["panels"])
    for words in (
        "inter-token latency by context",
        "time to first token",
        "end-to-end",
        "tokens/s",
        "running",
        "sessions by tier",
        "state pool bytes",
        "queue wait",
        "prefix-cache hit rate",
        "requests by",
    ):
        assert words in titles, words
    itl = DASHBOARD["panels"][0]["targets"]
    assert [t["expr"].split(",")[0] for t in itl] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
    assert all("by (le, context)" in t["expr"] for t in itl)  # one line per context bucket
