"""fla's own models as the reference, in a process of their own:

    python tests/model/families/fla_reference.py SPEC.json

SPEC.json lists checkpoints to make: {"dir", "model_type", "config": {...}, "prompt": [ids], "greedy": n,
"seed"}. For each, fla's config and causal-LM classes make a model (seeded random weights, every parameter
perturbed so no norm or map sits at its identity init), `save_pretrained` writes it to "dir" with the
shipped tokenizer beside it, and fla computes (fp32) the prompt's log-probabilities, the final recurrent state
of every layer, `greedy` tokens of cached decoding with each step's log-probabilities, and every layer's state
after them — written to dir/reference.pt.

fla's Triton kernels need a GPU driver; on a CPU they run under Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported — hence a process of its own) with the autotuner's benchmark replaced by a
constant (it times configurations on a GPU). With a GPU (LINSERVE_FLA_GPU=1), the real kernels run — still
without the autotuner's timing: every configuration computes the same, and compiling each would take minutes.
"""

from __future__ import annotations

import functools
import json
import os
import sys

ON_GPU = os.environ.get("LINSERVE_FLA_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
import triton.runtime.autotuner as autotuner  # noqa: E402


def _largest_blocks_first(self, *args, config, **meta) -> list[float]:
    """The autotuner's timing under the interpreter: the configuration with the largest blocks "wins" — the
    fewest program instances, each a vectorised numpy pass (the smallest made fla's one-token convolution
    update 8 Python-level programs per call: ~60% of a delta-rule reference's time)."""
    size = 1
    for name, value in config.kwargs.items():
        if name.startswith("B") and isinstance(value, int):
            size *= value
    return [1.0 / size] * 3


# every configuration computes the same function (to summation order, far below the tolerance): on a GPU the
# first is taken without timing any (compiling each would take minutes; a large one may not fit the GPU)
autotuner.Autotuner._bench = ((lambda self, *args, **kwargs: [1.0, 1.0, 1.0]) if ON_GPU else _largest_blocks_first)


def _patch_lang_once() -> None:
    """Under the interpreter, a kernel launch (GridExecutor) patches triton.language's builtins to interpreted ones and
    restores them after; every call of a @triton.jit helper inside the kernel — per program instance, per call —
    patches the modules it sees again (`inspect.getmembers` over each, finding them patched already) and never
    restores that: half of a Gated DeltaNet reference's time. A helper whose modules are patched — by the running
    launch, or left patched by an earlier helper's call (triton.language.core, which `tl.sum` and `tl.sigmoid` see
    and a kernel does not) — skips that: nothing it would change is unpatched. Any other helper patches as before."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch, launch, device_call = interpreter._patch_lang, interpreter.GridExecutor.__call__, \
        interpreter.InterpretedFunction.__call__
    launches, covered = [], []  # the running launches' modules; whether the helper being called is covered
    left = set()  # modules a helper's call patched (never restored)

    @functools.cache
    def langs_of(fn) -> frozenset[int]:  # (the modules _patch_lang patches: triton.language and its core)
        return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)

    def patch_lang(fn):
        return interpreter._LangPatchScope() if covered and covered[-1] else patch(fn)

    def launched(self, *args, **kwargs):
        launches.append(langs_of(self.fn))
        covered.append(False)  # (the launch's own patch)
        try:
            return launch(self, *args, **kwargs)
        finally:
            covered.pop()
            launches.pop()

    def called(self, *args, **kwargs):
        wanted = langs_of(self.fn)
        covered.append(bool(launches) and bool(wanted) and wanted <= launches[-1] | left)
        try:
            return device_call(self, *args, **kwargs)
        finally:
            if not covered.pop():
                left.update(wanted)

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launched
    interpreter.InterpretedFunction.__call__ = called


if not ON_GPU:
    _patch_lang_once()


def install_flash_attn_stand_in() -> None:
    """fla's softmax layers call flash-attn (a CUDA library, not fla, absent on a CPU and on the GPU machine
    here): where it is missing, its `flash_attn_func` is plain PyTorch maths — softmax(q·kᵀ·scale) over the
    keys flash-attn would read (bottom-right causal alignment, window (left, right), grouped kv heads)."""
    try:
        import flash_attn  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.machinery
    import types

    import torch

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **_):
        B, Tq, H, D = q.shape
        Tk, KV = k.shape[1], k.shape[2]
        k, v = k.repeat_interleave(H // KV, dim=2).float(), v.repeat_interleave(H // KV, dim=2).float()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * (softmax_scale or D ** -0.5)
        query = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)  # (Tq, 1): its position among the keys
        key = torch.arange(Tk, device=q.device)[None]  # (1, Tk)
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= key <= query
        if window_size[0] >= 0:
            allowed &= key >= query - window_size[0]
        if window_size[1] >= 0:
            allowed &= key <= query + window_size[1]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("bhqk,bkhd->bqhd", weights, v).to(q.dtype)

    def flash_attn_varlen_func(*args, **kwargs):
        raise NotImplementedError("the reference runs unpadded, unpacked rows only")

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    sys.modules["flash_attn"] = module


install_flash_attn_stand_in()
import fla.models as fla_models  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

CLASSES = {
    "linear_attn": (fla_models.LinearAttentionConfig, fla_models.LinearAttentionForCausalLM),
    "retnet": (fla_models.RetNetConfig, fla_models.RetNetForCausalLM),
    "gla": (fla_models.GLAConfig, fla_models.GLAForCausalLM),
}
for name, config_cls, model_cls in (("delta_net", "DeltaNetConfig", "DeltaNetForCausalLM"),
                                    ("gated_deltanet", "GatedDeltaNetConfig", "GatedDeltaNetForCausalLM"),
                                    ("mamba2", "Mamba2Config", "Mamba2ForCausalLM"),
                                    ("rwkv7", "RWKV7Config", "RWKV7ForCausalLM")):
    if hasattr(fla_models, config_cls):
        CLASSES[name] = (getattr(fla_models, config_cls), getattr(fla_models, model_cls))


RECURRENT_PREFILL = ("rwkv7",)
VALUE_FIRST = ("gated_deltanet", "mamba2")  # fla keeps these states (H, dv, dk); linserve (H, dk, dv)


def layer_states(cache, n_layers: int, model_type: str) -> dict[str, torch.Tensor]:
    """fla's cache → name → tensor (batch row 0 dropped), in linserve's layout: recurrent_state, and z when
    normalising."""
    out = {}
    for i in range(n_layers):
        layer = cache[i]
        state = layer["recurrent_state"]
        if state is None:  # a sliding-window softmax layer: its last (up to W) keys and values, oldest first
            out[f"layers.{i}.keys"], out[f"layers.{i}.values"] = (t[0].float() for t in layer["attn_state"])
        elif isinstance(state, tuple):  # (kv, z) with norm_feature_map
            out[f"layers.{i}.S"], out[f"layers.{i}.z"] = state[0][0].float(), state[1][0, 0].float()
        else:
            S = state[0].float()
            out[f"layers.{i}.S"] = S.transpose(-1, -2) if model_type in VALUE_FIRST else S
    return out


def transformers_classes(model_type: str):
    """transformers' own classes of a model type that both fla and transformers define (a spec's "source":
    "transformers"): Mamba2 with n_groups > 1, where fla's CPU prefill tiles the groups (mamba2.py)."""
    import transformers

    return {"mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM)}[model_type]


def make_with_transformers(spec: dict, tokenizer_dir: str) -> None:
    """transformers' model as the reference: prompt log-probabilities, each layer's final recurrent state and
    `generate()`'s greedy tokens (its own cache)."""
    config_cls, model_cls = transformers_classes(spec["model_type"])
    torch.manual_seed(spec.get("seed", 0))
    model = model_cls(config_cls(**spec["config"])).float()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * spec.get("noise", 0.05))
    model.eval()
    model.save_pretrained(spec["dir"])
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(spec["dir"])
    ids = torch.tensor([spec["prompt"]])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logprobs = out.logits.float().log_softmax(-1)[0]  # (T, V)
        states = {f"layers.{i}.S": out.cache.get_recurrent_state(i)[0].float().transpose(-1, -2)
                  for i in range(model.config.num_hidden_layers)}  # (H, P, N) → linserve's (H, N, P)
        generated = model.generate(ids, max_new_tokens=spec.get("greedy", 0), do_sample=False,
                                   min_new_tokens=spec.get("greedy", 0), pad_token_id=0, eos_token_id=None)
    torch.save({"logprobs": logprobs, "states": states, "greedy": generated[0, ids.shape[1]:].tolist()},
               os.path.join(spec["dir"], "reference.pt"))


def make(spec: dict, tokenizer_dir: str) -> None:
    if spec.get("source") == "transformers":
        return make_with_transformers(spec, tokenizer_dir)
    config_cls, model_cls = CLASSES[spec["model_type"]]
    torch.manual_seed(spec.get("seed", 0))
    options = dict(fuse_cross_entropy=False, **spec["config"])
    config = config_cls(**options)
    model = model_cls(config).float()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * spec.get("noise", 0.05))
    model.eval()
    device = "cuda" if ON_GPU else "cpu"
    model.save_pretrained(spec["dir"])
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(spec["dir"])
    model.to(device)
    ids = torch.tensor([spec["prompt"]], device=device)
    with torch.no_grad():
        if spec["model_type"] in RECURRENT_PREFILL and not ON_GPU:
            # RWKV-7's layer takes its chunk kernels from 64 tokens on, which fail under the interpreter: the
            # prompt in pieces of 63 through fla's recurrent kernel, the cache carried between them
            cache, pieces = None, []
            for start in range(0, ids.shape[1], 63):
                out = model(ids[:, start:start + 63], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                pieces.append(out.logits)
            out.logits = torch.cat(pieces, dim=1)
        else:
            out = model(ids, use_cache=True)
        logprobs = out.logits.float().log_softmax(-1)[0]  # (T, V)
        cache = out.past_key_values
        states = layer_states(cache, config.num_hidden_layers, spec["model_type"])
        tokens, token, stepped = [], out.logits[0, -1].argmax(), []
        for _ in range(spec.get("greedy", 0)):
            tokens.append(int(token))
            step = model(token.view(1, 1), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            stepped.append(step.logits[0, -1].float().log_softmax(-1))  # (V,)
            token = step.logits[0, -1].argmax()
        decoded = layer_states(cache, config.num_hidden_layers, spec["model_type"])
    torch.save({"logprobs": logprobs.cpu(), "states": {k: v.cpu() for k, v in states.items()},
                "greedy": tokens, "greedy_logprobs": torch.stack(stepped).cpu() if stepped else None,
                "decoded_states": {k: v.cpu() for k, v in decoded.items()}},
               os.path.join(spec["dir"], "reference.pt"))


def main() -> None:
    specs = json.loads(open(sys.argv[1]).read())
    for spec in specs:
        make(spec, spec["tokenizer"])


if __name__ == "__main__":
    main()
