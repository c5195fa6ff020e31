"""The roofline's numerator counted from the routing itself: the weight bytes a step of the trunk
reads when its MoE layers read only the experts its rows route to, each once however many rows
chose it (the decode kernels of nextn.ops.triton_moe stream an expert's tiles for each (row, slot)
that names it; rows of a step that share an expert share its tiles through L2, so the bytes from
HBM are the distinct experts').

A decode step's one row reads exactly top-k experts a layer; a verify of K + 1 rows or a batch of
B sequences reads the union of its rows' experts, between top-k and min(E, rows * top-k) a layer,
which neither "every expert" nor "top-k times the rows" gives. `routing` runs the trunk's module
forward over a token sequence once and keeps each MoE layer's routed experts per position (hooks on
the routers); `distinct_experts` counts a step's union per layer from them, and `step_bytes` turns
those counts into bytes (nextn.models.random_weights.weight_bytes_per_token). Times nothing (the
bench does).
"""

from __future__ import annotations

import torch

from nextn.layers.ffn import Router
from nextn.models.qwen3_5 import CausalLM
from nextn.ops import Ops


@torch.no_grad()
def routing(model: CausalLM, token_ids: list[int], ops: Ops | None = None) -> list[torch.Tensor]:
    """Per trunk MoE layer (in layer order), the experts each of token_ids' positions routes to,
    [T, top_k] on the CPU, from one forward of the trunk over the sequence (no cache)."""
    routers = [layer.mlp.gate for layer in model.model.layers if isinstance(getattr(layer.mlp, "gate", None), Router)]
    found: list[torch.Tensor | None] = [None] * len(routers)

    def keep(i):
        def hook(module, args, out):
            found[i] = out[0].reshape(-1, module.top_k).cpu()  # (top_idx, top_w)

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        device = next(model.parameters()).device
        model(torch.tensor([token_ids], device=device), ops=ops)
    finally:
        for h in handles:
            h.remove()
    return [t for t in found if t is not None]


def distinct_experts(routed: list[torch.Tensor], steps: list[list[int]]) -> list[float]:
    """Per MoE layer, the mean over `steps` (each a step's rows: positions into the routed sequence)
    of the number of distinct experts the step's rows route to."""
    if not steps:
        raise ValueError("distinct_experts: no step to count")
    return [sum(idx[rows].unique().numel() for rows in steps) / len(steps) for idx in routed]


def verify_steps(first: int, last: int, k: int) -> list[list[int]]:
    """The row positions of the verify steps of K = k over positions first..last - 1 (back to back
    windows of k + 1 rows, as rounds that accept every draft run them)."""
    return [list(range(p, p + k + 1)) for p in range(first, last - k, k + 1)]


def routed_roofline(
    model: CausalLM,
    sequence: list[int],
    first: int,
    ks: list[int],
    batch_sizes: list[int],
    bandwidth_GBps: float | None,
    ops: Ops | None = None,
) -> dict:
    """The bench's roofline keys of an MoE model, counted from the routing of `sequence` (a prompt
    and its plain greedy continuation from position `first`): `routed_experts_per_layer` (the mean
    distinct experts a step reads per MoE layer: "decode", one row; "verify"[K], K + 1 consecutive
    rows; "batch"[B], the rows of B sequences at one position, which route alike in the bench: its
    sequences are one prompt), the bytes each such step reads (`weight_bytes_per_token`, a decode
    step's; `verify_weight_bytes`, `batch_weight_bytes_per_step`) and, with a bandwidth, the
    rooflines they imply (`roofline_tokens_per_s`; `batch_roofline_tokens_per_s`: B tokens a step)."""
    from nextn.models.random_weights import weight_bytes_per_token

    routed = routing(model, sequence, ops)
    decode = [[p] for p in range(first, len(sequence))]
    counts = {"decode": distinct_experts(routed, decode), "verify": {}, "batch": {}}
    for k in ks:
        if steps := verify_steps(first, len(sequence), k):
            counts["verify"][k] = distinct_experts(routed, steps)
    for b in batch_sizes:
        counts["batch"][b] = distinct_experts(routed, [[p] * b for p in range(first, len(sequence))])
    out = {
        "routed_experts_per_layer": counts,
        "weight_bytes_per_token": weight_bytes_per_token(model, counts["decode"]),
        "verify_weight_bytes": {k: weight_bytes_per_token(model, c) for k, c in counts["verify"].items()},
        "batch_weight_bytes_per_step": {b: weight_bytes_per_token(model, c) for b, c in counts["batch"].items()},
    }
    if bandwidth_GBps is not None:
        out["roofline_tokens_per_s"] = bandwidth_GBps * 1e9 / out["weight_bytes_per_token"]
        out["batch_roofline_tokens_per_s"] = {
            b: b * bandwidth_GBps * 1e9 / nbytes for b, nbytes in out["batch_weight_bytes_per_step"].items()
        }
    return out
