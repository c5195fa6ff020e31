"""Fast paths for a loaded model, chosen by name, never by fallback: `kernels="torch"` runs the
reference modules (every device); `kernels="triton"` runs the decode / verify step and the MTP
head's draft step with batch-invariant Triton kernels, replayed as CUDA graphs on a GPU. If the
fast path is asked for and cannot run (no triton, an unsupported model), building it raises.

What the Triton step does per decoder layer (T <= 16 rows, weights fused at load time):
- Gated DeltaNet: [RMSNorm -> in_proj_{qkv,z,b,a} fused] -> [causal conv -> recurrent delta rule
  (writes the state after every token) -> gated RMSNorm] -> [out_proj -> + residual];
- attention: [RMSNorm -> q/k/v fused] -> q/k norm + RoPE + K/V write -> chunked attention * gate
  -> [o_proj + residual];
- MLP: [RMSNorm -> gate/up -> silu * up] -> [down + residual];
- MoE: RMSNorm -> router -> [top-k] -> [experts' silu(gate) * up] -> shared expert (3 launches)
  -> [experts' down, weighted sum, + gated shared expert + residual] (nextn.ops.triton_moe).
Brackets are one kernel each. Every kernel computes a row with arithmetic that does not depend on
the number of rows, so a verify row equals the decode of the same token bitwise, and greedy
speculative output equals plain greedy output in bf16 (tests/test_fast.py).

Prefill (and the MTP head's catch-up over more than 16 rows, e.g. a whole prompt) keeps the
reference modules, with the chunked delta rule and the routed experts as Triton kernels
(`prefill_kernels`): plain and speculative decoding share it, so it does not affect exactness.

Owns: fused weight views, the fast runner and proposer (their cache: nextn.cache.fast). Does not know about
requests or sampling.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nextn.cache import LayerKV
from nextn.cache.fast import FastCache
from nextn.config import FULL, SpecConfig
from nextn.engine.runner import ModelRunner
from nextn.engine.selector import TokenSelector
from nextn.engine.state import SeqState
from nextn.layers.ffn import Experts
from nextn.layers.gdn import GatedDeltaNet
from nextn.layers.linear import STEP_ROWS
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.triton_utils import HAVE_TRITON, interpreting
from nextn.spec.proposer import Draft, MTPProposer

KERNELS = ("torch", "triton")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


# ---------------------------------------------------------------------------------------------
# weights, fused at load time


def _fuse_rows(*linears) -> torch.Tensor:
    """Concatenate nn.Linear weights along their output rows; the modules keep views into it."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused


@dataclass
class MLPWeights:
    norm: torch.Tensor  # [H] post_attention_layernorm (zero-centred)
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class MoEWeights:
    norm: torch.Tensor  # [H] post_attention_layernorm
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    shared_gate: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    shared_expert_gate: torch.Tensor  # [1, H]
    top_k: int
    renorm: bool


@dataclass
class GDNWeights:
    norm: torch.Tensor  # [H] input_layernorm
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2 HV, H]: qkv | z | b | a
    conv: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    out_norm: torch.Tensor  # [V] RMSNormGated weight
    out_proj: torch.Tensor  # [H, value_dim]
    mlp: MLPWeights | MoEWeights


@dataclass
class AttnWeights:
    norm: torch.Tensor  # [H] input_layernorm
    qkv: torch.Tensor  # [Hq*2*D + 2*Hkv*D, H]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    mlp: MLPWeights | MoEWeights


def _mlp_weights(layer) -> MLPWeights | MoEWeights:
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        se = mlp.shared_expert
        return MoEWeights(layer.post_attention_layernorm.weight, mlp.gate.weight, mlp.experts.gate_up_proj,
                          mlp.experts.down_proj, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                          mlp.shared_expert_gate.weight, mlp.gate.top_k, mlp.gate.norm_topk_prob)
    return MLPWeights(layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                      mlp.down_proj.weight)


def _attn_weights(layer) -> AttnWeights:
    a = layer.self_attn
    if a.q_proj.bias is not None:
        raise NotImplementedError("kernels='triton': attention biases are not supported")
    return AttnWeights(layer.input_layernorm.weight, _fuse_rows(a.q_proj, a.k_proj, a.v_proj),
                       a.q_norm.weight, a.k_norm.weight, a.o_proj.weight, _mlp_weights(layer))


def _gdn_weights(layer) -> GDNWeights:
    g = layer.linear_attn
    if not hasattr(g, "in_proj_qkv"):
        raise NotImplementedError("kernels='triton': Qwen3-Next's fused GDN projections are not supported yet")
    fused = _fuse_rows(g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a)
    return GDNWeights(layer.input_layernorm.weight, fused, g.conv1d.weight.detach().squeeze(1), g.A_log, g.dt_bias,
                      g.norm.weight, g.out_proj.weight, _mlp_weights(layer))


# ---------------------------------------------------------------------------------------------
# the Triton step


@dataclass
class StepOut:
    hidden: torch.Tensor  # [T, H] last layer output before the final norm
    normed: torch.Tensor  # [T, H] after it
    logits: torch.Tensor  # [T, V] float32


@dataclass
class HeadOut:
    out: torch.Tensor  # [1, H] the head layer's last row before mtp.norm
    normed: torch.Tensor  # [1, H] after it
    logits: torch.Tensor  # [1, V] float32

    def chained(self, after_norm: bool) -> torch.Tensor:
        """The hidden the next draft step consumes (SpecConfig.hidden_after_norm)."""
        return self.normed if after_norm else self.out


class TritonStep:
    """The trunk's multi-token step and the MTP head's step with Triton kernels. Positions come
    from a device scalar `pos` (cache slot of row 0), so one CUDA graph per row count serves every
    position."""

    def __init__(self, model: CausalLM):
        from nextn.ops import triton_attention, triton_gdn, triton_linear, triton_norm

        self.ops = (triton_attention, triton_gdn, triton_linear, triton_norm)
        cfg = model.cfg
        if cfg.family not in ("qwen3_5", "qwen3_5_moe"):
            raise NotImplementedError(f"kernels='triton' does not support the {cfg.family} family yet")
        self.model, self.cfg = model, cfg
        self.eps = cfg.rms_norm_eps
        self.layers = [
            _attn_weights(layer) if layer.kind == FULL else _gdn_weights(layer) for layer in model.model.layers
        ]
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.lm_head = model.lm_head_weight
        self.head = None
        if model.mtp is not None:
            h = model.mtp
            self.head = (h.pre_fc_norm_embedding.weight, h.pre_fc_norm_hidden.weight, h.fc.weight,
                         _attn_weights(h.layers[0]), h.norm.weight)
        self._rope: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def rope_tables(self, max_pos: int):
        """cos, sin [>= max_pos, rotary_dim] as the reference computes them (model dtype).

        Tables only grow, and old ones stay alive: captured CUDA graphs hold their addresses.
        """
        if not self._rope or self._rope[-1][0] < max_pos:
            n = max(max_pos, self.cfg.max_position_embeddings + 1)
            positions = torch.arange(n, device=self.embed.device)
            self._rope.append((n, *self.model.rotary.cos_sin(positions, self.embed.dtype)))
        return self._rope[-1][1], self._rope[-1][2]

    def linear_uses(self, head: bool = True) -> list[tuple[int, int, bool, bool]]:
        """(N, K, full-row norm prologue, second weight) of each skinny_linear one trunk step runs
        (and the MTP head's step, with head=True), repeats included."""
        uses = []

        def mlp(w):
            if isinstance(w, MoEWeights):
                uses.extend([(*w.router.shape, False, False), (*w.shared_gate.shape, False, True),
                             (*w.shared_down.shape, False, False), (*w.shared_expert_gate.shape, False, False)])
            else:
                uses.extend([(*w.gate.shape, True, True), (*w.down.shape, False, False)])

        def layer(w):
            if isinstance(w, AttnWeights):
                uses.extend([(*w.qkv.shape, True, False), (*w.o_proj.shape, False, False)])
            else:
                uses.extend([(*w.in_proj.shape, True, False), (*w.out_proj.shape, False, False)])
            mlp(w.mlp)

        for w in self.layers:
            layer(w)
        uses.append((*self.lm_head.shape, False, False))
        if head and self.head is not None:
            uses.append((*self.head[2].shape, False, False))
            layer(self.head[3])
        return uses

    def tune(self, log=None) -> dict:
        """Measure the skinny GEMM's block configs for this model's weight shapes (before capture)."""
        return self.ops[2].tune(sorted(set(self.linear_uses())), self.embed.device, log=log)

    def _mlp(self, x, w: MLPWeights | MoEWeights):
        if isinstance(w, MoEWeights):
            from nextn.ops.triton_moe import moe_step

            h = self.ops[3].rms_norm(x, w.norm, self.eps)
            return moe_step(x, h, w.router, w.gate_up, w.down, w.shared_gate, w.shared_up, w.shared_down,
                            w.shared_expert_gate, w.top_k, w.renorm)
        lin = self.ops[2].skinny_linear
        act = lin(x, w.gate, norm_weight=w.norm, up_weight=w.up, eps=self.eps)
        return lin(act, w.down, residual=x)

    def _attn(self, x, w: AttnWeights, kv: LayerKV, pos, rope_offset: int, max_pos: int):
        attn_ops, lin = self.ops[0], self.ops[2].skinny_linear
        qkv = lin(x, w.qkv, norm_weight=w.norm, eps=self.eps)
        cos, sin = self.rope_tables(max_pos)
        key, value = kv.key[0], kv.value[0]
        q = attn_ops.qk_norm_rope(qkv, w.q_norm, w.k_norm, cos, sin, pos, key, value,
                                  self.cfg.num_attention_heads, self.eps, rope_offset)
        o = attn_ops.attend_step(q, qkv, key, value, pos)
        return self._mlp(lin(o, w.o_proj, residual=x), w.mlp)

    def _gdn(self, x, w: GDNWeights, cache: FastCache, j: int):
        cfg, lin = self.cfg, self.ops[2].skinny_linear
        proj = lin(x, w.in_proj, norm_weight=w.norm, eps=self.eps)  # [T, conv | z | b | a]
        o = self.ops[1].gdn_step(proj, w.conv, cache.conv_all[j], cache.window_all[j], w.A_log, w.dt_bias,
                                 cache.recurrent_all[j], cache.states_all[j], w.out_norm,
                                 cfg.linear_num_key_heads, self.eps, slots=cache.slots)
        return self._mlp(lin(o, w.out_proj, residual=x), w.mlp)

    def trunk(self, ids: torch.Tensor, pos: torch.Tensor, cache: FastCache) -> StepOut:
        """ids [T] at cache slots pos + [0, T); writes K/V and the GDN step buffers of `cache`."""
        lin, norm = self.ops[2].skinny_linear, self.ops[3].rms_norm
        x = F.embedding(ids, self.embed)
        j = 0
        for layer, w in zip(self.model.model.layers, self.layers):
            if layer.kind == FULL:
                x = self._attn(x, w, cache.kv[layer.layer_idx], pos, 0, cache.max_len + 1)
            else:
                x = self._gdn(x, w, cache, j)
                j += 1
        normed = norm(x, self.final_norm, self.eps)
        return StepOut(x, normed, lin(normed, self.lm_head, out_dtype=torch.float32))

    def head_step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, kv: LayerKV) -> HeadOut:
        """MTP rows: ids [T] paired with hidden [T, H]; row 0 sits in draft K/V slot pos (rope pos + 1)."""
        lin, norm = self.ops[2].skinny_linear, self.ops[3].rms_norm
        norm_embed, norm_hidden, fc, layer, final = self.head
        H = self.cfg.hidden_size
        T = ids.shape[0]
        cat = torch.empty(T, 2 * H, device=ids.device, dtype=self.embed.dtype)
        norm(F.embedding(ids, self.embed), norm_embed, self.eps, out=cat[:, :H])
        norm(hidden, norm_hidden, self.eps, out=cat[:, H:])
        x = self._attn(lin(cat, fc), layer, kv, pos, 1, kv.max_len + 1)
        out = x[T - 1 :]
        normed = norm(out, final, self.eps)
        return HeadOut(out, normed, lin(normed, self.lm_head, out_dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# runner and proposer


@contextmanager
def prefill_kernels(model: CausalLM):
    """Within the block the reference modules run their two prefill hot spots as Triton kernels:
    the chunked delta rule (`triton_gdn_chunk`) and the routed experts (`triton_moe_grouped`).
    The modules' own rules are put back after."""
    from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule  # these import triton: when used
    from nextn.ops.triton_moe_grouped import grouped_experts

    swaps = [(m, "chunk_rule", chunk_gated_delta_rule) for m in model.modules() if isinstance(m, GatedDeltaNet)]
    swaps += [(m, "routed_rule", grouped_experts) for m in model.modules() if isinstance(m, Experts)]
    before = [getattr(m, attr) for m, attr, _ in swaps]
    for m, attr, rule in swaps:
        setattr(m, attr, rule)
    try:
        yield
    finally:
        for (m, attr, _), rule in zip(swaps, before):
            setattr(m, attr, rule)


class FastModelRunner(ModelRunner):
    """ModelRunner whose keep-states step runs TritonStep (as CUDA graphs where CUDA is there)."""

    cache_cls = FastCache

    def __init__(self, model: CausalLM, spec: SpecConfig, step: TritonStep, use_graphs: bool,
                 prefill: str = "chunked"):
        super().__init__(model, spec, prefill)
        self.fast = step
        self.use_graphs = use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    @torch.inference_mode()
    def extend(self, state: SeqState, token_ids: list[int], on_logits=None) -> None:
        if self.prefill == "steps":
            return super().extend(state, token_ids, on_logits)
        state.cache.materialize()  # the reference modules read the recurrent states in place
        with prefill_kernels(self.model):
            super().extend(state, token_ids, on_logits)

    def graphs(self, state: SeqState):
        from nextn.engine.cuda_graphs import StepGraphs

        if state.cache.graphs is None:
            state.cache.graphs = StepGraphs(self.fast, self.pool)
        return state.cache.graphs

    @torch.inference_mode()
    def step(self, state: SeqState, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = state.cache
        if not isinstance(cache, FastCache):
            raise TypeError("the Triton step needs a state made by FastModelRunner.new_state")
        T, start = token_ids.numel(), cache.seq_len
        if not 1 <= T <= STEP_ROWS:
            raise ValueError(f"a Triton step takes 1..{STEP_ROWS} tokens, got {T}")
        if start + T > cache.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache capacity {cache.max_len}")
        if self.use_graphs:
            out = self.graphs(state).trunk(T, cache).run(start, token_ids)
        else:
            pos = torch.tensor([start], device=self.device, dtype=torch.int32)
            out = self.fast.trunk(token_ids, pos, cache)
        cache.step_tokens, cache.fast_step = T, True
        hidden = out.normed if self.spec.hidden_after_norm else out.hidden
        # graph outputs are overwritten by the next replay: the caller keeps these
        return out.logits.clone(), hidden.clone()


class FastMTPProposer(MTPProposer):
    """MTPProposer whose head steps of <= 16 rows run TritonStep.head_step (as CUDA graphs).

    More rows (the head catching up over a whole prompt) take the reference modules, like prefill.
    """

    def __init__(self, model: CausalLM, spec: SpecConfig, runner: FastModelRunner):
        super().__init__(model, spec)
        self.runner = runner

    @torch.inference_mode()
    def propose(self, state: SeqState, bonus: int, k: int, selector: TokenSelector) -> Draft:
        """With CUDA graphs, greedy drafting without penalties or a confidence gate replays the
        whole chain after the first pass as one graph (`ChainGraph`); otherwise the base chain."""
        greedy_chain = selector.params.greedy and selector.history is None and self.spec.p_min <= 0.0
        if not (self.runner.use_graphs and greedy_chain and k > 1):
            return super().propose(state, bonus, k, selector)
        logits, chained, n = self._first_pass(state, bonus)
        if n + k - 1 > state.draft_kv.max_len:  # the chain's steps write slots n .. n+k-2
            raise ValueError("draft K/V overflow")
        graph = self.runner.graphs(state).chain(k, n, state.draft_kv, self.spec.hidden_after_norm)
        return Draft(graph.run(n, logits, chained).clone(), None)

    def _head(self, state: SeqState, ids: torch.Tensor, hidden: torch.Tensor, first_pos: int):
        T = ids.numel()
        if T > STEP_ROWS:
            return super()._head(state, ids, hidden, first_pos)
        if first_pos - 1 + T > state.draft_kv.max_len:
            raise ValueError("draft K/V overflow")
        if self.runner.use_graphs:
            graph = self.runner.graphs(state).head(T, first_pos - 1, state.draft_kv)
            out = graph.run(first_pos - 1, ids, hidden)
        else:
            pos = torch.tensor([first_pos - 1], device=ids.device, dtype=torch.int32)
            out = self.runner.fast.head_step(ids, hidden, pos, state.draft_kv)
        return out.logits, out.chained(self.spec.hidden_after_norm)


def build_engine(model: CausalLM, spec: SpecConfig, kernels: str,
                 step: TritonStep | None = None, prefill: str = "chunked") -> tuple[ModelRunner, MTPProposer | None]:
    """The runner and proposer for `kernels`; raises if the fast path cannot run here.

    `step`: a TritonStep already built for `model` (building one fuses weights; reuse it when
    making engines for several SpecConfigs).
    """
    check_kernels(kernels)
    want_proposer = spec.num_speculative_tokens > 0
    if kernels == "torch":
        return ModelRunner(model, spec, prefill), MTPProposer(model, spec) if want_proposer else None
    if not HAVE_TRITON:
        raise RuntimeError("kernels='triton' needs the triton package")
    device = next(model.parameters()).device
    if device.type != "cuda" and not interpreting():
        raise RuntimeError("kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    runner = FastModelRunner(model, spec, step or TritonStep(model), use_graphs=device.type == "cuda", prefill=prefill)
    return runner, FastMTPProposer(model, spec, runner) if want_proposer else None
