"""The llama.cpp peers' models: GPT-2 (6 × 256, 8 heads, MLP 4×, 16,384 positions) and Mamba (12 × 256,
inner 512, state 16) for P9, GGUF F32; and for P17 a Mamba of fla's 340M class (mamba-370m's shape: 48 ×
1,024, inner 2,048, state 16), GGUF BF16 (the dtype linserve serves it beside), and the same in Q8_0 (the peer
of linserve's int8 weights: `mamba-370m-q8_0`); for P17's Mamba2 a Mamba2 of mamba2-370m's shape (48 × 1,024,
32 heads of 64, state 128), GGUF BF16 (`mamba2-370m`). Random weights, linserve's
tokenizer, saved with transformers and converted by llama.cpp's own `convert_hf_to_gguf.py` (from the sdist
`build_llama_server.sh` unpacked). Cached under data/peers/models/; nothing is downloaded.

    python benchmarks/peers/make_models.py [NAME …]   → data/peers/models/{gpt2,mamba,mamba-370m,mamba-370m-q8_0,mamba2-370m}.gguf
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "data" / "peers"
CONVERTER = PEERS / "llama.cpp" / "convert_hf_to_gguf.py"
TOKENIZER = REPO / "model" / "checkpoints" / "default"

# convert_hf_to_gguf.py refuses a pre-tokenizer whose hash it does not know; linserve's is a byte-level
# BPE, which is llama.cpp's `gpt-2` pre-tokenizer
CONVERT = """
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
import runpy
runpy.run_path(sys.argv[0], run_name='__main__')
"""


SHAPES = {"mamba": (256, 12), "mamba-370m": (1024, 48), "mamba-370m-q8_0": (1024, 48),  # hidden, layers
          "mamba2-370m": (1024, 48)}  # state-spaces/mamba2-370m's shape: 32 heads of 64, state 128, one group
# mamba-370m-q8_0: the same weights (seed 0) as llama.cpp's users run them — Q8_0, the peer of `quantization: int8`
OUTTYPE = {"mamba-370m": "bf16", "mamba-370m-q8_0": "q8_0", "mamba2-370m": "bf16"}


def vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).get_vocab_size()


def save(model, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, directory / name)


def build(name: str) -> Path:
    out = PEERS / "models" / f"{name}.gguf"
    if out.exists():
        return out
    from transformers import GPT2Config, GPT2LMHeadModel, Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    vocab = vocab_size()
    if name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=16384, n_embd=256, n_layer=6, n_head=8,
                                           n_inner=1024, bos_token_id=0, eos_token_id=0))
    elif name.startswith("mamba2"):
        hidden, layers = SHAPES[name]
        model = Mamba2ForCausalLM(Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                               expand=2, head_dim=64, num_heads=2 * hidden // 64, state_size=128,
                                               n_groups=1, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    else:
        hidden, layers = SHAPES[name]
        model = MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                             intermediate_size=2 * hidden, state_size=16, bos_token_id=0,
                                             eos_token_id=0, pad_token_id=0))
    hf_dir = PEERS / "models" / f"{name}-hf"
    save(model.eval(), hf_dir)
    if name == "gpt2":  # the converter reads GPT-2's context from `n_ctx`, which transformers 5 no longer writes
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}, indent=2))
    subprocess.run([sys.executable, "-c", CONVERT, str(CONVERTER), str(hf_dir), "--outtype", OUTTYPE.get(name, "f32"),
                    "--outfile", str(out)], check=True)
    return out


if __name__ == "__main__":
    if not CONVERTER.exists():
        raise SystemExit("run benchmarks/peers/build_llama_server.sh first (it unpacks llama.cpp's converter)")
    for peer in sys.argv[1:] or ("gpt2", "mamba"):
        print(build(peer))
