"""The `linserve` console script, run as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linserve.server.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_info_reports_state_bytes_from_config():
    result = run_cli("info", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "state_bytes_per_session=" in result.stdout


def test_generate_streams_at_most_max_tokens():
    result = run_cli("generate", "Hello", "--max-tokens", "12", "--device", "cpu", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello")
    generated = int(result.stderr.split("[")[-1].split(" tokens in")[0])
    assert 1 <= generated <= 12


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """A start-up failure as a user should see it: non-zero exit, one `error: …` line, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    assert "--model /nonexistent/dir: no such directory" in one_line_error(
        run_cli("generate", "x", "--model", "/nonexistent/dir"))
    assert "not a checkpoint directory (missing config.json" in one_line_error(
        run_cli("serve", "--model", str(tmp_path), "--port", "0"))


@pytest.mark.parametrize("api_servers", ["0", "1", "2"])
def test_int8_weights_where_they_cannot_run_are_one_line(api_servers):
    """A check that needs torch: made by `serve` itself in one process, else first thing in the engine core's
    (preflight.check_engine) — the same one line and exit status before any HTTP side starts."""
    message = one_line_error(run_cli("serve", "--port", "0", "--device", "cpu", "--dtype", "float32",
                                     "--quantization", "int8", "--api-servers", api_servers))
    assert "--quantization int8 needs bf16 weights on a CPU (here: torch.float32 on cpu)" in message


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_a_kernel_form_that_does_not_exist_is_one_line(api_servers):
    import os

    result = subprocess.run([sys.executable, "-m", "linserve.server.cli", "serve", "--port", "0", "--device", "cpu",
                             "--api-servers", api_servers], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LINSERVE_KERNEL_ISA": "sse4"})
    assert "LINSERVE_KERNEL_ISA='sse4': must be one of scalar, avx2, avx512, avx512bf16, amx" in one_line_error(result)


def test_a_busy_port_is_one_line_before_the_model_loads():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = one_line_error(run_cli("serve", "--port", str(port), "--model", "/nonexistent/dir"))
    assert f"cannot listen on 127.0.0.1:{port}" in message  # reported before the (bad) model is even looked at


def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the message is for machines without a GPU; here --device cuda is valid")
    assert "no CUDA device is available" in one_line_error(run_cli("serve", "--device", "cuda", "--port", "0"))


def test_a_bad_environment_value_names_the_variable():
    import os

    env = {**os.environ, "LINSERVE_NUM_SLOTS": "many"}
    result = subprocess.run([sys.executable, "-m", "linserve.server.cli", "serve", "--port", "0"], capture_output=True,
                            text=True, timeout=60, env=env)
    message = one_line_error(result)
    assert "LINSERVE_NUM_SLOTS" in message and "integer" in message and "'many'" in message


@pytest.mark.parametrize("flag, value, variable", [("--num-slots", "many", "LINSERVE_NUM_SLOTS"),
                                                   ("--device", "gpu", "LINSERVE_DEVICE")])
def test_a_bad_flag_value_is_the_same_one_line_as_a_bad_environment_value(flag, value, variable):
    import os

    by_flag = one_line_error(run_cli("serve", "--port", "0", flag, value))
    env = {**os.environ, variable: value}
    by_env = one_line_error(subprocess.run([sys.executable, "-m", "linserve.server.cli", "serve", "--port", "0"],
                                           capture_output=True, text=True, timeout=60, env=env))
    assert by_flag == by_env and f"'{value}'" in by_flag and flag in by_flag


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-1"], "--max-tokens: max_tokens must be >= 0, got -1"),
    (["--temperature", "-1"], "--temperature: temperature must be >= 0"),
    (["--top-k", "-2"], "--top-k: top_k must be >= 0"),
    (["--model", "/nonexistent/dir"], "--model /nonexistent/dir: no such directory"),
])
def test_generate_checks_its_arguments_as_the_server_does_before_torch_loads(flags, message):
    probe = ("import sys; from linserve.server.cli import main; code = main(['generate', 'x', *sys.argv[1:]]); "
             "print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe, *flags], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert result.stderr.strip() == f"error: {message}" or result.stderr.strip().startswith(f"error: {message}")


def test_help_has_one_default_style():
    from linserve.server.cli import build_parser

    for name, command in build_parser()._subparsers._group_actions[0].choices.items():
        assert "(default" not in command.format_help(), name


def test_eval_prints_json_on_stdout_and_progress_on_stderr(tiny_checkpoint):
    import json

    result = run_cli("eval", "--model", str(tiny_checkpoint), "--max-works", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is the report alone
    assert len(report["works"]) == 1 and report["bits_per_byte"] > 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("eval: ")]
    assert lines and lines[-1].startswith(f"eval: {report['tokens']:,} / {report['tokens']:,} tokens (100%)")
    assert len(lines) <= 12  # not a terminal: a line per tenth, no carriage returns
    assert "\r" not in result.stderr


def test_progress_rewrites_one_line_on_a_terminal():
    import io

    from linserve.server.cli import ProgressLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = ProgressLine("eval", "tokens", stream)
    for done, seconds in ((100, 0.1), (200, 0.2), (300, 0.5), (1000, 0.6)):
        progress(done, 1000, seconds)
    shown = stream.getvalue()
    assert shown.count("\r") == 3 and shown.endswith("\n") and shown.rstrip().endswith("done")  # 200: too soon
    assert "eval: 300 / 1,000 tokens (30%), 600 tokens/s, ~1 s left" in shown


def test_help_and_version_need_no_torch():
    probe = ("import sys; from linserve.server.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("linserve ")


def test_every_flag_has_help_and_no_flag_is_idle():
    import typing

    from linserve.model.loading import DEVICE_CHOICES as MODEL_DEVICES
    from linserve.model.loading import DTYPE_CHOICES as MODEL_DTYPES
    from linserve.server.cli import build_parser
    from linserve.server.settings import Settings

    choices = tuple(typing.get_args(Settings.model_fields[name].annotation) for name in ("device", "dtype"))
    assert choices == (MODEL_DEVICES, MODEL_DTYPES)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"linserve {name} {action.option_strings}: no help"
        text = command.format_help()
        assert "default" in text, name
    assert "[default: 8000]" in commands["serve"].format_help()  # from Settings, the one place defaults live
    assert run_cli("info", "--seed", "1").returncode == 2  # removed: it did nothing


def test_every_setting_is_a_serve_flag_and_the_example_config_agrees():
    """Each default lives once, in Settings: serve has a flag per setting, showing that default, and
    configs/server.example.yaml names only settings, each at its default."""
    import yaml

    from linserve.server.cli import build_parser
    from linserve.server.settings import Settings

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {action.dest: action for action in serve._actions}
    for name, field in Settings.model_fields.items():
        assert name in dests, f"setting {name} has no serve flag"
        default = field.get_default(call_default_factory=True)
        assert f"[default: {'none' if default in (None, []) else default}]" in dests[name].help, name
    parsed = build_parser().parse_args(["serve", "--num-slots", "3", "--session-store", "none", "--docs-public",
                                        "--api-key", "a", "--api-key", "b", "--compile", "off"])
    got = (parsed.num_slots, parsed.session_store, parsed.docs_public, parsed.api_keys)
    assert got == ("3", "none", True, ["a", "b"])  # as given: Settings parses and checks every source alike
    assert Settings.load(None, num_slots=parsed.num_slots).num_slots == 3
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "server.example.yaml").read_text())
    for name, value in example.items():
        assert name in Settings.model_fields, name
        assert getattr(Settings(), name) == Settings(**{name: value}).__getattribute__(name), name


def test_cuda_is_refused_before_torch_loads_where_no_gpu_driver_exists(monkeypatch, tmp_path):
    from linserve.server import preflight

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(preflight, "GPU_DRIVER_SIGNS", (str(tmp_path / "absent"),))
    with pytest.raises(ValueError, match="no CUDA device is available"):
        preflight.check_gpu_driver("cuda")
    preflight.check_gpu_driver("auto")  # only an explicit cuda is checked
    (tmp_path / "version").write_text("NVRM version: 580")
    monkeypatch.setattr(preflight, "GPU_DRIVER_SIGNS", (str(tmp_path / "version"),))
    preflight.check_gpu_driver("cuda")  # a driver is there: torch decides next


@pytest.mark.slow
def test_compile_builds_the_cache_that_serve_uses(tiny_checkpoint, compile_cache):
    """`linserve compile` builds every bucket `serve` would (here one: --num-slots 1) into the directory
    `serve` reads, keyed the same way, and says where; it logs each bucket as it goes. Run again, it loads
    the artifact and compiles nothing. (The compiled server in test_e2e uses the same cache.)"""
    from pathlib import Path

    from tests.devices import device_name_under_test

    command = [sys.executable, "-m", "linserve.server.cli", "compile", "--model", str(tiny_checkpoint),
               "--num-slots", "1", "--compile-cache-dir", compile_cache, "--no-compile-autotune",
               "--device", device_name_under_test()]
    for attempt in range(2):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "decode step compiled: buckets [1] of [1]" in result.stdout
        # the first run builds the bucket (or loads it, when an earlier test built it into this cache); the
        # second only loads it, and says so — never "compiling" for a program it only loads
        verbs = ("compiling", "loading") if attempt == 0 else ("loading",)
        assert any(f"{verb} bucket 1 of 1 (batch 1)" in result.stderr for verb in verbs), result.stderr[-2000:]
    assert "compiling bucket" not in result.stderr and "bucket 1 loaded in" in result.stderr
    keyed = next(Path(compile_cache).glob(f"*{Path(result.stdout.split()[-1]).name}"))
    assert str(keyed) in result.stdout
    if device_name_under_test() == "cpu":  # the artifact, and the compiler child's log of its one build
        assert (keyed / "decode-s1-b1.pt2").is_file()
        assert (keyed / "compile.log").is_file()
    assert float(result.stdout.split("(1: ")[1].split(" s)")[0]) < 10  # the second run only loaded it


def test_each_subcommand_answers_with_its_own_usage_and_flags():
    bogus = run_cli("serve", "--bogus-flag")
    assert bogus.returncode == 2 and bogus.stderr.startswith("usage: linserve serve")
    assert bogus.stderr.strip().splitlines()[-1] == "linserve serve: error: unrecognized arguments: --bogus-flag"
    assert run_cli("generate", "x", "--port", "1").stderr.startswith("usage: linserve generate")
    from linserve.server.cli import COMPILE_SETTINGS, build_parser

    compile_flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["compile"]._actions}
    assert compile_flags == {"help", "config", *COMPILE_SETTINGS}  # no --port, --api-key, … that it would ignore


@pytest.mark.parametrize("command", [["generate", "x"], ["info"], ["eval"]])
def test_cuda_without_a_gpu_fails_before_the_model_loads(command):
    """One line, before transformers and the model are imported (seconds): torch alone decides."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the message is for machines without a GPU; here --device cuda is valid")
    probe = ("import sys; from linserve.server.cli import main; "
             f"code = main({[*command, '--device', 'cuda']!r}); "
             "print(code, 'transformers' in sys.modules, 'linserve.model' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False", "False"], result.stdout + result.stderr  # exit status 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no CUDA device is available" in lines[0]
