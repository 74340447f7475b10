"""Every served fla family and option against fla's own model (tests/model/families/fla_reference.py: fla's
config and model classes, seeded random weights, `save_pretrained`, fla's kernels under Triton's interpreter):
the prompt's log-probabilities, every layer's final state and 64 greedy tokens of cached decoding (fp32, 1e-4)."""

from __future__ import annotations

import pytest

from tests.model.families.reference import compare_with_fla, make_references

# fla makes all 33 references first, one process per core (~2 min on 2 cores, more beside other work): the fixture's
# setup counts against the first test's deadline
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CASES = {
    # linear_attn: every feature map, then the options
    "linear_attn-elu": ("linear_attn", {"feature_map": "elu"}),
    "linear_attn-relu": ("linear_attn", {"feature_map": "relu", "tie_feature_map_qk": True}),
    "linear_attn-identity": ("linear_attn", {"feature_map": "identity"}),
    "linear_attn-hedgehog": ("linear_attn", {"feature_map": "hedgehog"}),
    "linear_attn-t2r": ("linear_attn", {"feature_map": "t2r"}),
    "linear_attn-dpfp": ("linear_attn", {"feature_map": "dpfp"}),
    "linear_attn-elementwise_product": ("linear_attn", {}),  # fla's default map
    "linear_attn-normalised": ("linear_attn", {"feature_map": "elu", "norm_q": True, "norm_k": True,
                                               "norm_feature_map": True}),
    "linear_attn-grouped-expanded": ("linear_attn", {"feature_map": "t2r", "num_kv_heads": 2, "expand_k": 2.0,
                                                     "expand_v": 0.5}),
    "linear_attn-powlu": ("linear_attn", {"feature_map": "relu", "hidden_act": "powlu"}),
    "linear_attn-tied-plain-norms": ("linear_attn", {"feature_map": "hedgehog", "tie_word_embeddings": True,
                                                     "elementwise_affine": False, "intermediate_size": 96,
                                                     "fuse_norm": False}),
    # gla
    "gla": ("gla", {}),
    "gla-conv-grouped-clamped": ("gla", {"use_short_conv": True, "conv_size": 3, "num_kv_heads": 2,
                                         "clamp_min": -0.05, "feature_map": "relu"}),
    "gla-ungated-unfused": ("gla", {"use_output_gate": False, "fuse_norm": False, "expand_k": 1.0,
                                    "expand_v": 2.0, "tie_word_embeddings": True}),
    # retnet
    "retnet": ("retnet", {}),
    "retnet-grouped-mapped-ungated": ("retnet", {"num_kv_heads": 2, "feature_map": "swish",
                                                 "use_output_gate": False, "hidden_ratio": 3}),
    # delta_net
    "delta_net": ("delta_net", {}),
    "delta_net-gated-relu-sum": ("delta_net", {"use_gate": True, "qk_activation": "relu", "qk_norm": "sum"}),
    "delta_net-unconvolved-elu-no_beta-negative": ("delta_net", {"use_short_conv": False, "qk_activation": "elu",
                                                                  "use_beta": False, "allow_neg_eigval": True}),
    "delta_net-identity-expanded-conv3": ("delta_net", {"qk_activation": "identity", "expand_k": 0.5,
                                                        "expand_v": 2.0, "conv_size": 3, "tie_word_embeddings": True}),
    "delta_net-unconvolved-silu-gated": ("delta_net", {"use_short_conv": False, "use_gate": True}),
    # gated_deltanet
    "gated_deltanet": ("gated_deltanet", {"head_dim": 16}),
    "gated_deltanet-grouped_values-sigmoid-negative": ("gated_deltanet", {
        "head_dim": 16, "num_heads": 2, "num_v_heads": 4, "output_gate_activation": "sigmoid",
        "allow_neg_eigval": True}),
    "gated_deltanet-ungated-unconvolved-square": ("gated_deltanet", {"head_dim": 16, "use_gate": False,
                                                                     "use_short_conv": False, "expand_v": 1.0}),
    # hybrids: sliding-window softmax layers (windows shorter than the prompt, and one filled while decoding)
    "gated_deltanet-window-hybrid": ("gated_deltanet", {"head_dim": 16, "attn": {
        "layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 16}}),
    "gla-window-hybrid-biased": ("gla", {"attn": {"layers": [0], "num_heads": 2, "window_size": 8,
                                                  "qkv_bias": True, "rope_theta": 500.0}}),
    "delta_net-window-hybrid-filling": ("delta_net", {"attn": [{"layers": [0], "num_heads": 4, "window_size": 48}]}),
    # mamba2: fla's (one group: its CPU prefill tiles groups, mamba2.py), then transformers' layout and defaults
    "mamba2": ("mamba2", {"head_dim": 32, "state_size": 16}),
    "mamba2-hdim_D-norm_first-tied-conv3-limited": ("mamba2", {
        "head_dim": 16, "num_heads": 8, "state_size": 8, "D_has_hdim": True, "norm_before_gate": True,
        "tie_word_embeddings": True, "conv_kernel": 3, "dt_limit": [0.01, 0.5], "use_bias": True}),
    "mamba2-ungated_norm-gelu": ("mamba2", {"head_dim": 32, "state_size": 16, "rmsnorm": False,
                                            "hidden_act": "gelu", "use_conv_bias": False}),
    "mamba2-transformers-groups": ("mamba2", {"head_dim": 16, "num_heads": 8, "state_size": 16, "n_groups": 4,
                                              "chunk_size": 16}, "transformers"),
    # rwkv7: fla's defaults at this width (LoRA ranks by fla's formulas), then every option
    "rwkv7": ("rwkv7", {"head_dim": 16, "decay_low_rank_dim": None, "gate_low_rank_dim": None,
                        "a_low_rank_dim": None, "v_low_rank_dim": None}),
    "rwkv7-unfused-relu-nobias": ("rwkv7", {"head_dim": 16, "fuse_norm": False,
                                                    "hidden_act": "relu", "norm_bias": False, "norm_first": False,
                                                    "intermediate_size": 96, "tie_word_embeddings": True,
                                                    "decay_low_rank_dim": 8, "gate_low_rank_dim": 16,
                                                    "a_low_rank_dim": 8, "v_low_rank_dim": 8}),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return make_references(tmp_path_factory.mktemp("fla"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_linserve_computes_what_fla_computes(references, case):
    compare_with_fla(references[case])
