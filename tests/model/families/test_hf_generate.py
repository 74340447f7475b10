"""generate() over an fla family (model/families/hf.py): greedy equals the model's own loop, the prompt is read
once and then one token per step (the state is the cache), and the final state comes back."""

from __future__ import annotations

import pytest
import torch

from linserve.model.families.hf import FamilyForCausalLM
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint


@pytest.mark.parametrize("family", list(FAMILY_CASES))
@torch.no_grad()
def test_generate_reads_the_prompt_once_and_equals_the_models_own_greedy_loop(tmp_path, family):
    lm = FamilyForCausalLM.from_checkpoint(write_checkpoint(tmp_path, FAMILY_CASES[family]))
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(1))
    calls = []
    hook = lm.family.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    out = lm.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    hook.remove()
    assert calls == [9] + [1] * 11
    logits, state = lm.family(ids)
    want = []
    for _ in range(12):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        want.append(token)
        logits, state = lm.family(token, state)
    assert torch.equal(out.sequences[:, 9:], torch.cat(want, dim=1))
    carried = out["cache"] if "cache" in out else out["past_key_values"]
    _, expected = lm.family(out.sequences[:, :-1])
    for name, tensor in expected.tensors().items():
        torch.testing.assert_close(carried.tensors()[name], tensor, rtol=1e-4, atol=2e-4)
