"""A directory that is not a complete, consistent checkpoint of a served family is refused — one error naming
the field or the tensors — and `linserve serve` exits 2 before it binds (nothing served with random weights)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from linserve.model.checkpoint import CheckpointError, UnsupportedCheckpoint, load_tokenizer, validate
from linserve.model.loading import DEFAULT_CHECKPOINT
from tests.model.families.checkpoints import write_checkpoint


@pytest.fixture
def shipped(tmp_path):
    return shutil.copytree(DEFAULT_CHECKPOINT, tmp_path / "shipped")


def edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


def test_the_shipped_checkpoint_and_each_family_validate(shipped, tmp_path, caplog):
    validate(shipped, load_tokenizer(shipped))
    transformers_logging.enable_propagation()
    try:
        for fields in ({"model_type": "linear_attn", "feature_map": "relu"}, {"model_type": "gla"},
                       {"model_type": "retnet"}):
            directory = write_checkpoint(tmp_path / fields["model_type"], fields)
            caplog.clear()
            with caplog.at_level("WARNING"):
                tokenizer = load_tokenizer(directory)
            # an fla model_type is not read as a transformers config (no "model of type `gla`" warning at start)
            assert not [r for r in caplog.records if "to instantiate a model of type" in r.getMessage()], caplog.text
            assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(str(directory)).get_vocab()
            validate(directory, tokenizer)
    finally:
        transformers_logging.disable_propagation()


@pytest.mark.parametrize("fields, named", [
    ({"model_type": "hgrn2"}, "model_type='hgrn2'"),
    ({"model_type": "linear_attn", "feature_map": "favor"}, "feature_map='favor'"),
    ({"model_type": "gla", "attn": {"layers": [1], "num_heads": 4}}, "attn.window_size=None"),  # full softmax
    ({"model_type": "gla", "attn": {"layers": [1], "num_heads": 4, "window_size": 0}}, "attn.window_size=0"),
    ({"model_type": "gla", "attn": {"layers": [5], "num_heads": 4, "window_size": 8}}, r"attn.layers=\[5\]"),
    ({"model_type": "gla", "attn": {"layers": [1], "num_heads": 5, "window_size": 8}}, "attn.num_heads=5"),
    ({"model_type": "retnet", "hidden_act": "powlu"}, "hidden_act='powlu'"),  # fla's gate has no powlu
    ({"model_type": "linear_attn", "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "linear_attn", "num_kv_heads": 3}, "num_kv_heads=3"),
    ({"model_type": "gla", "attnres_block_size": 2}, "attnres_block_size=2"),
], ids=["unknown-type", "feature-map", "softmax-hybrid", "zero-window", "layer-out-of-range", "window-heads",
        "gate-activation", "mlp-activation", "kv-heads", "attnres"])
def test_a_type_or_option_not_served_names_the_field(tmp_path, fields, named):
    directory = write_checkpoint(tmp_path / "ok", {"model_type": "linear_attn"})
    edit_config(directory, **fields)
    with pytest.raises(UnsupportedCheckpoint, match=f"config.json: {named}"):
        validate(directory)


def test_weights_that_do_not_match_the_config_are_named(shipped, tmp_path):
    edit_config(shipped, n_layers=8)  # the config says 8 layers, the file holds 6
    with pytest.raises(CheckpointError, match=r"missing: model\.blocks\.6\."):
        validate(shipped)
    directory = write_checkpoint(tmp_path / "gla", {"model_type": "gla"})
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.0.attn.extra.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError) as error:
        validate(directory)
    assert "1 unexpected: model.layers.0.attn.extra.weight" in str(error.value)
    assert "1 misshapen: model.norm.weight (10,) (the config makes (64,))" in str(error.value)


def test_a_truncated_weights_file_is_refused(shipped):
    data = (shipped / "model.safetensors").read_bytes()
    (shipped / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot be read"):
        validate(shipped)


def test_a_tokenizer_of_another_size_is_refused(tmp_path):
    directory = write_checkpoint(tmp_path / "small", {"model_type": "linear_attn", "vocab_size": 4000})
    with pytest.raises(CheckpointError, match="tokenizer has 4096 tokens but the model's vocab_size is 4000"):
        validate(directory, AutoTokenizer.from_pretrained(str(directory)))


def test_serve_exits_2_with_one_line_before_it_binds(shipped):
    edit_config(shipped, n_layers=8)
    result = subprocess.run([sys.executable, "-m", "linserve.server.cli", "serve", "--model", str(shipped),
                             "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "missing" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shipped_model_loads_as_from_pretrained_loads_it(dtype):
    """load_checkpoint (no transformers model class) makes of a linear_gpt directory exactly what
    `LinearGPTForCausalLM.from_pretrained(dtype=…)` makes: every tensor's dtype and value, buffers fp32."""
    import torch

    from linserve.model.checkpoint import load_checkpoint
    from linserve.model.loading import load_model

    served = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), getattr(torch, dtype))
    reference = load_model(DEFAULT_CHECKPOINT, torch.device("cpu"), getattr(torch, dtype)).model
    ours, theirs = served.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and type(served) is type(reference) and not served.training
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert {buffer.dtype for buffer in served.buffers()} == {torch.float32}
    ids = torch.randint(0, served.config.vocab_size, (2, 24))  # (B, T)
    assert torch.equal(served(ids)[0], reference(ids)[0])


SERVING_IMPORTS = """
import sys
import torch
from linserve.model.checkpoint import load_checkpoint, load_tokenizer, validate
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.server.app import create_app
tokenizer = load_tokenizer(DEFAULT_CHECKPOINT)
validate(DEFAULT_CHECKPOINT, tokenizer)
load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16)
print(sorted(name for name in ("transformers.modeling_utils", "torch._dynamo") if name in sys.modules))
"""

REGISTERED = """
import linserve.model
from transformers import AutoConfig, AutoModelForCausalLM
from linserve.model.loading import DEFAULT_CHECKPOINT
print(type(AutoModelForCausalLM.from_pretrained(DEFAULT_CHECKPOINT)).__name__)
config = AutoConfig.for_model("linear_gpt", n_layers=1, d_model=32, n_heads=2, vocab_size=50)
print(type(AutoModelForCausalLM.from_config(config)).__name__)
"""


def test_serving_never_imports_transformers_modeling_code_and_the_auto_classes_still_find_linear_gpt():
    """A server's start imports neither transformers' modeling code nor torch._dynamo (together 2–3 s of every
    start; each in a fresh process); a bare `import linserve.model` still lets AutoModelForCausalLM load
    linear_gpt, from a directory or from a config."""
    run = [sys.executable, "-c"]
    served = subprocess.run([*run, SERVING_IMPORTS], capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr
    assert served.stdout.strip().splitlines()[-1] == "[]"
    auto = subprocess.run([*run, REGISTERED], capture_output=True, text=True, timeout=300)
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.split() == ["LinearGPTForCausalLM", "LinearGPTForCausalLM"]
