"""Teacher-forced replay acceptance: how well the MTP head drafts on a fixed text, with nothing
generated (so self-generated loops cannot inflate it).

Per evaluated position p (context = the text's tokens 0..p, predecessor pairing as in decoding):
  draft_j  = the head's chain from (token p, trunk hidden p-1), then its own drafts, exactly the
             spec-decode chain (same rows, positions and persistent draft K/V);
  target_j = the trunk's greedy pick for position p+1+j under the forced context.
Draft j counts as accepted when drafts 0..j all equal their targets (what a greedy verify would
accept). Also reports the trunk's NLL / perplexity of the text and can dump the head-input hiddens
(head distillation data).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nextn.cache import LayerKV
from nextn.config import SpecConfig
from nextn.engine.runner import PREFILL_CHUNK, ModelRunner
from nextn.models.loader import load_model
from nextn.spec.proposer import MTPProposer
from nextn.tokenizer import Tokenizer


@dataclass
class ReplayResult:
    k: int
    num_tokens: int
    num_positions: int
    acceptance_per_position: list[float]  # P(drafts 0..j all match), j = 0..K-1
    mean_acceptance_length: float  # 1 + expected accepted drafts per round
    nll: float  # mean trunk NLL (nats/token) of the text
    ppl: float
    hidden_after_norm: bool
    seconds: float


def trunk_pass(runner: ModelRunner, ids: list[int]):
    """Forced trunk pass: (head-input hiddens [N, H], greedy picks [N] (pick t predicts t+1), NLL sum)."""
    state = runner.new_state(len(ids) + 1)
    hiddens, picks, nll = [], [], 0.0
    with torch.inference_mode():
        for s in range(0, len(ids), PREFILL_CHUNK):
            chunk = torch.tensor([ids[s : s + PREFILL_CHUNK]], device=runner.device)
            h = runner.model(chunk, state.cache)[0]
            normed = runner.model.final_norm(h)
            logits = runner.model.logits(normed)  # [c, V]
            picks.append(logits.argmax(-1))
            gold = torch.tensor(ids[s + 1 : s + 1 + chunk.shape[1]], device=runner.device)
            logp = torch.log_softmax(logits[: gold.numel()], -1)
            nll -= logp.gather(-1, gold[:, None]).sum().item()
            hiddens.append(runner.head_input(h, normed))
    return torch.cat(hiddens), torch.cat(picks), nll


def replay_rounds(runner: ModelRunner, proposer: MTPProposer, ids: list[int], hidden: torch.Tensor,
                  picks: torch.Tensor, k: int, positions: range):
    """Yields (p, drafts [k], targets [k]) per evaluated position p, in order."""
    cfg = runner.cfg
    kv = LayerKV(1, len(ids) + k + 1, cfg.num_key_value_heads, cfg.head_dim, runner.device, runner.dtype)
    tok = torch.tensor(ids, device=runner.device)
    draft0, chained0 = [], []
    # every row p >= 1, in chunks: the persistent draft K/V and draft 0 of each position
    for s in range(1, len(ids), PREFILL_CHUNK):
        e = min(s + PREFILL_CHUNK, len(ids))
        logits, chained = proposer.run_rows(kv, tok[s:e], hidden[s - 1 : e - 1], s, last_only=False)
        draft0.append(logits.argmax(-1))
        chained0.append(chained)
    draft0, chained0 = torch.cat(draft0), torch.cat(chained0)  # row p at index p-1
    for p in positions:
        drafts = [draft0[p - 1]]
        chained = chained0[p - 1 : p]
        saved = (kv.key[:, p : p + k].clone(), kv.value[:, p : p + k].clone())
        for j in range(1, k):
            logits, chained = proposer.run_rows(kv, drafts[-1].reshape(1), chained, p + j)
            drafts.append(logits[0].argmax())
        kv.key[:, p : p + k], kv.value[:, p : p + k] = saved  # chain rows -> true rows again
        yield p, torch.stack(drafts), picks[p : p + k]


def replay(runner: ModelRunner, proposer: MTPProposer, ids: list[int], k: int, stride: int = 1,
           progress: bool = True, dump_hidden: str | None = None) -> ReplayResult:
    if len(ids) < k + 3:
        raise ValueError(f"the text has {len(ids)} tokens; replay needs at least {k + 3}")
    t0 = time.perf_counter()
    hidden, picks, nll = trunk_pass(runner, ids)
    if dump_hidden:
        from safetensors.torch import save_file

        save_file({"hidden": hidden.float().cpu().contiguous(), "input_ids": torch.tensor(ids)}, dump_hidden)
    accepted = torch.zeros(k, dtype=torch.long)
    positions = range(1, len(ids) - k, stride)
    with torch.inference_mode():
        for n_done, (p, drafts, targets) in enumerate(replay_rounds(runner, proposer, ids, hidden, picks, k, positions)):
            accepted += (drafts == targets).long().cumprod(0).cpu()
            if progress and (n_done % 64 == 0 or n_done == len(positions) - 1):
                print(f"\rreplay: {n_done + 1}/{len(positions)} positions", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    rates = (accepted.float() / max(1, len(positions))).tolist()
    mean_nll = nll / (len(ids) - 1)
    return ReplayResult(k, len(ids), len(positions), rates, 1.0 + sum(rates), mean_nll, math.exp(mean_nll),
                        proposer.spec.hidden_after_norm, time.perf_counter() - t0)


def replay_from_args(args) -> int:
    if args.k < 1 or args.stride < 1:
        raise ValueError("--k and --stride must be >= 1")
    spec = SpecConfig(num_speculative_tokens=args.k, hidden_after_norm=not args.hidden_before_norm)
    model_dir = args.model
    from nextn.config import DEFAULT_MODEL_DIR

    model_dir = Path(model_dir) if model_dir else DEFAULT_MODEL_DIR
    model = load_model(model_dir, device=args.device, dtype=args.dtype)
    runner = ModelRunner(model, spec)
    proposer = MTPProposer(model, spec)
    ids = Tokenizer(model_dir).encode(Path(args.file).read_text(errors="replace"))
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    result = replay(runner, proposer, ids, args.k, args.stride, dump_hidden=args.dump_hidden)
    print(
        f"replay: {result.num_positions} positions over {result.num_tokens} tokens, K={result.k}: "
        f"acceptance per position {[round(r, 3) for r in result.acceptance_per_position]}, "
        f"mean acceptance length {result.mean_acceptance_length:.3f}, nll {result.nll:.3f}, ppl {result.ppl:.2f}",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps({"model": str(model_dir), "file": str(args.file), **asdict(result)}))
    return 0
