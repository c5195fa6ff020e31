"""The fused decode / verify step and MTP head step: a sibling forward of the module forward
(nextn.models.qwen3_5) over the same weights, with batch-invariant Triton kernels. Its fusions
cross module boundaries (a residual inside the previous projection, a SwiGLU inside gate/up, a norm
inside the GEMMs around it), so it is written once here and held to the reference by tests
(tests/test_step.py: the reference's values within float32 tolerance, verify rows equal to decode
rows bitwise, greedy spec equal to plain).

A step runs a batch of sequences (nextn.cache.StepBatch), their rows packed: projections over all
rows, attention and the delta rule per sequence over its own slot. Per decoder layer (the
projections fused at load by nextn.models.loader):
- Gated DeltaNet: [RMSNorm -> in_proj_{qkv,z,b,a}] -> [causal conv -> recurrent delta rule
  (writes the state after every token) -> gated RMSNorm] -> [out_proj + residual];
- attention: [RMSNorm -> q/k/v] -> q/k norm + RoPE + K/V write -> chunked attention * gate
  -> [o_proj + residual];
- MLP: [RMSNorm -> gate/up -> silu * up] -> [down + residual];
- MoE: [RMSNorm -> router and shared-expert gate, top-k] -> [experts' and shared expert's
  silu(gate) * up] -> [their down, weighted sum + residual] (nextn.ops.triton_moe).
Brackets are one kernel each. A norm before a projection lives in the GEMMs around it (the residual
GEMM or MoE block before writes its NormInput, nextn.ops.triton_linear); where none does (the first
layer, after an all-reduce, the MTP head) a launch writes it. A row's arithmetic does not
depend on the number of rows or on the other sequences, so a verify row equals the decode of the
same token bitwise, alone or batched.
Positions and the GDN state locations come from the slots' device counters (nextn.cache.hybrid),
so one CUDA graph serves every round of a batch.

Tensor parallelism (cfg.tp_size > 1): the weights are a rank's shard (nextn.parallel.shard) and a
block's last GEMM runs without its fused residual: its partial product is all-reduced and the
residual added in one call (nextn.parallel.comm.all_reduce_add: the reference modules' sums, bit
for bit, over CUDA IPC between the GPUs of one host), so a captured CUDA graph holds the
collectives; the embedding gathers from the ranks' rows and the logits from their vocabulary columns.

FP8 weights (nextn.ops.fp8), and Q8_0 ones (nextn.ops.q8_0, a QuantWeight of int8 values), reach
the skinny GEMM as QuantWeight pairs in place of tensors. A fused
projection whose members differ in kind (FP8 q/k/v/z beside the bf16 GDN gates b/a) runs one GEMM
per run of one kind, each into its columns of the projection; MoE layers' FP8 experts and shared
expert reach nextn.ops.triton_moe, which dequantizes them tile by tile. An fp8 K/V cache reaches the
attention kernels with its scales (nextn.cache.hybrid.KV), which quantize and dequantize its rows.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from nextn.cache.hybrid import (
    KV,
    PENDING,
    SEQ_LEN,
    STATE_AT,
    STATE_WRITE,
    HybridCache,
    SlotCache,
    StepBatch,
    to_device,
)
from nextn.config import ATTENTION_ROWS, FULL
from nextn.layers.ffn import QuantExperts
from nextn.layers.linear import QuantLinear
from nextn.models.loader import fused_runs, fused_weight
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.fp8 import QuantWeight, compact_scales
from nextn.ops.triton_utils import require_triton
from nextn.parallel.comm import all_reduce_add, embed, gather_vocab

Weight = torch.Tensor | QuantWeight  # what the skinny GEMM reads: a tensor, or e4m3 with its scales


@dataclass
class MLPWeights:
    norm: torch.Tensor  # [H] post_attention_layernorm (zero-centred)
    gate: Weight  # [I, H]
    up: Weight  # [I, H]
    down: Weight  # [H, I]


@dataclass
class MoEWeights:
    norm: torch.Tensor  # [H] post_attention_layernorm
    gates: torch.Tensor  # [E + 1, H]: the router's rows, then shared_expert_gate's (one kernel for both)
    gate_up: Weight  # [E, 2I, H]
    down: Weight  # [E, H, I]
    shared_gate: Weight  # [Is, H]
    shared_up: Weight  # [Is, H]
    shared_down: Weight  # [H, Is]
    top_k: int
    renorm: bool


@dataclass
class GDNWeights:
    norm: torch.Tensor  # [H] input_layernorm
    in_proj: list[Weight]  # row blocks of [conv_dim + value_dim + 2 HV, H]: qkv | z | b | a, one per kind
    conv: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    out_norm: torch.Tensor  # [V] RMSNormGated weight
    out_proj: Weight  # [H, value_dim]
    mlp: MLPWeights | MoEWeights
    # [H] the next layer's input_layernorm, fused into this layer's last GEMM (None: the last
    # layer's, the MTP layer's): set by TritonStep
    next_norm: torch.Tensor | None = None


@dataclass
class AttnWeights:
    norm: torch.Tensor  # [H] input_layernorm
    qkv: Weight  # [Hq*2*D + 2*Hkv*D, H]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: Weight
    mlp: MLPWeights | MoEWeights
    # [H] the next layer's input_layernorm, fused into this layer's last GEMM (None: the last
    # layer's, the MTP layer's): set by TritonStep
    next_norm: torch.Tensor | None = None


def _weight(linear) -> Weight:
    """A linear's weight as the skinny GEMM reads it."""
    return _compact(linear.fp8) if isinstance(linear, QuantLinear) else linear.weight


def _compact(w: Weight) -> Weight:
    """FP8 weights with one scale per 128 rows where that is the same weight (fewer bytes per step)."""
    return compact_scales(w) if isinstance(w, QuantWeight) else w


def _mlp_weights(layer) -> MLPWeights | MoEWeights:
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        ex, se = mlp.experts, mlp.shared_expert
        experts = (ex.gate_up_proj, ex.down_proj)
        if isinstance(ex, QuantExperts):  # (per-row scales: the MoE kernels read them as they are)
            experts = (
                QuantWeight(ex.gate_up_proj, ex.gate_up_proj_scale),
                QuantWeight(ex.down_proj, ex.down_proj_scale),
            )
        shared = [p.fp8 if isinstance(p, QuantLinear) else p.weight for p in (se.gate_proj, se.up_proj, se.down_proj)]
        return MoEWeights(
            layer.post_attention_layernorm.weight,
            torch.cat([mlp.gate.weight, mlp.shared_expert_gate.weight]).detach(),
            *experts,
            *shared,
            mlp.gate.top_k,
            mlp.gate.norm_topk_prob,
        )
    return MLPWeights(
        layer.post_attention_layernorm.weight, _weight(mlp.gate_proj), _weight(mlp.up_proj), _weight(mlp.down_proj)
    )


def _attn_weights(layer) -> AttnWeights:
    a = layer.self_attn
    if a.q_proj.bias is not None:
        raise NotImplementedError("kernels='triton': attention biases are not supported")
    return AttnWeights(
        layer.input_layernorm.weight,
        _compact(fused_weight(a.q_proj, a.k_proj, a.v_proj)),
        a.q_norm.weight,
        a.k_norm.weight,
        _weight(a.o_proj),
        _mlp_weights(layer),
    )


def _gdn_weights(layer) -> GDNWeights:
    g = layer.linear_attn
    if hasattr(g, "in_proj_qkvz"):  # Qwen3-Next: the loader regrouped the rows to the same order
        in_proj = fused_runs(g.in_proj_qkvz, g.in_proj_ba)
    else:
        in_proj = fused_runs(g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a)
    in_proj = [_compact(w) for w in in_proj]
    return GDNWeights(
        layer.input_layernorm.weight,
        in_proj,
        g.conv1d.weight.detach().squeeze(1),
        g.A_log,
        g.dt_bias,
        g.norm.weight,
        _weight(g.out_proj),
        _mlp_weights(layer),
    )


class TritonStep:
    """The trunk's multi-token step and the MTP head's step with Triton kernels, writing into the
    caller's buffers (CUDA-graph friendly: every position and state location is a device value).

    run_if: a device flag the runner sets while a head step may be one the draft gate cut
    (ModelRunner.when): every kernel of the head step reads it first and
    returns where it is 0, so a skipped step costs its empty launches. Torch ops between them still
    run on the unwritten buffers; their results are discarded (nextn.spec.proposer). head_skips:
    whether the head step honours it: not with an MoE head, whose routing kernels
    (nextn.ops.triton_moe) take no flag and would route garbage rows to arbitrary expert ids."""

    def __init__(self, model: CausalLM, hidden_after_norm: bool = True):
        require_triton()
        from nextn.ops import triton_attention, triton_gdn, triton_linear, triton_norm

        self.attn, self.gdn, self.linear, self.norm = triton_attention, triton_gdn, triton_linear, triton_norm
        cfg = model.cfg
        self.model, self.cfg, self.eps = model, cfg, cfg.rms_norm_eps
        self.after_norm = hidden_after_norm
        self.layers = [
            _attn_weights(layer) if layer.kind == FULL else _gdn_weights(layer) for layer in model.model.layers
        ]
        for w, after in itertools.pairwise(self.layers):
            w.next_norm = after.norm
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.lm_head = model.lm_head_weight
        self.head_weights = None
        if model.mtp is not None:
            h = model.mtp
            self.head_weights = (
                h.pre_fc_norm_embedding.weight,
                h.pre_fc_norm_hidden.weight,
                _weight(h.fc),
                _attn_weights(h.layers[0]),
                h.norm.weight,
            )
        self._rope: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.run_if: torch.Tensor | None = None
        self.head_skips = self.head_weights is not None and isinstance(self.head_weights[3].mlp, MLPWeights)

    def rope_tables(self, max_pos: int):
        """cos, sin [>= max_pos, rotary_dim] as the reference computes them (model dtype).

        Tables only grow, and old ones stay alive: captured CUDA graphs hold their addresses.
        """
        if not self._rope or self._rope[-1][0] < max_pos:
            n = max(max_pos, self.cfg.max_position_embeddings + 1)
            positions = torch.arange(n, device=self.embed.device)
            self._rope.append((n, *self.model.rotary.cos_sin(positions, self.embed.dtype)))
        return self._rope[-1][1], self._rope[-1][2]

    def linear_uses(self, head: bool = True, head_vocab: int | None = None) -> list[tuple[int, int, bool, str]]:
        """(N, K, second weight, kind: "" bf16 or the quantized format's name) of each skinny_linear one trunk step
        runs (and the MTP head's step, with head=True, its logits over head_vocab rows: a draft
        vocabulary's; default the full lm_head's), repeats included."""
        uses = []

        def use(w: Weight, dual: bool = False):
            uses.append((*w.shape, dual, w.format.name if isinstance(w, QuantWeight) else ""))

        def mlp(w):
            if not isinstance(w, MoEWeights):  # (the MoE block's router runs in its own kernel)
                use(w.gate, dual=True)
                use(w.down)

        def layer(w):
            attn = isinstance(w, AttnWeights)
            for proj in [w.qkv] if attn else w.in_proj:
                use(proj)
            use(w.o_proj if attn else w.out_proj)
            mlp(w.mlp)

        for w in self.layers:
            layer(w)
        use(self.lm_head)
        if head and self.head_weights is not None:
            use(self.head_weights[2])
            layer(self.head_weights[3])
            if head_vocab is not None:
                kind = self.lm_head.format.name if isinstance(self.lm_head, QuantWeight) else ""
                uses.append((head_vocab, self.lm_head.shape[1], False, kind))  # a copy of its rows
        return uses

    def tune(self, log=None, head_vocab: int | None = None) -> dict:
        """Measure the skinny GEMM's block configs for this model's weight shapes (before capture);
        head_vocab: the rows of a draft vocabulary's lm_head copy, when the head drafts over one."""
        from nextn.ops import linear_tune

        return linear_tune.tune(sorted(set(self.linear_uses(head_vocab=head_vocab))), self.embed.device, log=log)

    def _add(self, x: torch.Tensor, inp: torch.Tensor, w: Weight, norm: torch.Tensor | None):
        """(x + inp @ w.T, the NormInput of the norm after it (weight `norm`) or None): a block's end.
        The residual and the next norm's input are fused into the GEMM, or under tensor parallelism
        the residual is added to the all-reduce of the ranks' partial products (the reference's
        order) and the norm's input made by a launch."""
        lin = self._lin
        if self.cfg.tp_size == 1:
            return lin(inp, w, residual=x, norm_out=norm) if norm is not None else (lin(inp, w, residual=x), None)
        return self._reduce_add(lin(inp, w), x, norm)

    def _reduce_add(self, partial: torch.Tensor, x: torch.Tensor, norm: torch.Tensor | None):
        """Under tensor parallelism: (x + the all-reduce of the ranks' partial sums, the NormInput of the
        norm after it (a launch) or None)."""
        out = all_reduce_add(partial, x, self.cfg)
        return out, self._norm_input(out, norm) if norm is not None else None

    def _lin(self, *args, **kwargs) -> torch.Tensor:
        return self.linear.skinny_linear(*args, run_if=self.run_if, **kwargs)

    def _norm_input(self, x: torch.Tensor, weight: torch.Tensor):
        """The zero-centred RMSNorm before a projection where no GEMM wrote its input: a launch
        (skipped with the call); the projection applies the norm (`_project`)."""
        return self.norm.norm_input(x, weight, run_if=self.run_if)

    def _project(self, ni, w: Weight, **kwargs) -> torch.Tensor:
        """rms_norm(x) @ w.T from the norm's NormInput ni."""
        return self._lin(None, w, rms=ni, eps=self.eps, **kwargs)

    @staticmethod
    def _mlp_norm(w: MLPWeights | MoEWeights) -> torch.Tensor | None:
        """The norm before an MLP whose input the block before writes (an MoE block normalises x itself)."""
        return w.norm if isinstance(w, MLPWeights) else None

    def _logits(self, normed: torch.Tensor, lm_head: torch.Tensor | None, out: torch.Tensor) -> None:
        """Float32 logits into out [M, V or Vd]: over the given rows (a draft vocabulary's, never
        sharded), or the lm_head's (gathered from the ranks' vocabulary columns)."""
        lin = self._lin
        if lm_head is not None or self.cfg.tp_size == 1:
            lin(normed, self.lm_head if lm_head is None else lm_head, out=out)
            return
        local = lin(normed, self.lm_head, out_dtype=torch.float32)  # [M, ceil(V / N)]
        gather_vocab(local, self.cfg, out=out)

    def _mlp(self, x, ni, w: MLPWeights | MoEWeights, next_norm: torch.Tensor | None):
        """(x + the MLP of x, the next norm's NormInput or None); ni: the MLP norm's (a dense MLP;
        the MoE block normalises x itself)."""
        if isinstance(w, MoEWeights):
            from nextn.ops.triton_moe import moe_step

            tp = self.cfg.tp_size > 1
            block = moe_step(
                x,
                w.norm,
                self.eps,
                w.gates,
                w.gate_up,
                w.down,
                w.shared_gate,
                w.shared_up,
                w.shared_down,
                w.top_k,
                w.renorm,
                residual=not tp,
                norm_out=None if tp else next_norm,
            )
            if tp:  # the block's partial sum
                return self._reduce_add(block, x, next_norm)
            return block if next_norm is not None else (block, None)  # (moe_step returns the pair with norm_out)
        act = self._project(ni, w.gate, up_weight=w.up)
        return self._add(x, act, w.down, next_norm)

    def _attn(self, x, ni, w: AttnWeights, kv: KV, batch: StepBatch, row_pos, rope_offset: int):
        """(the layer's output, the next norm's NormInput or None); ni: the input norm's. Row i's K/V
        at position row_pos[i] (int32 [M]) of slot batch.row_slot[i], its rope at row_pos[i] + rope_offset."""
        row_slot, max_pos = batch.row_slot, batch.max_pos  # max_pos: an eager prefill step's bound, else None
        qkv = self._project(ni, w.qkv)
        cos, sin = self.rope_tables(kv.key.shape[1] + 1)
        heads = self.cfg.num_attention_heads
        scales = dict(key_scale=kv.key_scale, value_scale=kv.value_scale, run_if=self.run_if)  # fp8 scales or None
        q = self.attn.qk_norm_rope(
            qkv,
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            row_slot,
            row_pos,
            kv.key,
            kv.value,
            heads,
            self.eps,
            rope_offset,
            **scales,
        )
        if max_pos is None:  # a graphed step: its rows in one launch
            o = self.attn.attend_step(q, qkv, kv.key, kv.value, row_slot, row_pos, **scales)
        else:  # an eager prefill step: blocks of ATTENTION_ROWS rows bound the partials (a row's bits are its own)
            o = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            for a in range(0, q.shape[0], ATTENTION_ROWS):
                b = a + ATTENTION_ROWS
                args = (q[a:b], qkv[a:b], kv.key, kv.value, row_slot[a:b], row_pos[a:b])
                self.attn.attend_step(*args, out=o[a:b], max_pos=max_pos, **scales)
        return self._mlp(*self._add(x, o, w.o_proj, self._mlp_norm(w.mlp)), w.mlp, w.next_norm)

    def _gdn(self, x, ni, w: GDNWeights, batch: StepBatch, j: int, steps: list[dict]):
        """(the layer's output, the next norm's NormInput or None); ni: the input norm's; steps: the GDN
        step kernel's launches, each its sequences (seqs) with its store_all, live and preconv (`trunk`),
        into one output."""
        if len(w.in_proj) == 1:
            proj = self._project(ni, w.in_proj[0])  # [M, conv | z | b | a]
        else:  # runs of one kind (FP8 qkv | z, bf16 b | a), each into its columns
            proj = x.new_empty(x.shape[0], sum(p.shape[0] for p in w.in_proj))
            col = 0
            for part in w.in_proj:
                self._project(ni, part, out=proj[:, col : col + part.shape[0]])
                col += part.shape[0]
        o = None
        for step in steps:  # (each launch writes its sequences' rows of o)
            if "chunked" in step:
                o = self._gdn_chunked(proj, w, batch, j, step, o)
            else:
                o = self._gdn_mix(proj, w, batch.cache, j, out=o, **step)
        return self._mlp(*self._add(x, o, w.out_proj, self._mlp_norm(w.mlp)), w.mlp, w.next_norm)

    def _gdn_chunked(self, proj, w: GDNWeights, batch: StepBatch, j: int, launch: dict, out):
        """GDN layer j of the prompt pieces batch.rows[lo:hi] (launch: `_gdn_launches`'s, StepBatch.chunked)
        into their rows of out (None: a new [M, HV * V]), in five launches: the conv pre-pass over
        their rows, which also writes each slot's next carried columns (nextn.ops.triton_gdn.conv_prepass);
        the rule's inputs with the pieces one after another in whole chunks (`StepBatch.chunk_layout`;
        triton_gdn_chunk.chunk_inputs: zero rows to a piece's last chunk's end, which leave a chunk's
        other rows and the state as they are); the chunked delta rule (two) from each slot's base state,
        its last state into the write half (the scan reads and writes the slots' halves); the gated norm
        of the pieces' rows. Every launch's size is set by the pieces' count, total rows and chunks, not
        their split (`StepBatch.resplit`). The reference: the module's chunked prefill of each piece
        (nextn.layers.gdn, StepBatch.chunked)."""
        from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule, chunk_inputs, gated_norm_rows

        lo, hi = launch["chunked"]
        cfg, cache = self.cfg, batch.cache
        heads = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        conv_dim, value_dim = w.conv.shape[0], heads[2] * heads[3]
        window, states = cache.tensors["window"][:, j], cache.tensors["states"][:, j]
        layout = batch.chunk_layout(lo, hi)
        conv = self.gdn.conv_prepass(proj, w.conv, window, cache.ctl[:, STATE_AT:], launch["seqs"], PENDING - STATE_AT,
                                     layout.bound, False, window_out=True)  # fmt: skip
        inputs = chunk_inputs(conv, proj, conv_dim + value_dim, layout.index, w.A_log, w.dt_bias, heads)
        slot_states = (states, launch["read"], launch["write"])
        o, _ = chunk_gated_delta_rule(*inputs, slot_states=slot_states, chunk_starts=layout.starts)
        if out is None:
            out = proj.new_empty(proj.shape[0], value_dim)
        first, end = batch.offsets[lo], batch.offsets[hi]
        z = proj[first:end, conv_dim : conv_dim + value_dim]
        gated_norm_rows(o.flatten(0, 1).flatten(1), layout.real, z, w.out_norm, self.eps, out[first:end])
        return out

    def _gdn_mix(self, proj, w: GDNWeights, cache: HybridCache, j: int, **step):
        """The GDN step kernel of GDN layer j over proj's rows (nextn.ops.triton_gdn.gdn_step; step:
        its store_all, live and preconv)."""
        t = cache.tensors
        return self.gdn.gdn_step(
            proj,
            w.conv,
            t["window"][:, j],
            w.A_log,
            w.dt_bias,
            t["states"][:, j],
            t["gates"][:, j],
            w.out_norm,
            self.cfg.linear_num_key_heads,
            self.eps,
            slots=cache.ctl[:, STATE_AT:],
            pending_col=PENDING - STATE_AT,
            **step,
        )

    def _gdn_launches(self, batch: StepBatch, split: int, store_all: bool, live: torch.Tensor | None) -> list[dict]:
        """The GDN step kernel's launches of a trunk step: its sequences before split (a verify's,
        store_all, or a prefill step's) and after it (a mixed step's prompt pieces: not store_all),
        each with its seqs (a device copy of the batch's columns: a graph's replay copies them again).
        A bf16 prefill launch of more than a row a sequence computes the GDN conv of its rows in a
        pre-pass (bf16's products are rounded by integer ops there, which no compiler contracts:
        triton_gdn._rounded; fp16 / fp32 keep the loop's conv, as one-row steps do: tests/test_prefill.py
        sets them side by side). With StepBatch.chunked the pieces' launch is `_gdn_chunked`'s (its
        pre-pass in any dtype: no loop's bits to give)."""
        B, launches = len(batch.rows), []
        for lo, hi, keep in ((0, split, store_all), (split, B, False)):
            if lo == hi:
                continue
            if not keep and batch.chunked:  # prompt pieces by the chunked rule (`_gdn_chunked`): their
                # slots' halves, read once a step (no pending rows: the caller folds them first)
                slots = batch.slot_index[lo:hi]
                ctl = batch.cache.ctl.index_select(0, slots).long()
                torch._assert_async((ctl[:, PENDING] == 0).all(), "chunked pieces need their pending GDN rows folded")
                seqs = batch.seqs[:, lo:hi].contiguous()
                states = batch.cache.tensors["states"]  # [S, GDN layers, 2, HV, K, V]: a layer's at the same offsets
                read, write = (
                    slots * states.stride(0) + ctl[:, half] * states.stride(2) for half in (STATE_AT, STATE_WRITE)
                )
                launches.append(dict(chunked=(lo, hi), seqs=seqs, read=read, write=write))
                continue
            rows = max(batch.rows[lo:hi])
            preconv = rows if not keep and rows > 1 and self.embed.dtype == torch.bfloat16 else None
            seqs = batch.seqs if hi - lo == B else batch.seqs[:, lo:hi].contiguous()
            launches.append(dict(seqs=seqs, store_all=keep, live=live if lo == 0 else None, preconv=preconv))
        return launches

    def fold(self, caches: list[SlotCache]) -> None:
        """Each slot's pending GDN rows into its base state: a step of no rows (the kernel folds, then
        stores the state and carried columns in the write halves); the caller commits 0 tokens."""
        cache = caches[0].cache
        B = len(caches)
        seqs = to_device([[c.slot for c in caches], [0] * B, [0] * B], cache.ctl.device, torch.int32)
        for layer, w in zip(self.model.model.layers, self.layers, strict=True):
            if layer.kind != FULL:
                width = sum(p.shape[0] for p in w.in_proj)
                # one row that no sequence reads (a zero-size tensor has no address to mask loads from)
                proj = torch.zeros(1, width, device=seqs.device, dtype=cache.tensors["window"].dtype)
                self._gdn_mix(proj, w, cache, cache.gdn_index[layer.layer_idx], seqs=seqs, store_all=False)

    def trunk(
        self,
        batch: StepBatch,
        ids: torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        store_all: bool = True,
        live: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> None:
        """ids [M]: each sequence's rows at its positions SEQ_LEN..: logits [M, V] float32 (or [n, V]
        of the rows logit_rows [n] long: a prefill step's last rows) and head-input hiddens [M, H]
        into the given buffers; K/V and the GDN step buffers written, nothing committed.
        store_all=False: a prefill step of any number of rows per sequence, which keeps them all.
        live (int32 [B] device, default all): the rows of each sequence that
        count (a verify whose gate cut drafts): the GDN recurrences stop there (their serial
        per-row work is what rows cost a small model), and rows past them are garbage.
        A mixed step (batch.pieces_from, with store_all): the sequences from that index on prompt
        pieces, each kept whole as a prefill step keeps it (their GDN rows in a launch of their own),
        the ones before verify rows (live, when given, is theirs); every other kernel runs all rows at
        once, each row's arithmetic its own, so the step gives each sequence what the two steps
        would, bit for bit."""
        norm = self.norm.rms_norm
        keeps = batch.keeps(store_all)
        if any(keep and rows > batch.caches[0].rows for keep, rows in zip(keeps, batch.rows, strict=True)):
            raise ValueError(f"a step keeping every state takes at most {batch.caches[0].rows} rows per sequence")
        split = len(batch.rows) if batch.pieces_from is None else batch.pieces_from
        pos = batch.row_positions(batch.field(SEQ_LEN))
        x = embed(ids, self.embed, self.cfg)
        steps = self._gdn_launches(batch, split, store_all, live)
        ni = None  # the next layer's input norm's NormInput, where the layer before wrote it
        for layer, w in zip(self.model.model.layers, self.layers, strict=True):
            i = layer.layer_idx
            if ni is None:
                ni = self._norm_input(x, w.norm)
            if layer.kind == FULL:
                x, ni = self._attn(x, ni, w, batch.cache.kv(i), batch, pos, 0)
            else:
                x, ni = self._gdn(x, ni, w, batch, batch.cache.gdn_index[i], steps)
        normed = norm(x, self.final_norm, self.eps, out=hidden if self.after_norm else None)
        self._logits(normed if logit_rows is None else normed.index_select(0, logit_rows), None, logits)
        if not self.after_norm:
            hidden.copy_(x)

    def head(
        self,
        batch: StepBatch,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        first: torch.Tensor,
        rows: torch.Tensor | None,
        out: tuple[torch.Tensor, torch.Tensor],
        lm_head: torch.Tensor | None = None,
    ) -> None:
        """MTP rows of a batch: ids [M] paired with hidden [M, H]; sequence b's first row in draft
        K/V slot first[b] (int32 [B]; rope position first[b] + 1). rows [B] (packed row indices, a
        device tensor; None: every row) give the logits [B or M, V] and the hiddens to chain
        [B or M, H], written into out = (logits, chained).
        lm_head [Vd, H] contiguous: score these rows only (a draft vocabulary's copy of the selected
        rows, made at load by nextn.spec.draft_vocab.DraftHead; logits [B or M, Vd]); default all."""
        norm_embed, norm_hidden, fc, layer, final = self.head_weights
        logits, chained = out
        H, M = self.cfg.hidden_size, ids.shape[0]
        cat = torch.empty(M, 2 * H, device=ids.device, dtype=self.embed.dtype)
        norm = functools.partial(self.norm.rms_norm, eps=self.eps, run_if=self.run_if)
        norm(embed(ids, self.embed, self.cfg), norm_embed, out=cat[:, :H])
        norm(hidden, norm_hidden, out=cat[:, H:])
        pos = batch.row_positions(first)
        x = self._lin(cat, fc)
        ni, kv = self._norm_input(x, layer.norm), batch.cache.draft_kv()
        x, _ = self._attn(x, ni, layer, kv, batch, pos, 1)
        h = x if rows is None else x.index_select(0, rows)
        normed = norm(h, final, out=chained if self.after_norm else None)
        self._logits(normed, lm_head, logits)
        if not self.after_norm:
            chained.copy_(h)
