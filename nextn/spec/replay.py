"""Teacher-forced replay acceptance: how well the MTP head drafts on a fixed text, with nothing
generated (so self-generated loops cannot inflate it).

Per evaluated position p (context = the text's tokens 0..p, predecessor pairing as in decoding):
  draft_j  = the head's chain from (token p, trunk hidden p-1), then its own drafts, exactly the
             spec-decode chain (same rows, positions and persistent draft K/V);
  target_j = the trunk's greedy pick for position p+1+j under the forced context.
Draft j counts as accepted when drafts 0..j all equal their targets (what a greedy verify would
accept). With a draft vocabulary the head scores its rows only and each draft maps through d2t,
as the live proposer drafts (nextn.spec.draft_vocab). Also reports the trunk's NLL / perplexity
of the text and can dump the head-input hiddens (head distillation data).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from nextn.cache import KV, CacheLayout, HybridCache
from nextn.models.loader import load_model
from nextn.models.qwen3_5 import CausalLM
from nextn.spec.draft_vocab import DraftHead, DraftVocab, load_draft_vocab
from nextn.tokenizer import load_tokenizer

CHUNK = 2048  # tokens per forward: bounds attention score memory


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
    draft_vocab_size: int | None = None  # the draft vocabulary's rows (None: the full vocabulary)


@dataclass(frozen=True)
class ReplaySettings:
    """What one replay measures: K drafts at every `stride`-th position, the head reading the
    trunk's hiddens after its final norm (after_norm) or before, over the draft vocabulary when
    given; dump_hidden: a safetensors file for the head-input hiddens."""

    k: int
    stride: int = 1
    after_norm: bool = True
    draft_vocab: DraftVocab | None = None
    dump_hidden: str | None = None


class TrunkPass(NamedTuple):
    """A text's forced trunk pass."""

    ids: list[int]  # the text
    hidden: torch.Tensor  # [N, H] head-input hiddens (row t: the head input of token t)
    picks: torch.Tensor  # [N] greedy picks (pick t predicts token t + 1)
    nll: float  # the NLL sum over the text
    after_norm: bool  # hidden is after the trunk's final norm


def trunk_pass(model: CausalLM, ids: list[int], after_norm: bool = True) -> TrunkPass:
    """Forced trunk pass: head-input hiddens, greedy picks and the NLL sum of the text."""
    param = next(model.parameters())
    cache = HybridCache(model.cfg, CacheLayout(1, len(ids) + 1, 1, draft=False), param.device, param.dtype).slot(0)
    hiddens, picks, nll = [], [], 0.0
    with torch.inference_mode():
        for s in range(0, len(ids), CHUNK):
            chunk = torch.tensor([ids[s : s + CHUNK]], device=param.device)
            h = model(chunk, cache)[0]
            cache.commit_chunk(chunk.shape[1])
            normed = model.final_norm(h)
            logits = model.logits(normed)  # [c, V]
            picks.append(logits.argmax(-1))
            gold = torch.tensor(ids[s + 1 : s + 1 + chunk.shape[1]], device=param.device)
            logp = torch.log_softmax(logits[: gold.numel()], -1)
            nll -= logp.gather(-1, gold[:, None]).sum().item()
            hiddens.append(normed if after_norm else h)
    return TrunkPass(ids, torch.cat(hiddens), torch.cat(picks), nll, after_norm)


def replay_rounds(model: CausalLM, trunk: TrunkPass, k: int, positions: range, draft: DraftHead | None = None):
    """Yields (p, drafts [k], targets [k]) per evaluated position p of the trunk pass's text, in
    order (drafts over the draft vocabulary `draft` when given)."""
    ids, hidden, picks, _, after_norm = trunk
    cfg, param = model.cfg, next(model.parameters())
    shape = (len(ids) + k + 1, cfg.num_key_value_heads, cfg.head_dim)
    kv = KV(*torch.zeros(2, *shape, device=param.device, dtype=param.dtype).unbind(0))  # the head's K/V
    tok = torch.tensor(ids, device=param.device)
    lm_head = None if draft is None else draft.lm_head

    def pick(logits):  # [n, V or Vd] -> target ids [n]
        best = logits.argmax(-1)
        return best if draft is None else draft.to_target(best)

    draft0, chained0 = [], []
    # every row p >= 1, in chunks: the persistent draft K/V and draft 0 of each position
    for s in range(1, len(ids), CHUNK):
        e = min(s + CHUNK, len(ids))
        out = model.head_rows(kv, tok[s:e], hidden[s - 1 : e - 1], s, last_only=False, lm_head=lm_head)
        draft0.append(pick(out.logits))
        chained0.append(out.chained(after_norm))
    draft0, chained0 = torch.cat(draft0), torch.cat(chained0)  # row p at index p-1
    for p in positions:
        drafts = [draft0[p - 1]]
        chained = chained0[p - 1 : p]
        saved = (kv[0][p : p + k].clone(), kv[1][p : p + k].clone())
        for j in range(1, k):
            out = model.head_rows(kv, drafts[-1].reshape(1), chained, p + j, lm_head=lm_head)
            chained = out.chained(after_norm)
            drafts.append(pick(out.logits)[0])
        kv[0][p : p + k], kv[1][p : p + k] = saved  # chain rows -> true rows again
        yield p, torch.stack(drafts), picks[p : p + k]


def replay(model: CausalLM, ids: list[int], settings: ReplaySettings, progress: bool = True) -> ReplayResult:
    """Replay the text `ids` as `settings` say (progress: a count of positions on stderr)."""
    k, draft_vocab, dump_hidden = settings.k, settings.draft_vocab, settings.dump_hidden
    if len(ids) < k + 3:
        raise ValueError(f"the text has {len(ids)} tokens; replay needs at least {k + 3}")
    if model.mtp is None:
        raise ValueError("the checkpoint has no MTP head (mtp.* tensors): nothing to replay")
    t0 = time.perf_counter()
    draft = None if draft_vocab is None else DraftHead(draft_vocab, model.lm_head_weight)
    trunk = trunk_pass(model, ids, settings.after_norm)
    if dump_hidden:
        from safetensors.torch import save_file

        # bf16, the released heads' training dtype: hidden [N, H] (row t: the head input of token t)
        hidden = trunk.hidden.to(torch.bfloat16).cpu().contiguous()
        save_file({"hidden": hidden, "input_ids": torch.tensor(ids)}, dump_hidden)
    accepted = torch.zeros(k, dtype=torch.long)
    positions = range(1, len(ids) - k, settings.stride)
    with torch.inference_mode():
        rounds = replay_rounds(model, trunk, k, positions, draft)
        for n_done, (_, drafts, targets) in enumerate(rounds):
            accepted += (drafts == targets).long().cumprod(0).cpu()
            if progress and (n_done % 64 == 0 or n_done == len(positions) - 1):
                print(f"\rreplay: {n_done + 1}/{len(positions)} positions", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    rates = (accepted.float() / max(1, len(positions))).tolist()
    mean_nll = trunk.nll / (len(ids) - 1)
    return ReplayResult(
        k,
        len(ids),
        len(positions),
        rates,
        1.0 + sum(rates),
        mean_nll,
        math.exp(mean_nll),
        settings.after_norm,
        time.perf_counter() - t0,
        None if draft is None else draft.size,
    )


def check_args(args) -> None:
    """replay's own flags, checked before the model is resolved (a hub download) or loaded."""
    if args.k < 1 or args.stride < 1:
        raise ValueError("--k and --stride must be >= 1")
    # a negative N would slice tokens off the end of the text: refused, as a file that is not one
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not Path(args.file).is_file():
        raise ValueError(f"--file {args.file}: not a file")


def replay_from_args(args) -> int:
    check_args(args)  # again for callers that come here without nextn.commands._replay
    from nextn.config import DEFAULT_MODEL_DIR

    model_dir = Path(args.model) if args.model else DEFAULT_MODEL_DIR
    model = load_model(model_dir, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(model_dir)
    vocab = None
    if args.draft_vocab is not None:
        vocab = load_draft_vocab(args.draft_vocab, model.cfg.vocab_size, tokenizer)
    ids = tokenizer.encode(Path(args.file).read_text(errors="replace"))
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    settings = ReplaySettings(args.k, args.stride, not args.hidden_before_norm, vocab, args.dump_hidden)
    result = replay(model, ids, settings)
    heads = "" if vocab is None else f" (draft vocabulary of {vocab.size})"
    print(
        f"replay: {result.num_positions} positions over {result.num_tokens} tokens, K={result.k}{heads}: "
        f"acceptance per position {[round(r, 3) for r in result.acceptance_per_position]}, "
        f"mean acceptance length {result.mean_acceptance_length:.3f}, nll {result.nll:.3f}, ppl {result.ppl:.2f}",
        file=sys.stderr,
    )
    if args.json:
        print(
            json.dumps(
                {"model": str(model_dir), "file": str(args.file), "draft_vocab": args.draft_vocab, **asdict(result)}
            )
        )
    return 0
