"""The compile cache stays within its size: the least recently used model directories go first, never one that a
live process serves from (a real second process holds its claim here; a real server's engine claims its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from linserve.server.engine.compile import cache

HOLD = """
import sys, time
from linserve.server.engine.compile.cache import claim
claim(sys.argv[1])
print("claimed", flush=True)
time.sleep(600)
"""


def model_dir(base, name: str, megabytes: int, used: float):
    path = base / name
    path.mkdir()
    (path / "decode-s8-b1.pt2").write_bytes(os.urandom(megabytes * 1_000_000))
    lock = path / cache.IN_USE
    lock.touch()
    os.utime(lock, (used, used))
    return path


def test_least_recently_used_go_first_and_claimed_ones_stay(tmp_path):
    now = time.time()
    oldest = model_dir(tmp_path, "a-oldest", 2, now - 3000)
    held = model_dir(tmp_path, "b-held-by-another-process", 2, now - 2000)
    older = model_dir(tmp_path, "c-older", 2, now - 1000)
    newer = model_dir(tmp_path, "d-newer", 2, now - 500)
    mine = tmp_path / "e-mine"
    cache.claim(str(mine))  # this process serves from it (made now: the most recent)
    (mine / "decode-s8-b1.pt2").write_bytes(os.urandom(2_000_000))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        removed = cache.prune(str(tmp_path), 4_500_000)  # five of ~2 MB: three must go, two may stay
        # the oldest goes; the held one is skipped; then the next least recently used until it fits
        assert removed == [str(oldest), str(older), str(newer)]
        assert held.exists() and mine.exists() and not oldest.exists()
        assert cache.prune(str(tmp_path), 1) == []  # over the limit, but what is left is in use
    finally:
        holder.kill()
        holder.wait()
    assert cache.prune(str(tmp_path), 1) == [str(held)]  # its process ended: its claim with it
    assert mine.exists()


def test_a_cache_that_cannot_be_written_is_said_and_nothing_stops(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache.claim(str(blocker / "model"))  # its parent is a file: no directory, no lock — and no exception
    assert "cannot mark" in caplog.text and str(blocker / "model") not in cache._claims
    assert cache.prune(str(blocker), 1) == [] and cache.prune(str(tmp_path / "absent"), 1) == []


def test_a_claim_marks_the_directorys_last_use(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / cache.IN_USE).touch()
    os.utime(directory / cache.IN_USE, (0, 0))
    cache.claim(str(directory))
    assert time.time() - os.path.getmtime(directory / cache.IN_USE) < 60
    assert cache.directory_bytes(str(tmp_path)) >= 0


def test_a_server_prunes_its_cache_on_start_and_keeps_what_it_serves(start_server, tmp_path):
    """A real server, its limit below what an old model directory occupies: the old one is removed when the server
    starts compiling; the server's own directory stays."""
    base = tmp_path / "compile"
    base.mkdir()
    old = model_dir(base, "old-model", 3, time.time() - 86_400)
    server = start_server("--compile", "on", "--compile-cache-dir", str(base), "--compile-cache-max-gb", "0.001",
                          "--log-level", "info")
    deadline = time.monotonic() + 60
    while old.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not old.exists()
    used = [path for path in base.iterdir()]
    assert len(used) == 1 and (used[0] / cache.IN_USE).exists()  # the server's own directory stays
    assert "compile cache over its 0.0 GB: removed 1 least recently used model directory (old-model)" in \
        server.log.read_text()


def test_a_builder_closed_for_good_starts_no_compiler_child(tmp_path, monkeypatch):
    """The server's close() can land while its compile thread is about to start a child: after a final close a
    miss raises (the thread ends) instead of starting a child that nothing would end. An ordinary close only
    ends the idle child; the next miss starts another."""
    from linserve.model import LinearGPT
    from tests.helpers import TINY

    started = []

    class Child:
        def __init__(self, *args, **kwargs):
            started.append(self)

        def compile(self, size: int) -> float:
            return 0.0

        def close(self) -> None:
            pass

    monkeypatch.setattr(cache, "CompilerProcess", Child)
    monkeypatch.setattr(cache, "load_artifact", lambda *args, **kwargs: None)  # every bucket a miss
    builder = cache.ChildBuilder(str(tmp_path), LinearGPT(TINY), 2, can_compile=True, autotune=False)
    builder(1)
    builder.close()
    builder(1)
    assert len(started) == 2  # an idle child ended, a later miss started another
    builder.close(final=True)
    with pytest.raises(RuntimeError, match="closed"):  # a miss after the final close starts no compiler
        builder(1)
    assert len(started) == 2


def test_a_compiler_child_whose_server_is_already_gone_exits(tmp_path):
    """The child asks the kernel to kill it when its server dies only once its interpreter is up; a server that
    died before then has handed it to init or a subreaper (whatever its pid): it sees that and leaves."""
    from linserve.server.engine.compile import program_compiler

    env = {**os.environ, program_compiler.PARENT_PID: "999999999"}  # not this child's parent
    result = subprocess.run([sys.executable, "-m", "linserve.server.engine.compile.program_compiler",
                             str(tmp_path), "2", "plain"], env=env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "the server that started this compiler is gone" in result.stderr, result.stderr


def waiting_on(pid: int, path: str) -> bool:
    """Whether process `pid` has `path` open."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_a_bucket_another_process_is_building_is_waited_for_and_not_built_again(tmp_path):
    """Two servers (replicas, test workers) sharing a cache directory build each bucket once: a real compiler child
    asked for a bucket whose build lock another process holds waits, and once that process has put the artifact in
    place and let go, answers `ready` without building it again (the artifact is the other's, byte for byte)."""
    import select

    from linserve.model import LinearGPT, ModelConfig
    from linserve.server.engine.compile import program_compiler

    model = LinearGPT(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2)).eval()
    program_compiler.write_model(str(tmp_path), model)
    path = program_compiler.artifact_path(str(tmp_path), 2, 1)
    with program_compiler.building(path):  # this process "builds" bucket 1
        child = program_compiler.CompilerProcess(str(tmp_path), 2, autotune=False)
        try:
            child.process.stdin.write("1\n")
            child.process.stdin.flush()
            deadline = time.monotonic() + 120  # it loads the model, then opens the lock file and waits on it
            while not waiting_on(child.process.pid, f"{path}.lock"):
                answered, _, _ = select.select([child.process.stdout], [], [], 0.1)
                assert not answered, f"the child built the bucket: {child.process.stdout.readline()}"
                assert time.monotonic() < deadline and child.process.poll() is None, "the child never took the lock"
            answered, _, _ = select.select([child.process.stdout], [], [], 1)
            assert not answered, "the child answered while another process held the bucket's build lock"
            other = os.urandom(4096)
            with open(path, "wb") as artifact:  # the other process's artifact appears
                artifact.write(other)
        except BaseException:
            child.close()
            raise
    try:
        assert child.process.stdout.readline().startswith("ready 1 ")
        with open(path, "rb") as artifact:
            assert artifact.read() == other  # not built again: a build would have replaced it
    finally:
        child.close()


def test_two_threads_writing_a_directorys_model_file_at_once_both_succeed(tiny_model, tmp_path, monkeypatch):
    """The decode and the verification programs' builds may write a cache directory's model file at the same moment
    from one process: each writes a temporary of its own (a name made from the pid alone was one file for both, and
    the second rename found it gone: 'compiling the decode step failed')."""
    import threading

    import torch

    from linserve.server.engine.compile import program_compiler

    both_saved = threading.Barrier(2, timeout=30)
    save = torch.save

    def save_then_wait(payload, path):  # both temporaries written before either is renamed
        save(payload, path)
        both_saved.wait()

    monkeypatch.setattr(program_compiler.torch, "save", save_then_wait)
    errors = []

    def write() -> None:
        try:
            program_compiler.write_model(str(tmp_path), tiny_model)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert errors == []
    assert torch.load(tmp_path / program_compiler.MODEL_FILE, weights_only=False)["config"] == \
        tiny_model.config.to_dict()
    assert sorted(path.name for path in tmp_path.iterdir()) == [program_compiler.MODEL_FILE]
