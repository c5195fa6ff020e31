"""How well a checkpoint's MTP head drafts, and what a p_min gate would do with it, on the CPU.

For each prompt file (its first --prompt-len tokens, as `nextn bench --prompt-file` takes them) the
engine decodes --gen-len tokens plainly; the trunk and the head's chain (depths 1..--depth, true
tokens fed as accepted drafts: nextn.train.objective.chain_logits) then run teacher-forced over
prompt + continuation, and greedy rounds are replayed on those logits:
  * per depth: the head's pick agrees with the trunk's, and the head's probability of its pick
    (median, and on the agreeing drafts);
  * rounds at K (no gate) and at K with the gate p_min: tokens per round, head steps, verify rows,
    zero-draft rounds, the acceptance of the drafts the gate kept;
  * an estimate of gated / ungated speed from a per-round cost model (at --p-min, and at each
    threshold of --sweep) (the --cost-* flags; their
    defaults are the bundled model's on the H200, runs 41 and 49 of bench/NOTES.md). An estimate:
    the bar is measured with `nextn bench --p-min` on the H200.
With --temperature T it also decodes a sampled continuation per seed and reports, per depth, the
overlap sum_x min(q_T, p_T) of the head's and the trunk's distributions at T (a draft's chance of
acceptance under rejection sampling) and the mean length a K=3 round would reach with them.

  python bench/head_calibration.py --prompt-file nextn/engine/rounds.py --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nextn.bench.offline import text_prompt
from nextn.engine.llm import LLM
from nextn.hub import resolve_model
from nextn.models.loader import load_model
from nextn.sample.pipeline import SamplingParams
from nextn.train.objective import chain_logits, trunk_hidden


def continuation(llm: LLM, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, ignore_eos=True)
    return list(llm.generate(prompt_token_ids=prompt, params=params).token_ids)


@torch.no_grad()
def teacher_forced(model, ids: list[int], depth: int):
    """The trunk's logits at every position and the head chain's logits at depths 1..depth."""
    x = torch.tensor([ids])
    hidden = trunk_hidden(model, x[:, :-1])
    return model.logits(hidden)[0], [c[0] for c in chain_logits(model, x, hidden, depth)]


def head_picks(chain) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per chain depth: the head's pick at every row and its probability of that pick."""
    return [(c.argmax(-1), torch.softmax(c.float(), -1).amax(-1)) for c in chain]


def greedy_rounds(trunk, heads, start: int, end: int, k: int, p_min: float) -> dict:
    """Replay greedy rounds from the pending token at `start`: draft d (1-based) of a round whose
    pending token sits at p is depth d's pick at row p - 1 (heads: head_picks) and must equal the
    trunk's pick at p + d - 1."""
    pick = trunk.argmax(-1)
    s = dict(
        rounds=0, tokens=0, head_steps=0, verify_rows=0, zero_draft_rounds=0, kept=0, kept_accepted=0, cut_rounds=0
    )
    p = start
    while p + k < end:
        kept, run = 0, 0
        for d in range(k):
            draft, conf = heads[d][0][p - 1], heads[d][1][p - 1]
            s["head_steps"] += 1
            if conf < p_min:
                s["cut_rounds"] += 1
                break
            kept += 1
            if run == d and draft == pick[p + d]:
                run += 1
        # past a rejection the chain still drafts (nothing is read on the host mid-round)
        s["rounds"] += 1
        s["tokens"] += run + 1
        s["verify_rows"] += kept + 1
        s["zero_draft_rounds"] += kept == 0
        s["kept"] += kept
        s["kept_accepted"] += run
        p += run + 1
    return s


def round_ms(s: dict, k: int, cost: dict) -> float:
    """Estimated device time of the replayed rounds (ms): head steps, the gate's masked steps,
    the verify's rows, the rest of a round."""
    masked = s["rounds"] * k - s["head_steps"]
    return (
        s["head_steps"] * cost["head"]
        + masked * cost["masked"]
        + s["rounds"] * (cost["verify"] + cost["round"])
        + s["verify_rows"] * cost["row"]
    )


@torch.no_grad()
def sampled_overlap(trunk, chain, start: int, end: int, temperature: float) -> list[torch.Tensor]:
    """Per depth d, per pending position p in [start, end - depth): sum_x min(q_T, p_T)."""
    out = []
    for d, c in enumerate(chain, start=1):
        rows = torch.arange(start, end - len(chain))
        q = torch.softmax(c[rows - 1].float() / temperature, -1)
        t = torch.softmax(trunk[rows + d - 1].float() / temperature, -1)
        out.append(torch.minimum(q, t).sum(-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--prompt-file", action="append", required=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6, help="K of the gated rounds (the longest chain)")
    ap.add_argument("--p-min", type=float, default=0.5)
    ap.add_argument(
        "--sweep", type=float, nargs="*", default=[], help="also estimate the gate's speed ratio at these p_min"
    )
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cost-head", type=float, default=0.050, help="ms per head step")
    ap.add_argument("--cost-masked", type=float, default=0.024, help="ms per head step the gate masked")
    ap.add_argument("--cost-verify", type=float, default=0.183, help="ms per verify, before its rows")
    ap.add_argument("--cost-row", type=float, default=0.019, help="ms per verify row")
    ap.add_argument("--cost-round", type=float, default=0.150, help="ms per round besides draft and verify")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    model = load_model(model_dir, "cpu", "float32")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_speculative_tokens=0)
    cost = {n: getattr(args, f"cost_{n}") for n in ("head", "masked", "verify", "row", "round")}
    report = {"model": str(args.model or "bundled"), "depth": args.depth, "p_min": args.p_min, "cost_ms": cost}
    reported = [(3, 0.0), (args.depth, 0.0), (args.depth, args.p_min)]
    runs = list(dict.fromkeys(reported + [(args.depth, p) for p in args.sweep]))
    counted = ("rounds", "tokens", "head_steps", "verify_rows", "zero_draft_rounds", "kept", "kept_accepted")
    totals: dict[tuple, dict] = {run: dict.fromkeys(counted, 0) | {"ms": 0.0} for run in runs}  # over all prompts
    for path in args.prompt_file:
        prompt = text_prompt(str(model_dir), args.prompt_len, Path(path).read_text(errors="replace"))
        ids = prompt + continuation(llm, prompt, args.gen_len, 0.0, 0)
        trunk, chain = teacher_forced(model, ids, args.depth)
        heads = head_picks(chain)
        start, end = len(prompt), len(ids) - 1
        pick = trunk.argmax(-1)
        rows = torch.arange(start, end - args.depth)
        per_depth = []
        for d, (picks, confidence) in enumerate(heads, start=1):
            agree = picks[rows - 1] == pick[rows + d - 1]
            pc = confidence[rows - 1]
            below = ((pc < args.p_min) & agree).float().sum().item()
            per_depth.append(
                {
                    "agree": round(agree.float().mean().item(), 4),
                    "median_confidence": round(pc.median().item(), 4),
                    "agreeing_below_p_min": round(below / max(1, agree.sum().item()), 4),
                }
            )
        entry = {"per_depth": per_depth}
        for k, p_min in runs:
            s = greedy_rounds(trunk, heads, start, end, k, p_min)
            ms = round_ms(s, k, cost)
            tot = totals[(k, p_min)]
            for key in counted:
                tot[key] += s[key]
            tot["ms"] += ms
            if (k, p_min) in reported:
                entry[f"k{k}_pmin{p_min:g}"] = s | {
                    "mean_length": round(s["tokens"] / s["rounds"], 3),
                    "est_tok_per_ms": round(s["tokens"] / ms, 3),
                }
        gated, ungated = entry[f"k{args.depth}_pmin{args.p_min:g}"], entry[f"k{args.depth}_pmin0"]
        entry["est_gate_speed_ratio"] = round(gated["est_tok_per_ms"] / ungated["est_tok_per_ms"], 3)
        if args.temperature is not None:
            overlaps = []
            for seed in args.seeds:
                sids = prompt + continuation(llm, prompt, args.gen_len, args.temperature, seed)
                strunk, schain = teacher_forced(model, sids, 3)
                overlaps.append(sampled_overlap(strunk, schain, len(prompt), len(sids) - 1, args.temperature))
            alpha = [torch.cat([o[d] for o in overlaps]) for d in range(3)]
            run = torch.ones_like(alpha[0])
            length = torch.ones_like(alpha[0])
            for a in alpha:  # expected accepted length of a K=3 round (depths taken as independent)
                run = run * a
                length = length + run
            entry["sampled"] = {
                "temperature": args.temperature,
                "overlap_per_depth": [round(a.mean().item(), 4) for a in alpha],
                "k3_expected_length": round(length.mean().item(), 3),
            }
        report[path] = entry
        print(path, json.dumps(entry))
    for t in totals.values():
        t["mean_length"] = round(t["tokens"] / t["rounds"], 3)
        t["est_tok_per_ms"] = round(t["tokens"] / t["ms"], 3)
    report["all_prompts"] = {f"k{k}_pmin{p:g}": totals[(k, p)] for k, p in reported}

    def speed(k: int, p_min: float) -> float:  # estimated tokens per ms over all prompts
        return totals[(k, p_min)]["tokens"] / totals[(k, p_min)]["ms"]

    g, u = report["all_prompts"][f"k{args.depth}_pmin{args.p_min:g}"], report["all_prompts"][f"k{args.depth}_pmin0"]
    report["est_gate_speed_ratio"] = round(g["est_tok_per_ms"] / u["est_tok_per_ms"], 3)
    if args.sweep:
        base = speed(args.depth, 0.0)
        report["est_gate_speed_ratio_sweep"] = {p: round(speed(args.depth, p) / base, 3) for p in args.sweep if p > 0}
        print("est gate speed ratio by p_min", report["est_gate_speed_ratio_sweep"])
    print("all prompts", json.dumps(report["all_prompts"]), "est gate speed ratio", report["est_gate_speed_ratio"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
