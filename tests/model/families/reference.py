"""Checkpoints made by fla itself and its outputs on them (fla_reference.py, in a process of its own), and
the comparison every family's tests make: linserve's model of the same directory against fla's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from linserve.model.checkpoint import load_checkpoint
from linserve.model.loading import DEFAULT_CHECKPOINT

SCRIPT = Path(__file__).with_name("fla_reference.py")
# fla prefills the prompt with its recurrent kernels (their chunk kernels fail under triton 3.9's interpreter; on a
# GPU they run), a Python loop over its tokens there; 40 tokens span linserve's chunkwise form's two chunks of 32,
# the second one short. Then 16 tokens decoded one at a time: each step's log-probabilities and the states after the
# last compared (under the interpreter a decoded token costs fla ~0.13 s: 64 of them, argmax alone, were 85% of the
# references' time)
PROMPT_LEN, GREEDY = 40, 16
TOLERANCE = 1e-4  # fp32


def make_references(root: Path, cases: dict[str, tuple]) -> dict[str, Path]:
    """cases: name → (model_type, fla config fields[, source]): source "transformers" takes transformers' class
    of the model type as the reference instead of fla's. fla processes make every checkpoint and reference."""
    generator = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, 4096, (PROMPT_LEN,), generator=generator).tolist()
    # attn_mode picks fla's kernel, not the function: "chunk" runs under the interpreter ("fused_chunk" does not)
    base = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=4096, attn_mode="chunk")
    specs = [{"dir": str(root / name), "model_type": case[0], "config": {**base, **case[1]}, "prompt": prompt,
              "greedy": GREEDY, "seed": index, "tokenizer": str(DEFAULT_CHECKPOINT),
              "source": case[2] if len(case) > 2 else "fla"}
             for index, (name, case) in enumerate(cases.items())]
    (root / "specs.json").write_text(json.dumps(specs))  # compare_with_fla reads the prompt here
    # fla under Triton's interpreter is Python on one core: the references are made by one process per core
    # (at most 4), each with every n-th spec, one torch thread each
    workers = max(1, min(4, len(os.sched_getaffinity(0)), len(specs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    processes = []
    for worker in range(workers):
        spec_file = root / f"specs-{worker}.json"
        spec_file.write_text(json.dumps(specs[worker::workers]))
        log = open(root / f"fla-{worker}.log", "w")
        processes.append((subprocess.Popen([sys.executable, str(SCRIPT), str(spec_file)], stdout=log,
                                           stderr=subprocess.STDOUT, env=env), log, root / f"fla-{worker}.log"))
    failures = []
    for process, log, log_path in processes:
        try:
            process.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        if process.returncode != 0:
            failures.append(log_path.read_text()[-4000:])
    assert not failures, "\n".join(failures)
    return {name: root / name for name in cases}


def compare_with_fla(directory: Path) -> None:
    """linserve's prompt log-probabilities and final states == fla's (fp32, 1e-4); then its greedy tokens, decoded one
    at a time, == fla's, with each step's log-probabilities and the states after the last step."""
    reference = torch.load(directory / "reference.pt")
    model = load_checkpoint(directory, torch.device("cpu"), torch.float32)
    ids = torch.tensor([json.loads((directory.parent / "specs.json").read_text())[0]["prompt"]])
    with torch.no_grad():
        logits, state = model(ids)  # (1, T, V)
        logprobs = logits.float().log_softmax(-1)[0]  # (T, V)
        assert (logprobs - reference["logprobs"]).abs().max().item() < TOLERANCE
        assert_states_match(state.tensors(), reference["states"], "after the prompt")
        tokens, token, stepped = [], logits[0, -1].argmax(), []
        for _ in range(len(reference["greedy"])):
            tokens.append(int(token))
            step, state = model(token.view(1, 1), state)  # (1, 1, V)
            stepped.append(step[0, -1].float().log_softmax(-1))  # (V,)
            token = step[0, -1].argmax()
    assert tokens == reference["greedy"]
    if reference.get("greedy_logprobs") is not None:  # (fla's references; transformers' keeps the tokens only)
        assert (torch.stack(stepped) - reference["greedy_logprobs"]).abs().max().item() < TOLERANCE
        assert_states_match(state.tensors(), reference["decoded_states"], "after decoding")


def assert_states_match(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], when: str) -> None:
    for name, expected in theirs.items():
        ours = mine[name][0]
        if name.endswith(("keys", "values")):  # a window of W slots: fla keeps only those filled
            ours = ours[ours.shape[0] - expected.shape[0]:]
        elif ours.shape != expected.shape:  # a value-first state (H, dv, dk)
            ours = ours.transpose(-1, -2)
        assert (ours - expected).abs().max().item() < TOLERANCE * max(1.0, expected.abs().max().item()), (name, when)
