"""`linserve train`: corpus → tokenizer → AdamW with warmup + cosine → HF checkpoint, resumable."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tokenizers import Tokenizer
from tqdm import tqdm

from ..config import ModelConfig
from ..families.linear_gpt import LinearGPT
from ..hf import LinearGPTConfig, LinearGPTForCausalLM
from .corpus import load_corpus
from .data import WindowSampler, cached_tokens
from .evaluate import bits_per_byte
from .tokenizer import EOT_TOKEN, save_tokenizer, train_bpe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class OptimConfig:
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    eval_interval: int = 250  # steps between validations (0 = only at the end)
    eval_works: int = 1  # validation works scored at each periodic validation (all at the end)
    checkpoint_interval: int = 250  # steps between resumable checkpoints


@dataclass
class TrainConfig:
    name: str
    out_dir: str
    corpus_dir: str = "data/corpus"
    vocab_size: int = 4096
    seed: int = 1337
    max_train_bytes: int | None = None  # train on a prefix of the training works (tiny runs, tests)
    save_dtype: str = "float32"  # dtype of model.safetensors (loads as fp32 on CPU)
    final_eval_works: int | None = None  # validation works scored at the end (None = all)
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields; vocab_size comes from above
    optim: OptimConfig = field(default_factory=OptimConfig)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        optim = raw.pop("optim", {}) or {}
        unknown = set(optim) - {f.name for f in dataclasses.fields(OptimConfig)}
        if unknown:
            raise ValueError(f"{path}: unknown optim keys {sorted(unknown)}")
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        return cls(**raw, optim=OptimConfig(**optim))

    def model_config(self) -> ModelConfig:
        return ModelConfig(**{**self.model, "vocab_size": self.vocab_size})


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min((step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1), 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: LinearGPT, cfg: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not norms, biases or the convolution taps)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def prepare_tokenizer(cfg: TrainConfig, train_texts: list[str]) -> Tokenizer:
    """Train (or reuse, cached per vocab size) the byte-level BPE on the training split."""
    path = Path(cfg.corpus_dir) / f"tokenizer-{cfg.vocab_size}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train_bpe(train_texts, cfg.vocab_size)
    tokenizer.save(str(path))
    return tokenizer


def save_checkpoint(model: LinearGPT, tokenizer: Tokenizer, directory: Path, dtype: torch.dtype) -> None:
    """HF layout: config.json, model.safetensors, tokenizer.json (+config), generation_config.json."""
    eot = tokenizer.token_to_id(EOT_TOKEN)
    hf_config = LinearGPTConfig.from_model_config(model.config, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    lm = LinearGPTForCausalLM(hf_config)
    lm.model.load_state_dict(model.state_dict())
    lm.generation_config.update(do_sample=True, temperature=0.8, top_k=50, max_new_tokens=200,
                                bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    lm.to(dtype).save_pretrained(directory)
    save_tokenizer(tokenizer, directory)


class Trainer:
    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.out_dir = Path(cfg.out_dir)
        corpus = load_corpus(cfg.corpus_dir)
        train_works = corpus.train
        if cfg.max_train_bytes is not None:
            train_works = _prefix_of_works(train_works, cfg.max_train_bytes)
        self.validation = corpus.validation
        self.tokenizer = prepare_tokenizer(cfg, list(corpus.train.values()))
        tokens = cached_tokens(self.tokenizer, train_works, Path(cfg.corpus_dir) / "tokens", "train")
        self.sampler = WindowSampler(tokens, cfg.optim.seq_len, cfg.optim.batch_size, cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model = LinearGPT(cfg.model_config()).to(device)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.step, self.elapsed = 0, 0.0
        self.history: list[dict[str, float]] = []
        self._resume_if_possible()

    @property
    def resume_path(self) -> Path:
        return self.out_dir / "resume.pt"

    def _resume_if_possible(self) -> None:
        if not self.resume_path.is_file():
            return
        saved = torch.load(self.resume_path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.sampler.set_state(saved["sampler"])
        self.step, self.elapsed, self.history = saved["step"], saved["elapsed"], saved["history"]

    def _save_resume(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "sampler": self.sampler.get_state(), "step": self.step, "elapsed": self.elapsed,
                   "history": self.history}
        torch.save(payload, self.resume_path.with_suffix(".tmp"))
        self.resume_path.with_suffix(".tmp").replace(self.resume_path)

    def train_step(self) -> float:
        opt = self.cfg.optim
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, opt)
        inputs, targets = (t.to(self.device) for t in self.sampler.next_batch())
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits, _ = self.model(inputs)  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), opt.grad_clip)
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def validate(self, max_works: int | None) -> float:
        return bits_per_byte(self.model, self.tokenizer, self.validation, max_works=max_works).bits_per_byte

    def run(self) -> dict[str, Any]:
        opt = self.cfg.optim
        tokens_per_step = opt.seq_len * opt.batch_size
        bar = tqdm(total=opt.max_steps, initial=self.step, desc=self.cfg.name, dynamic_ncols=True)
        self.model.train()
        while self.step < opt.max_steps:
            started = time.perf_counter()
            loss = self.train_step()
            self.elapsed += time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step * self.step / self.elapsed:.0f}")
            if opt.eval_interval and self.step % opt.eval_interval == 0 and self.step < opt.max_steps:
                bpb = self.validate(opt.eval_works)
                self.history.append({"step": self.step, "loss": loss, "val_bpb_subset": bpb})
                bar.write(f"step {self.step}: loss {loss:.3f}, "
                          f"validation bits/byte (first {opt.eval_works} works) {bpb:.4f}")
            if opt.checkpoint_interval and self.step % opt.checkpoint_interval == 0:
                self._save_resume()
        bar.close()
        return self.finish()

    def finish(self) -> dict[str, Any]:
        final_dir = self.out_dir / "final"
        save_checkpoint(self.model, self.tokenizer, final_dir, DTYPES[self.cfg.save_dtype])
        works = self.cfg.final_eval_works
        windowed = bits_per_byte(
            self.model, self.tokenizer, self.validation, window=self.cfg.optim.seq_len, max_works=works
        )
        carried = None
        if self.model.config.attention == "linear":
            carried = bits_per_byte(self.model, self.tokenizer, self.validation, max_works=works)
        summary = {
            "name": self.cfg.name,
            "steps": self.step,
            "tokens": self.step * self.cfg.optim.seq_len * self.cfg.optim.batch_size,
            "train_minutes": self.elapsed / 60,
            "params": self.model.num_parameters(),
            "state_bytes_per_session": self.model.state_bytes(),
            "val_bpb_windowed": windowed.bits_per_byte,  # independent windows of seq_len tokens
            "val_bpb_carried": carried.bits_per_byte if carried else None,  # state carried through whole works
            "history": self.history,
            "checkpoint": str(final_dir),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self._save_resume()
        return summary


def _prefix_of_works(works: dict[str, str], max_bytes: int) -> dict[str, str]:
    out, used = {}, 0
    for name, text in works.items():
        if used >= max_bytes:
            break
        out[name] = text[: max_bytes - used]
        used += len(out[name])
    return out
