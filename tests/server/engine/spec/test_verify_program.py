"""The verification program (speculative decoding): one chunked pass from a row's state gives what k + 1
plain decode steps give — logits, chosen tokens and the state after every accepted prefix — and its compiled
buckets compute what the eager program does."""

from __future__ import annotations

import pytest
import torch

from linserve.server.engine.compile.compiled_decode import DecodeStep
from linserve.server.engine.decode_program import DECODE, verify_kind
from linserve.server.engine.sampling import SlotSampling
from linserve.server.engine.spec.verify_program import VerifyOutputs
from linserve.server.engine.state_pool import StatePool
from tests.helpers import SamplingParams

K = 4


def steps(model, device, mode="off", max_rows=4, cache_dir=None, slots=8):
    """A pool whose slots hold some history, a verification step and a decode step over it."""
    pool = StatePool(model, slots, device)
    for buffer in pool.buffers.values():
        buffer.uniform_(0, 0.5)  # a history-like state (z > 0)
    sampling = SlotSampling(slots, model.config.vocab_size, device)
    for slot in range(slots):  # even slots greedy, odd ones sampled (one with penalties, one with a bias)
        params = SamplingParams(temperature=0.0 if slot % 2 == 0 else 0.9, frequency_penalty=0.5 * (slot == 3),
                                repetition_penalty=1.2 if slot == 3 else 1.0,
                                logit_bias=((7, 5.0),) if slot == 5 else ())
        sampling.assign(slot, params, 1000 + slot, None, [1, 2, 3])
    verify = DecodeStep(model, pool, sampling, device, mode, max_rows=max_rows, cache_dir=cache_dir,
                        autotune=False, kind=verify_kind(K))
    decode = DecodeStep(model, pool, sampling, device, "off", max_rows=max_rows)
    return pool, sampling, verify, decode


def plain_decoding(decode, pool, sampling, slot, pending, position, n):
    """n plain decode steps from a slot (the program writes each back, as in the engine): the tokens, each
    state and the slot's counts after each."""
    tokens, states, counts = [], [], []
    for i in range(n):
        out = decode([pending], [slot], [position + i])  # (the program writes the slot's state and counts)
        pending = int(out.tokens[0])
        tokens.append(pending)
        pool.settle([slot])  # (the commit it left pending for the next read, written: the pool as the state)
        states.append([buffer[slot : slot + 1].clone() for buffer in pool.buffers.values()])
        counts.append(sampling.counts[slot].clone())
    return tokens, states, counts


def slot_state(pool, slot):
    return [buffer[slot : slot + 1].clone() for buffer in pool.buffers.values()]


@torch.inference_mode()
def test_drafts_are_accepted_exactly_as_far_as_plain_decoding_agrees(tiny_model, device):
    """For greedy, sampled and penalised rows: drafts equal to what plain decoding emits are all accepted,
    a wrong draft at j stops acceptance at j and the token there is plain decoding's; the state the program writes
    into the slot is the one plain decoding reaches after the same tokens (the rollback), within fp tolerance, and
    the slot's counts are plain decoding's after those tokens and the next (it counts them as decode steps do);
    the state it read comes back as it was."""
    for slot in (0, 1, 3, 5):
        for wrong_at in (None, 0, 2):
            pool, sampling, verify, decode = steps(tiny_model, device)
            start_state = pool.export(slot, device)
            start_sampling = sampling.export(slot)
            before = slot_state(pool, slot)
            truth, states, counts = plain_decoding(decode, pool, sampling, slot, 17, 50, K + 1)
            pool.load(slot, start_state)
            sampling.load(slot, start_sampling)
            drafts = truth[:K]
            if wrong_at is not None:
                drafts[wrong_at] = (drafts[wrong_at] + 1) % tiny_model.config.vocab_size
            out = VerifyOutputs(*(raw := verify.run([[17], *[[d] for d in drafts], [K], [slot], [50]]))[:9],
                                before=raw[9:])
            kept = int(out.kept[0])
            assert kept == (K if wrong_at is None else wrong_at), (slot, wrong_at, kept)
            assert out.emitted[0, : kept + 1].tolist() == truth[: kept + 1]
            assert int(out.next[0]) == truth[kept] and not bool(out.redraw[0])
            assert out.table[0].tolist()[K + 1 :] == [kept, truth[kept], 1, 0]
            for got, want in zip(slot_state(pool, slot), states[kept]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(sampling.counts[slot], counts[kept])
            for got, want in zip(out.before, before):
                assert torch.equal(got, want)
            pool.load(slot, start_state)
            sampling.load(slot, start_sampling)
            limited = verify.run([[17], *[[d] for d in truth[:K]], [1], [slot], [50]])  # limit 1: at most 1
            assert int(limited[1][0]) == 1 and int(limited[0][0, 1]) == truth[1]


@torch.inference_mode()
def test_a_row_with_limit_zero_gets_a_plain_decode_steps_token(tiny_model, device):
    pool, sampling, verify, decode = steps(tiny_model, device)
    slots = [0, 1, 3, 5]
    start = ({s: pool.export(s, device) for s in slots}, {s: sampling.export(s) for s in slots})
    raw = verify.run([[9, 9, 9, 9], *[[4, 4, 4, 4]] * K, [0] * 4, slots, [30] * 4])  # (the rows' states written)
    verified = [buffer[slots].clone() for buffer in pool.buffers.values()]
    verified_counts = sampling.counts[slots].clone()
    for s in slots:
        pool.load(s, start[0][s])
        sampling.load(s, start[1][s])
    plain = decode([9] * 4, slots, [30] * 4)  # (the rows' states written into the pool)
    pool.settle(slots)  # (the commits left pending for the next read, written)
    assert raw[1].tolist() == [0, 0, 0, 0]
    assert raw[0][:, 0].tolist() == plain.tokens.tolist() == raw[6].tolist()
    torch.testing.assert_close(raw[5], plain.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(raw[3], plain.uniforms)
    for got, buffer in zip(verified, pool.buffers.values()):
        torch.testing.assert_close(got, buffer[slots], rtol=1e-4, atol=1e-4)
    assert torch.equal(verified_counts, sampling.counts[slots])


def test_program_kinds_name_their_io():
    assert DECODE.io_rows == 3 and DECODE.drafts == 0
    assert verify_kind(4).name == "verify4" and verify_kind(4).io_rows == 8
    with pytest.raises(ValueError):
        verify_kind(0)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_compiled_verification_program_matches_eager(tiny_model, device, compile_cache):
    pool, sampling, compiled, _ = steps(tiny_model, device, mode="on", cache_dir=compile_cache)
    eager = DecodeStep(tiny_model, pool, sampling, device, "off", max_rows=4, kind=verify_kind(K))
    compiled.sizes = [4]  # one bucket (a build takes minutes on 2 cores): 1 to 3 rows pad to it, 4 fill it
    compiled.start()
    assert compiled.wait_compiled(2400) and compiled.status == "compiled", compiled.status
    with torch.inference_mode():
        for slots in ([5], [2, 7], [0, 3, 6], [1, 2, 3, 4], [4, 1, 0, 2, 7]):
            ids = [[(11 * s + 3 + j) % 1024 for s in slots] for j in range(K + 1)]
            io = [*ids, [min(s, K) for s in slots], slots, [40 + s for s in slots]]
            start = pool.gather(slots), sampling.counts.clone()
            got, written = compiled.run(io), (pool.gather(slots), sampling.counts.clone())
            pool.scatter(slots, start[0])
            sampling.counts.copy_(start[1])
            want = eager.run(io)
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
            for a, b in zip([*got[3:], *written[0].tensors().values(), written[1]],
                            [*want[3:], *pool.gather(slots).tensors().values(), sampling.counts]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_verification_buckets_are_built_once_speculation_pays_there_and_loaded_from_the_cache(
        tiny_model, device, compile_cache):
    """Issue 48: each verification bucket takes minutes to build on 2 cores, and from 8 rows up speculation
    rarely pays — so the server's verification steps are on demand: at start only what the cache holds is
    loaded; a bucket is built once the policy reports that verification paid at that batch size (`want`); a
    restart loads it without being asked."""
    import os
    import time

    from linserve.server.engine.compile.program_compiler import artifact_path

    pool, sampling, _, _ = steps(tiny_model, device)
    eager = DecodeStep(tiny_model, pool, sampling, device, "off", max_rows=4, kind=verify_kind(K))

    def on_demand() -> DecodeStep:
        step = DecodeStep(tiny_model, pool, sampling, device, "on", max_rows=4, cache_dir=compile_cache,
                          autotune=False, kind=verify_kind(K), on_demand=True)
        step.sizes = [1, 4]  # (bucket 4 may be in the cache already: the test above builds it)
        return step

    step = on_demand()
    cached = [s for s in step.sizes if os.path.exists(artifact_path(step.cache_dir, pool.num_slots, s, f"verify{K}"))]
    step.start()
    step.wait_compiled(600)  # the first pass: loading what the cache holds
    assert step.ready_sizes == cached and step.status == "compiled" and step.describe()["wanted"] == []
    step.want(1)  # verification paid for one row
    deadline = time.monotonic() + 2400
    while 1 not in step.ready_sizes and time.monotonic() < deadline and step.status != "failed":
        time.sleep(0.5)
    assert 1 in step.ready_sizes and step.describe()["wanted"] == [1], step.describe()
    assert step.ready_sizes == sorted({1, *cached})  # nothing else was built
    with torch.inference_mode():
        io = [*[[(7 * j + 3) % 1024] for j in range(K + 1)], [K], [5], [40]]
        got, want = step.run(io), eager.run(io)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    step.close(wait=True)

    restarted = on_demand()
    restarted.start()
    restarted.wait_compiled(600)
    assert 1 in restarted.ready_sizes and restarted.builds.built_seconds == []  # loaded, not asked for, not built
    restarted.close(wait=True)


def test_acceptance_is_the_same_with_and_without_linserves_kernel(monkeypatch):
    """On a CPU `accept_drafts` runs through kernels/sampling.cpp's `verify_choose`, one pass a row that stops at
    its first rejected draft; elsewhere through torch's ops over every position: the same accepted prefix, the same
    tokens up to and at it, and the same uniform, processed and raw logits at it, to the bit — for greedy, sampled
    and penalised rows (the drafts' own counts seen by later positions), with a logit bias, every limit from 0 to
    k, drafts accepted to the end, stopped at each position or by the limit, a slot twice, a row not finite."""
    from linserve.model import kernels
    from linserve.server.engine.spec.verify_program import accept_drafts
    from tests.helpers import require_kernel

    require_kernel()
    cpu = torch.device("cpu")
    vocab, rows, k = 300, 40, 6
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(rows, k + 1, vocab, generator=generator) * 8).round() / 4  # (P, T, V) ties
    logits[9, 2, 4] = float("nan")
    sampling = SlotSampling(rows + 4, vocab, cpu)
    for slot in range(rows + 4):
        penalties = {} if slot % 3 else {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.75}
        params = SamplingParams(temperature=[0.0, 0.8, 1.5][slot % 3 if slot % 6 else 0], top_k=[0, 5][slot % 2],
                                logit_bias=((3, 4.0),) if slot % 7 == 0 else (), **penalties)
        sampling.assign(slot, params, 31 * slot - 2**40, None, [1, 2, slot % vocab])
    sampling.record(torch.arange(rows + 4).repeat(2), torch.randint(0, vocab, (2 * (rows + 4),), generator=generator))
    slots = torch.cat([torch.randperm(rows + 4, generator=generator)[: rows - 1], torch.tensor([5])])  # (P,)
    if int(slots[0]) != 5:
        slots[0] = 5  # (slot 5 twice)
    positions = torch.arange(rows) * 97 + 2**20  # (P,)
    limits = torch.tensor([(k, k, k, 3, 0, 1)[p % 6] for p in range(rows)])  # (P,)
    ids = torch.randint(0, vocab, (rows, k + 1), generator=generator)  # (P, T) [pending, d1 … dk]

    def torch_form(ids):
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "load", lambda: False)
            return accept_drafts(logits, ids, limits, slots, positions, *sampling.tensors())

    # each row's drafts made what torch's form chooses up to a row's own stopping point (its p % (k + 1)): the
    # choice at j depends on d1 … dj only, so position by position
    stop = torch.tensor([p % (k + 1) if p % 5 else k for p in range(rows)])  # (P,) drafts made to agree
    for j in range(k):
        chosen = torch_form(ids)[0]  # (P, T)
        agree = j < stop
        ids[agree, j + 1] = chosen[agree, j]
    want = torch_form(ids)
    got = accept_drafts(logits, ids, limits, slots, positions, *sampling.tensors())
    kept = want[1]
    assert got[1].equal(kept) and got[2].equal(want[2])
    for p in range(rows):
        n = int(kept[p])
        assert got[0][p, : n + 1].equal(want[0][p, : n + 1]), p
        assert (got[0][p, n + 1 :] == -1).all()
    for a, b in zip(got[3:], want[3:]):
        assert a.dtype == b.dtype and a.equal(b)
    assert not got[2][9] and int(got[2].sum()) == rows - 1
    assert {int(n) for n in kept} >= {0, 1, 3, k}  # (stopped by a draft, by the limit, and accepted to the end)
    assert (kept == torch.minimum(stop, limits))[[p for p in range(rows) if p != 9]].all()
