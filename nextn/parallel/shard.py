"""The shard plan of tensor parallelism: which part of each module tensor a rank holds, one table
for the checkpoint loader, the bench's random weights and every step backend (they all hold the
tensors this plan cuts, under the module's own names).

Megatron's layout, with one all-reduce per block (nextn.parallel.comm):
- column-parallel (a rank holds its output rows): q/k/v_proj (whole heads; q_proj's rows are
  [query | gate] per head), the GDN input projections, conv1d, A_log and dt_bias (whole key / value
  heads, each of the [q | k | v (| z)] and [b | a] blocks cut apart), gate/up_proj of the MLP, the
  shared expert and every expert (gate_up_proj's [gate | up] blocks cut apart);
- row-parallel (a rank holds its input columns, and its output is a partial sum): o_proj,
  out_proj, down_proj;
- vocabulary-parallel: embed_tokens and lm_head, ceil(V / N) rows a rank, the last zero-padded;
- replicated: norms, the router, shared_expert_gate, the MTP head's fc (every rank computes them
  alike on the same all-reduced input).
A GDN value head j uses key head j // (HV / HK), so whole key heads with their value heads stay on
one rank; Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` are cut after the loader regroups
them into the Qwen3.5 order. Does not know processes or collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nextn.config.model import ModelConfig

# module leaf names whose output rows are split whole (column-parallel), and whose input columns (row-parallel)
_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a")
_COLUMNS = ("o_proj", "out_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Split:
    """Along `dim` the tensor is consecutive blocks of these sizes (None: one block); a rank holds
    its 1/N of each block, the blocks' parts side by side. pad: the dim is zero-padded to a multiple
    of N first (the vocabulary)."""

    dim: int
    blocks: tuple[int, ...] | None = None
    pad: bool = False

    def local_shape(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = -(-shape[self.dim] // size) if self.pad else shape[self.dim] // size
        return tuple(out)

    def take(self, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s part of the whole tensor t (a copy: the whole one can be freed)."""
        dim = self.dim % t.dim()
        if self.pad:
            rows = -(-t.shape[dim] // size)
            lo, hi = rank * rows, min(t.shape[dim], (rank + 1) * rows)
            part = t.narrow(dim, lo, max(0, hi - lo))
            pad = [0, 0] * (t.dim() - 1 - dim) + [0, rows - part.shape[dim]]
            return F.pad(part, pad).contiguous()
        blocks = self.blocks or (t.shape[dim],)
        if sum(blocks) != t.shape[dim] or any(b % size for b in blocks):
            raise ValueError(f"cannot cut blocks {blocks} of dim {dim} of a {tuple(t.shape)} tensor in {size} parts")
        parts, start = [], 0
        for b in blocks:
            parts.append(t.narrow(dim, start + rank * (b // size), b // size))
            start += b
        return torch.cat(parts, dim=dim).contiguous()


def split_of(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> Split | None:
    """How module tensor `name` (of the whole model, config cfg, shape `shape`) is cut; None:
    every rank holds all of it. Per-expert checkpoint tensors (`experts.{e}.gate_proj.weight`) are
    cut like the MLP's, before the loader packs them."""
    *_, module, param = name.split(".")
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    if module in _VOCAB:
        return Split(0, pad=True)
    if module in _ROWS:
        return Split(0)
    if module in _COLUMNS or (module == "experts" and param == "down_proj"):
        return Split(-1)  # [out, in], or packed experts [E, H, I]
    if module == "experts" and param == "gate_up_proj":  # [E, gate I | up I, H]
        return Split(1, (shape[1] // 2, shape[1] // 2))
    if module in ("in_proj_qkv", "conv1d"):
        return Split(0, (kd, kd, vd))
    if module == "in_proj_qkvz":
        return Split(0, (kd, kd, vd, vd))
    if module == "in_proj_ba":
        return Split(0, (hv, hv))
    if param in ("A_log", "dt_bias"):
        return Split(0)
    return None


def vocab_rows(cfg: ModelConfig) -> int:
    """Rows of the embedding and lm_head a rank holds."""
    return -(-cfg.vocab_size // cfg.tp_size)


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of module tensor `name` of the whole model (t itself when replicated)."""
    split = split_of(name, tuple(t.shape), cfg) if size > 1 else None
    return t if split is None else split.take(t, rank, size)
