from __future__ import annotations

import os
from pathlib import Path

import pytest

from linserve.model.training.corpus import Corpus, load_corpus

REPO = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO / "data" / "corpus"  # cached between runs; downloaded on first use (training tests only)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The suite compares served tokens with fp32 references (the model run directly, HF generate, recorded
# fixtures): every server it starts, in process or not, loads fp32 weights unless a test says otherwise.
# `dtype=auto` (bf16 where the CPU computes it) has its own tests.
os.environ.setdefault("LINSERVE_DTYPE", "float32")
# OpenAI's request defaults (temperature 1, 16 tokens) rather than the shipped checkpoint's generation_config.json
# (0.8, top_k 50, 200 tokens): the suite's requests were written against them; tests/server/test_generation_defaults.py
# serves with the checkpoint's
os.environ.setdefault("LINSERVE_GENERATION_CONFIG", "none")


def pytest_addoption(parser):
    parser.addoption("--device", choices=["cpu", "cuda"], default=os.environ.get("LINSERVE_TEST_DEVICE", "cpu"),
                     help="device the model, engine and servers under test run on (default: cpu, or "
                          "$LINSERVE_TEST_DEVICE); tests marked `cuda` run only with --device cuda")
    parser.addoption("--api-servers", default=os.environ.get("LINSERVE_TEST_API_SERVERS") or None,
                     help="`linserve serve --api-servers` of every real server the tests start that does not "
                          "choose its own (default: serve's own default — the engine core in a process of its own "
                          "on 2 CPUs or more; 0: the engine in the HTTP process; 2: the core and two frontends)")


WORKERS_AT_MOST = 4  # `-n auto`'s workers: one per CPU up to this (each starts servers and compiler children)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook)
def pytest_xdist_auto_num_workers(config):
    """pytest-xdist's `-n auto` (pyproject's addopts): one worker per CPU this process may use, at most
    WORKERS_AT_MOST — on CI's 2 cores, 2: a test waiting on a server, a subprocess or a socket leaves its CPU to
    the other worker's."""
    return max(1, min(len(os.sched_getaffinity(0)), WORKERS_AT_MOST))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; runs only under --device cuda")
    name = config.getoption("--device")
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
    os.environ["LINSERVE_TEST_DEVICE"] = name  # read by tests/devices.py, also in spawned helpers
    if config.getoption("--api-servers") is not None:
        os.environ["LINSERVE_TEST_API_SERVERS"] = str(config.getoption("--api-servers"))  # read by ServerProcess


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") != "cuda":
        skip = pytest.mark.skip(reason="needs --device cuda (a CUDA GPU)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """The torch device under test (`pytest --device cuda` on a GPU machine)."""
    from tests.devices import device_under_test

    return device_under_test()


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return load_corpus(CORPUS_DIR)


@pytest.fixture(scope="session")
def small_tokenizer():
    """A 1k-vocab BPE trained on two plays (`train_bpe` over romeo_and_juliet and tempest), committed as
    tests/fixtures/tokenizer-1k.json: the engine and server tests need no corpus download."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(FIXTURES / "tokenizer-1k.json"))


@pytest.fixture(scope="session")
def hf_tokenizer(small_tokenizer):
    """The transformers view of the small tokenizer (what the engine and server use)."""
    from linserve.model.training.tokenizer import wrap

    return wrap(small_tokenizer)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One compile cache for the whole run, shared by its workers: every test that compiles the same model with the
    same slot count loads what an earlier one built (an AOTInductor build takes up to a few minutes on 2 cores), and
    a bucket two workers ask for at once is built by one while the other waits (program_compiler.building).
    `LINSERVE_TEST_COMPILE_CACHE=DIR` keeps it between runs (repeating the compile tests, e.g. under load)."""
    kept = os.environ.get("LINSERVE_TEST_COMPILE_CACHE")
    if kept:
        return kept
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (each worker's base temp is a folder of the run's own)
        shared = tmp_path_factory.getbasetemp().parent / "compile_cache"
        shared.mkdir(exist_ok=True)
        return str(shared)
    return str(tmp_path_factory.mktemp("compile_cache"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, small_tokenizer):
    """A tiny random-weight LinearGPT saved in the HF layout with the small tokenizer."""
    import torch

    from linserve.model import LinearGPT, ModelConfig
    from linserve.model.training.trainer import save_checkpoint

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=small_tokenizer.get_vocab_size(), d_model=64, n_layers=2, n_heads=4,
                         conv_kernel=3, decay=True, chunk_size=16)
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    save_checkpoint(LinearGPT(config), small_tokenizer, directory, torch.float32)
    return directory
