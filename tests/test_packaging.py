"""The folders model/ and server/ install as `linserve.model` and `linserve.server`: an installed linserve
claims the import name `linserve` only, and a user's own `model` or `server` module stays theirs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_installed_under_linserve():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted(str(p.parent.relative_to(REPO)) for top in ("model", "server")
                     for p in (REPO / top).rglob("__init__.py"))
    want = {"linserve." + folder.replace("/", "."): folder for folder in folders}
    assert config["package-dir"] == want
    assert sorted(config["packages"]) == sorted(want)


def test_a_users_own_model_and_server_modules_are_not_shadowed(tmp_path):
    (tmp_path / "model.py").write_text("WHOSE = 'the user'\n")
    (tmp_path / "server.py").write_text("WHOSE = 'the user'\n")
    probe = ("import model, server, linserve.server.app, linserve.model, sys; "
             "print(model.WHOSE, server.WHOSE, linserve.model.LinearGPT.__name__, "
             "sorted(m for m in sys.modules if m.split('.')[0] in ('model', 'server') "
             "and m not in ('model', 'server')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["the", "user", "the", "user", "LinearGPT", "[]"]


@pytest.mark.slow
def test_the_wheel_holds_linserve_only(tmp_path):
    """What `pip install linserve` puts into site-packages: one top-level package, the checkpoint inside it."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=600)
    wheel = next(tmp_path.glob("linserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"linserve", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "linserve/model/checkpoints/default/model.safetensors" in names
    assert "linserve/server/engine/compile/program_compiler.py" in names
    # the kernels' sources: built on first use where the package is installed
    assert {"linserve/model/kernels/invariant_linear.cpp", "linserve/model/kernels/delta_rule.cpp"} <= set(names)
    page = ("index.html", "chart.js", "app.js", "style.css")
    assert {f"linserve/server/api/web/static/{name}" for name in page} <= set(names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "linserve = linserve.server.cli:main" in entry


def locked_versions() -> dict[str, str]:
    """configs/constraints.txt as {normalised name: version}."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "configs" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and ";" not in line and "+" not in version, f"not a plain pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_pins_every_dependency_inside_pyprojects_ranges():
    """The README's commands install with the lock: every declared dependency (dev extras included) is pinned
    there, at a version pyproject.toml allows — a range moved without the lock (or the reverse) fails here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = locked_versions()
    for text in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
        requirement = Requirement(text)
        if requirement.name == "linserve":
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in configs/constraints.txt (bash .ci/drift --lock)"
        assert requirement.specifier.contains(pins[name]), f"locked {name}=={pins[name]} outside {text!r}"
    assert "linserve" not in pins  # the project itself is never pinned
