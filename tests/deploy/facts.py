"""What deployment files are checked against: the settings, routes and metrics the server really has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from linserve.server.api.common.metrics import Metrics
from linserve.server.app import create_app
from linserve.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def server_routes() -> set[str]:
    """Every path the app serves (routes of included routers too)."""
    def paths(routes) -> set[str]:
        found = set()
        for route in routes:
            included = getattr(route, "original_router", None)
            if included is not None:
                found |= paths(included.routes)
            elif hasattr(route, "path"):
                found.add(route.path)
        return found

    return paths(create_app(Settings()).routes)


@pytest.fixture(scope="session")
def exported_metrics() -> dict[str, set[str]]:
    """Every series name /metrics exports (a histogram's _bucket/_sum/_count, a counter's _total) → its labels."""
    metrics = Metrics()
    names: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if not hasattr(metric, "_labelnames"):
            continue
        labels = set(metric._labelnames)
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(metric._type, ("",))
        for suffix in suffixes:
            names[metric._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    for family in metrics.registry.collect():  # the custom collectors' (process, ITL by context) as they render
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def settings_env_names() -> set[str]:
    return {f"LINSERVE_{name.upper()}" for name in Settings.model_fields}


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(linserve_[a-z0-9_]+|process_[a-z0-9_]+)\b", expr))
