"""The kernels' ops as torch's tracing sees them: registered once the library is loaded (`kernels.load`)."""

from __future__ import annotations

import torch


def register_fake_ops(packs_tiles: bool) -> None:
    """Each op's outputs' shapes and dtypes from its inputs', for tracing (`torch.compile`, `torch.export`):
    `packs_tiles`, whether `pack_weight` makes the packed (N/16, K/32, 16, 32) form (the loaded form is not
    "scalar")."""
    def shape(x, weight, scale, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    for name in ("invariant_linear", "invariant_linear_scalar"):
        torch.library.register_fake(f"linserve::{name}")(shape)

    @torch.library.register_fake("linserve::invariant_linear_cat")
    def cat_shape(x, w0, w1, w2, w3, s0, s1, s2, s3, n0, n1, n2, n3):
        return x.new_empty((*x.shape[:-1], n0 + n1 + n2 + n3))

    @torch.library.register_fake("linserve::delta_scan")
    def delta_shapes(q, k, v, beta, alpha, S, prefixes):
        B, H, T, _ = q.shape
        return v.new_empty(v.shape), S.new_empty((B, T, H, *S.shape[2:]) if prefixes else S.shape)

    @torch.library.register_fake("linserve::linear_scan")
    def scan_shapes(q, k, v, alpha, S, prefixes):
        B, H, T, _ = q.shape
        return v.new_empty(v.shape), S.new_empty((B, T, H, *S.shape[2:]) if prefixes else S.shape)

    @torch.library.register_fake("linserve::linear_read")
    def read_shape(q, k, v, alpha, pool, slots):
        return v.new_empty(v.shape)

    @torch.library.register_fake("linserve::delta_read")
    def delta_read_shapes(q, k, v, beta, alpha, pool, slots):
        return v.new_empty(v.shape), v.new_empty(v.shape)

    @torch.library.register_fake("linserve::delta_read_folded")
    def delta_folded_shapes(q, k, v, beta, alpha, pool, slots, pk, pu, pa, flag):
        return v.new_empty(v.shape), v.new_empty(v.shape)

    @torch.library.register_fake("linserve::linear_read_folded")
    def read_folded_shape(q, k, v, alpha, pool, slots, pk, pu, pa, flag):
        return v.new_empty(v.shape)

    @torch.library.register_fake("linserve::pending_record")
    def record_shape(pk, pu, pa, flag, slots, k, u, alpha, keep):
        return keep.new_empty(keep.shape)

    @torch.library.register_fake("linserve::state_commit")
    def commit_shape(pool, slots, k, v, alpha, keep):
        return keep.new_empty(keep.shape)

    @torch.library.register_fake("linserve::dplr_step")
    def dplr_shapes(r, d, k, v, a, b, S):
        return v.new_empty(v.shape), S.new_empty(S.shape)

    @torch.library.register_fake("linserve::choose_tokens")
    def chosen_shapes(logits, slots, positions, floats, top_k, seed, bias, counts, seen):
        rows = (logits.shape[0],)
        return (slots.new_empty(rows), slots.new_empty(rows, dtype=torch.bool), logits.new_empty(rows),
                logits.new_empty(logits.shape), slots.new_empty(rows, dtype=torch.bool))

    @torch.library.register_fake("linserve::verify_choose")
    def verified_shapes(logits, ids, limits, slots, positions, floats, seed, bias, counts, seen):
        rows, V = (logits.shape[0],), logits.shape[-1]
        return (ids.new_empty(ids.shape), ids.new_empty(rows), ids.new_empty(rows, dtype=torch.bool),
                logits.new_empty(rows), logits.new_empty((*rows, V)), logits.new_empty((*rows, V)))

    @torch.library.register_fake("linserve::pack_weight")
    def packed_shape(weight):
        if not packs_tiles:
            return weight.new_empty(weight.shape)
        n, k = weight.shape
        return weight.new_empty(((n + 15) // 16, (k + 31) // 32, 16, 32))
