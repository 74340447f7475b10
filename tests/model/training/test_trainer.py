import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from linserve.model.training.trainer import OptimConfig, TrainConfig, Trainer, lr_at
from tests.conftest import CORPUS_DIR


def tiny_config(out_dir, max_steps=12, **optim) -> TrainConfig:
    return TrainConfig(
        name="test",
        out_dir=str(out_dir),
        corpus_dir=str(CORPUS_DIR),
        vocab_size=4096,
        max_train_bytes=150_000,
        final_eval_works=1,
        model=dict(d_model=32, n_layers=2, n_heads=4, conv_kernel=3, decay=True, chunk_size=16),
        optim=OptimConfig(seq_len=48, batch_size=4, max_steps=max_steps, lr=3e-3, min_lr=3e-4, warmup_steps=3,
                          eval_interval=0, checkpoint_interval=4, **optim),
    )


def test_lr_warms_up_then_decays_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def test_yaml_configs_in_repo_parse():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[3] / "configs" / "train").glob("*.yaml")):
        cfg = TrainConfig.from_yaml(path)
        cfg.model_config()  # validates the model fields


def test_unknown_yaml_keys_are_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nout_dir: y\noptim: {learning_rate: 1}\n")
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_yaml(path)


def test_tiny_run_learns_and_writes_hf_checkpoint(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, max_steps=30), torch.device("cpu"))
    first = trainer.train_step()
    summary = trainer.run()
    final = tmp_path / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (final / name).is_file(), name
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 48 * 4
    assert summary["val_bpb_windowed"] < first / math.log(2) * 4  # sanity: finite and not absurd
    assert trainer.history == [] and json.loads((tmp_path / "summary.json").read_text())["steps"] == 30
    losses = [trainer.train_step() for _ in range(5)]
    assert sum(losses) / 5 < first - 0.5  # it learned something

    lm = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)


def test_resume_continues_exactly(tmp_path):
    straight = Trainer(tiny_config(tmp_path / "a", max_steps=8), torch.device("cpu"))
    for _ in range(8):
        straight.train_step()

    interrupted = Trainer(tiny_config(tmp_path / "b", max_steps=8), torch.device("cpu"))
    for _ in range(4):
        interrupted.train_step()
    interrupted._save_resume()
    del interrupted
    resumed = Trainer(tiny_config(tmp_path / "b", max_steps=8), torch.device("cpu"))
    assert resumed.step == 4
    for _ in range(4):
        resumed.train_step()
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
