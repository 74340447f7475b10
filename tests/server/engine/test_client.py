"""engine/client.py: the HTTP side imports neither the engine nor torch — what a frontend process loads (`serve`'s
own modules, the app and every endpoint family, the channel's end, the grammar compiler), checked in a fresh
interpreter."""

from __future__ import annotations

import subprocess
import sys

FRONTEND = """
import sys
from linserve.server.settings import Settings
from linserve.server import app, frontends, preflight, serve
from linserve.server.engine import grammar
from linserve.server.engine_process import remote
settings = Settings(api_servers=1, port=0)
preflight.preflight(settings)  # the checks `serve` makes itself with the core in a process of its own
application = app.create_app(settings)
assert {"/v1/completions", "/v1/sessions", "/v1/responses"} <= set(application.openapi()["paths"])
print(sorted(name for name in sys.modules if name == "torch" or name.startswith(("linserve.model", "torch."))))
"""


def test_a_frontend_process_imports_no_torch_and_no_model():
    result = subprocess.run([sys.executable, "-c", FRONTEND], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_the_in_process_engine_and_the_remote_one_have_the_clients_surface():
    """Every name EngineClient promises is on both engines: a method or property of the class, or an attribute its
    __init__ sets."""
    import inspect

    from linserve.server.engine.client import EngineClient
    from linserve.server.engine.core import Engine
    from linserve.server.engine_process.remote import RemoteEngine

    surface = {name for name in dir(EngineClient) if not name.startswith("_")} | set(EngineClient.__annotations__)
    assert {"submit", "abort", "alive", "grammars", "facts", "sessions", "on_death", "stop"} <= surface
    for engine in (Engine, RemoteEngine):
        init = inspect.getsource(engine.__init__)
        missing = {name for name in surface if not hasattr(engine, name) and f"self.{name}" not in init}
        assert not missing, (engine.__name__, missing)
