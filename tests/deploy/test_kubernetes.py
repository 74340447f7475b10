"""deploy/kubernetes: every manifest is valid against the Kubernetes schemas (strict: a misspelt field fails),
and they reference only what exists — kustomize resources, the image's port and user, real settings, probe
routes the server serves, the Redis and Prometheus services, and the metric the autoscaler reads."""

from __future__ import annotations

import re

import kubernetes_validate
import yaml

from tests.deploy.facts import ROOT, metric_names_in, settings_env_names

KUBE = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
DOCS = [doc for name in KUSTOMIZATION["resources"] for doc in yaml.safe_load_all((KUBE / name).read_text()) if doc]
BY_KIND: dict[str, dict[str, dict]] = {}
for _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], {})[_doc["metadata"]["name"]] = _doc
VERSION = "1.33.0"  # a supported, widely deployed release; the manifests use only stable APIs


def container(name: str = "linserve") -> dict:
    (only,) = BY_KIND["Deployment"][name]["spec"]["template"]["spec"]["containers"]
    return only


def test_kustomization_lists_every_manifest_and_each_is_schema_valid():
    files = sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(KUSTOMIZATION["resources"]) == files
    for doc in DOCS:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: checked field by field below
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_selectors_match_their_pods_and_services_name_real_ports():
    for kind in ("Deployment", "StatefulSet"):
        for name, workload in BY_KIND[kind].items():
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, service in BY_KIND["Service"].items():
        workload = next(w for kind in ("Deployment", "StatefulSet") for w in BY_KIND[kind].values()
                        if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items())
        port_names = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, name


def test_the_linserve_pods_probe_real_routes_with_real_settings(server_routes):
    pod = BY_KIND["Deployment"]["linserve"]["spec"]["template"]["spec"]
    linserve = container()
    assert (
        linserve["readinessProbe"]["httpGet"]["path"] == "/ready"
        and linserve["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    assert {"/ready", "/health", "/metrics"} <= server_routes
    env = {e["name"]: e["value"] for e in linserve["env"]}
    assert set(env) <= settings_env_names()
    assert linserve["ports"][0]["containerPort"] == int(env["LINSERVE_PORT"]) == 8000
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "EXPOSE 8000" in dockerfile
    assert re.search(r"--uid (\d+) linserve", dockerfile)[1] == str(pod["securityContext"]["runAsUser"])
    assert pod["terminationGracePeriodSeconds"] >= 30  # long enough to drain streams and flush session writes
    assert linserve["resources"]["requests"] and linserve["resources"]["limits"]["memory"]
    # flags passed to `linserve serve` are real ones
    from linserve.server.cli import build_parser

    build_parser().parse_args(["serve", *linserve["args"]])
    assert KUSTOMIZATION["images"][0]["name"] == linserve["image"]


def test_sessions_live_in_the_redis_service():
    env = {e["name"]: e["value"] for e in container()["env"]}
    host, port = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", env["LINSERVE_SESSION_STORE"]).groups()
    service = BY_KIND["Service"][host]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert "redis" in BY_KIND["StatefulSet"]


def test_the_autoscaler_scales_the_deployment_on_requests_waiting_from_this_prometheus(exported_metrics):
    (scaled,) = BY_KIND["ScaledObject"].values()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] in BY_KIND["Deployment"]
    assert scaled["spec"]["minReplicaCount"] >= 1 < scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    assert metric_names_in(query) == {"linserve_requests_waiting"} <= set(exported_metrics)
    host, namespace, port = re.fullmatch(
        r"http://([\w-]+)\.([\w-]+)\.svc:(\d+)", trigger["metadata"]["serverAddress"]
    ).groups()
    assert namespace == KUSTOMIZATION["namespace"]
    assert int(port) in {p["port"] for p in BY_KIND["Service"][host]["spec"]["ports"]}
    # the query's label selector is a label this Prometheus puts on linserve's series
    config = yaml.safe_load(BY_KIND["ConfigMap"]["prometheus"]["data"]["prometheus.yml"])
    targets = {rule.get("target_label") for job in config["scrape_configs"] for rule in job["relabel_configs"]}
    selector = dict(re.findall(r'(\w+)="([^"]*)"', query))
    assert set(selector) <= targets
    pod_labels = BY_KIND["Deployment"]["linserve"]["spec"]["template"]["metadata"]["labels"]
    assert selector["app"] == pod_labels["app.kubernetes.io/name"]
    annotations = BY_KIND["Deployment"]["linserve"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


def routing_rules(config: str) -> list[str]:
    rules = [line.split("#")[0].strip() for line in config.splitlines()]
    return [r for r in rules if r.startswith(("http-request", "balance", "hash-type", "retry-on", "option redispatch"))]


def test_the_router_hashes_sessions_as_the_compose_balancer_does_and_finds_every_replica(tmp_path):
    """Issue 31: the in-cluster router is haproxy with docker/haproxy.cfg's affinity rules (the same lines), a
    valid configuration to haproxy itself, and its replicas are the headless Service's ready linserve pods."""
    from tests.helpers import require_program

    config = BY_KIND["ConfigMap"]["linserve-router"]["data"]["haproxy.cfg"]
    compose = (ROOT / "docker" / "haproxy.cfg").read_text()
    assert routing_rules(config) == routing_rules(compose) and any("balance hdr(" in r for r in routing_rules(config))
    (tmp_path / "haproxy.cfg").write_text(config)
    haproxy = require_program("haproxy", "haproxy")
    import subprocess

    checked = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    template = re.search(r"server-template \S+ \d+ ([\w-]+):(\d+)", config)
    headless = BY_KIND["Service"][template[1]]
    assert headless["spec"]["clusterIP"] == "None" and int(template[2]) == headless["spec"]["ports"][0]["port"]
    assert headless["spec"]["selector"].items() <= (
        BY_KIND["Deployment"]["linserve"]["spec"]["template"]["metadata"]["labels"].items())
    router = BY_KIND["Deployment"]["linserve-router"]["spec"]["template"]["spec"]
    mount = router["containers"][0]["volumeMounts"][0]["mountPath"]
    assert router["containers"][0]["args"] == ["-f", f"{mount}/haproxy.cfg"]
    assert re.search(r"bind :(\d+)", config)[1] == str(router["containers"][0]["ports"][0]["containerPort"])
