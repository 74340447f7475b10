"""The llama.cpp peers' models: GPT-2 (6 × 256, 8 heads, MLP 4×, 16,384 positions) and Mamba (12 × 256,
inner 512, state 16) for P9, GGUF F32; and for P17 a Mamba of fla's 340M class (mamba-370m's shape: 48 ×
1,024, inner 2,048, state 16), GGUF BF16 (the dtype linserve serves it beside), and the same in Q8_0 (the peer
of linserve's int8 weights: `mamba-370m-q8_0`); for P17's Mamba2 a Mamba2 of mamba2-370m's shape (48 × 1,024,
32 heads of 64, state 128), GGUF BF16 (`mamba2-370m`). Random weights, linserve's
tokenizer, saved with transformers and converted by llama.cpp's own `convert_hf_to_gguf.py` (from the sdist
`build_llama_server.sh` unpacked). Cached under data/peers/models/; nothing is downloaded.

    python benchmarks/peers/make_models.py [NAME …]   → data/peers/models/NAME.gguf
    (gpt2, mamba, mamba-370m, mamba-370m-q8_0, mamba2-370m, rwkv7-0.4b)
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
          # state-spaces/mamba2-370m's shape (32 heads of 64, state 128, one group); fla-hub's RWKV-7 0.4B
          "mamba2-370m": (1024, 48), "rwkv7-0.4b": (1024, 24)}
# mamba-370m-q8_0: the same weights (seed 0) as llama.cpp's users run them — Q8_0, the peer of `quantization: int8`
OUTTYPE = {"mamba-370m": "bf16", "mamba-370m-q8_0": "q8_0", "mamba2-370m": "bf16", "rwkv7-0.4b": "bf16"}


def vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).get_vocab_size()


def save(model, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, directory / name)


def rwkv_world_vocabulary(directory: Path) -> None:
    """llama.cpp converts RWKV-7 only with RWKV's world tokenizer (`rwkv_vocab_v20230424.txt`: one line per token,
    `id repr(bytes) length`; id 0 is its `<s>`). Written from linserve's byte-level BPE: ids 1.. its tokens' bytes,
    so both servers have the same vocabulary size (the head's cost)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).get_vocab()
    byte_of = {chr(c): c for c in range(33, 127)} | {chr(c): c for c in range(161, 173)} | {
        chr(c): c for c in range(174, 256)}  # GPT-2's printable bytes as themselves, the rest shifted past 255
    shifted = 0
    for c in range(256):
        if c not in byte_of.values():
            byte_of[chr(256 + shifted)] = c
            shifted += 1
    lines = []
    for token, index in sorted(vocab.items(), key=lambda item: item[1])[1:]:
        data = bytes(byte_of[ch] for ch in token) if all(ch in byte_of for ch in token) else token.encode()
        lines.append(f"{index} {data!r} {len(data)}")
    (directory / "rwkv_vocab_v20230424.txt").write_text("\n".join(lines) + "\n")


def rwkv7_checkpoint(name: str) -> Path:
    """The peer's RWKV-7: P17's own checkpoint of the family at this shape (linserve serves the same weights), its
    config naming fla's class (the converter picks its model by `architectures`) and the world vocabulary."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from p17_families import make_checkpoint

    hf_dir = PEERS / "models" / f"{name}-hf"
    shutil.copytree(make_checkpoint("rwkv7"), hf_dir, dirs_exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["RWKV7ForCausalLM"]}, indent=2))
    rwkv_world_vocabulary(hf_dir)
    return hf_dir


def build(name: str) -> Path:
    out = PEERS / "models" / f"{name}.gguf"
    if out.exists():
        return out
    if name.startswith("rwkv7"):
        hf_dir = rwkv7_checkpoint(name)
        subprocess.run([sys.executable, "-c", CONVERT, str(CONVERTER), str(hf_dir), "--outtype", OUTTYPE[name],
                        "--outfile", str(out)], check=True)
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
