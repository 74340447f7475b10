"""The HTTP side's shape: one package per endpoint family, and a family imports only `api/common/` (and the layers
below it), never another family — what two families share lives in common/ (the completion request and its
serving for /v1/completions and a session's completions; chat messages and their rendering)."""

from __future__ import annotations

from pathlib import Path

from tests.server.engine.test_structure import imports_of

API = Path(__file__).resolve().parents[3] / "server" / "api"
FAMILIES = sorted(p.name for p in API.iterdir() if p.is_dir() and p.name not in ("common", "__pycache__"))


def test_every_endpoint_family_imports_only_common():
    assert {"chat", "completions", "models", "responses", "sessions", "web"} <= set(FAMILIES)
    crossing = {}
    for family in FAMILIES:
        for path in (API / family).rglob("*.py"):
            others = sorted(m for m in imports_of(path) for other in FAMILIES
                            if other != family and m.startswith(f"linserve.server.api.{other}"))
            if others:
                crossing[str(path.relative_to(API))] = others
    assert not crossing, crossing


def test_common_imports_no_family():
    for path in (API / "common").rglob("*.py"):
        reached = [m for m in imports_of(path) for family in FAMILIES if m.startswith(f"linserve.server.api.{family}")]
        assert not reached, (path.name, reached)
