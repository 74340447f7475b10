"""The engine's shape: plain objects composed in the Engine's constructor (no mixins), and an import graph
without cycles — TYPE_CHECKING imports included — in which nothing points back up to the server."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[3] / "server" / "engine"


def module_name(path: Path) -> str:
    parts = ("linserve", *path.relative_to(ENGINE.parent.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every linserve.server.* module `path` imports, at any depth of the file (functions, TYPE_CHECKING blocks)."""
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            found |= {c for c in candidates if c.startswith("linserve.server.")}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("linserve.server.")}
    return found


def test_the_engine_import_graph_has_no_cycle_and_never_points_up():
    modules = {module_name(p): p for p in ENGINE.rglob("*.py")}
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    upward = {name: sorted(m for m in imports_of(path) if not m.startswith("linserve.server.engine"))
              for name, path in modules.items()}
    assert not any(upward.values()), {k: v for k, v in upward.items() if v}
    # packages import their children lazily or not at all: only module-to-module edges can close a cycle
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(trail + [node, nxt])}")
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [])


def test_the_engine_is_composed_of_plain_objects():
    from linserve.server.engine import Engine
    from linserve.server.engine.sessions.service import SessionService
    from linserve.server.engine.step_runner import StepRunner

    for cls in (Engine, StepRunner, SessionService):
        assert cls.__bases__ == (object,), cls
    for path in ENGINE.rglob("*.py"):
        assert "Mixin" not in path.read_text(), path
