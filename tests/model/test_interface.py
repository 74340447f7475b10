"""model/interface.py: every family is a ServedModel, and the server is written against the interface, naming no
family (the softmax baseline, linear_gpt's own KV-cache variant, aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from linserve.model import LinearGPT, ModelConfig
from linserve.model.checkpoint import load_checkpoint
from linserve.model.interface import LINEAR_GPT, ServedModel, fixed_state, model_type
from linserve.model.loading import DEFAULT_CHECKPOINT

from .families.checkpoints import FAMILY_CASES, write_checkpoint

SERVER = Path(__file__).resolve().parents[2] / "server"
FAMILY_NAMES = {"LinearGPT", "FlaCausalLM", "LinearGPTConfig", "ModelConfig"}


@pytest.mark.parametrize("case", ["shipped", *FAMILY_CASES])
def test_every_family_is_a_served_model_with_a_fixed_state(tmp_path, case):
    path = DEFAULT_CHECKPOINT if case == "shipped" else write_checkpoint(tmp_path / case, FAMILY_CASES[case])
    model = load_checkpoint(path, torch.device("cpu"))
    assert isinstance(model, ServedModel) and fixed_state(model) and fixed_state(model.config)
    assert model_type(model.config) == (LINEAR_GPT if case == "shipped" else FAMILY_CASES[case]["model_type"])
    state = model.init_state(2, "cpu")
    assert set(model.state_from_tensors(state.tensors()).tensors()) == set(state.tensors())


def test_the_softmax_baseline_is_the_one_without_a_fixed_state():
    model = LinearGPT(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, attention="softmax"))
    assert isinstance(model, ServedModel) and not fixed_state(model)


def test_the_server_names_no_family():
    """Outside the softmax baseline's module, no server file imports a family's class or compares
    `config.attention` itself: it asks model/interface.py."""
    offenders = []
    for path in sorted(SERVER.rglob("*.py")):
        if path.name == "softmax_baseline.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("linserve.model"):
                offenders += [f"{path.name}: imports {a.name}" for a in node.names if a.name in FAMILY_NAMES]
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "attention"
                    and any(isinstance(c, ast.Constant) and c.value == "linear" for c in node.comparators)):
                offenders.append(f"{path.name}:{node.lineno}: compares config.attention with 'linear'")
    assert not offenders, offenders
