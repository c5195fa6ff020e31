"""What a prompt piece costs riding in a decode round, every kernel of the trunk step included (issue
44's 9B bar): the engine's trunk step (nextn.models.qwen3_5_step.TritonStep.trunk) over
- a round: B sequences of CONTEXT committed tokens, one row each (a K = 0 round's verify rows);
- a mixed step: the same B rows and one prompt piece of P rows of another sequence (StepBatch's
  pieces_from: the piece kept whole, as a prefill step keeps it);
- the piece alone: a prefill step of its P rows;
each captured in a CUDA graph and replayed (bench/overlap_probe.py --mixed timed the GEMMs alone).
The steps commit nothing, so every replay computes the same rows.

From a round t0 and a mixed step t(P) it prints the marginal cost of a prompt row, a = (t(P) - t0) / P,
and the served / offline ratio it predicts for the served 9B cell (16 streams, prompts of L = 512
tokens, 128 output tokens, K = 0; offline: the same B sequences decoding, no prefill): each request's
prompt rides in n = L / P rounds, its first token from the last of them, so a stream spends n + 127
rounds a request where the offline batch spends 128, and the prompts add B * n * (t(P) - t0):

    ratio = 128 * t0 / ((127 + n) * t0 + B * n * (t(P) - t0))

(an upper bound of what mixed steps can give with these kernels: no scheduling, no head catch-up,
the rounds and pieces perfectly out of phase). --chunked: the pieces' GDN rows by the chunked delta
rule (StepBatch.chunked: tensor-core chunks of 64 rows) instead of the decode step's recurrence,
whose serial rows of one sequence dominated run 182's pieces. --profile: each mixed step once more,
eagerly under torch.profiler: its kernels' summed GPU time and launches (what the graph's replay
pays beyond them is launch gaps: the glue of many small kernels shows there) and the costliest kernels.
--wave: then the round's B sequences reset and prefilled together, PROMPT rows each, in one graphed
prefill step, their GDN rows by the recurrence (steps) and by the chunked rule: a served wave's step
on the engine alone (run 184's wave, steps, prefix cache on: 408 ms).
Usage (device):
    python3 bench/mixed_step_probe.py [--preset qwen3.5-9b] [--batch 16] [--context 512]
        [--pieces 64 128 256 512] [--chunked] [--profile] [--wave] [--json OUT]
On the CPU (--model DIR --device cpu) the steps run eagerly, a few times each: a check that it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

OUTPUTS, PROMPT = 128, 512  # the served 9B cell's output and prompt tokens


def predicted_ratio(t0: float, t: float, piece: int, batch: int) -> float:
    """The served / offline ratio mixed steps of `piece` prompt rows would give at most (the docstring's formula)."""
    n = PROMPT / piece
    return OUTPUTS * t0 / ((OUTPUTS - 1 + n) * t0 + batch * n * (t - t0))


def timed(fn, device: torch.device, reps: int) -> float:
    """Seconds a call of fn takes: a CUDA graph's replay on a GPU, an eager call on the CPU."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def kernels_of(fn) -> dict:
    """fn's CUDA kernels, one eager call under torch.profiler: summed GPU ms, launches, the costliest."""
    from profile_prefill import kernel_totals  # (bench/ is on the path of a bench script)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = kernel_totals(prof)
    busy, launches = sum(r[0] for r in rows) / 1e3, sum(r[1] for r in rows)
    print(
        f"    kernels {busy:.3f} ms in {launches} launches: "
        + ", ".join(f"{k[:28]} {us / 1e3:.2f}" for us, _, k in rows[:5])
    )
    return {
        "ms": busy,
        "launches": launches,
        "top": [{"name": k[:100], "count": n, "ms": us / 1e3} for us, n, k in rows[:12]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--model", default=None, help="a checkpoint, not the preset (a CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=PROMPT, help="the round's sequences' committed tokens")
    ap.add_argument("--pieces", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunked", action="store_true", help="the pieces' GDN by the chunked delta rule")
    ap.add_argument("--profile", action="store_true", help="each mixed step's kernels (torch.profiler)")
    ap.add_argument("--wave", action="store_true", help="then B prompts in one prefill step, steps and chunked")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from nextn.cache import StepBatch
    from nextn.engine.llm import LLM
    from nextn.engine.riding import Piece
    from nextn.engine.sequence import Sequence

    B, top = args.batch, max(args.pieces)
    settings = dict(
        device=args.device,
        dtype="bfloat16",
        max_model_len=max(args.context, top, PROMPT if args.wave else 0) + 8,
        max_num_seqs=B + 1,
        num_speculative_tokens=0,
        prefill="steps",
        enable_prefix_caching=False,
    )
    if args.model is None:
        settings.update(random_weights=args.preset, tokenizer="nextn/default_model")
    llm = LLM(args.model, **settings)
    runner = llm.engine.runner
    device, V, H = runner.device, runner.cfg.vocab_size, runner.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    vocab = min(V, 150_000)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    with torch.inference_mode():
        seqs = []
        for slot in range(B + 1):
            runner.slot(slot).reset()
            seqs.append(Sequence(slot, heads=False))
        for s in seqs[:B]:  # the round's sequences: CONTEXT tokens each (one prefill step at a time: memory)
            runner.prefill([Piece(s, ids(args.context))])
        caches = [runner.slot(s.slot) for s in seqs]
        round_ids = torch.tensor(ids(B), device=device)
        logits = torch.empty(B + 1, V, dtype=torch.float32, device=device)
        hidden = torch.empty(B + top, H, dtype=runner.dtype, device=device)
        round_batch = StepBatch(caches[:B], [1] * B)

        def round_step():
            runner.step.trunk(round_batch, round_ids, logits[:B], hidden[:B])

        t0 = timed(round_step, device, args.reps)
        kind = "chunked" if args.chunked else "steps"
        print(f"round of {B} rows (context {args.context}): {t0 * 1e3:.3f} ms; pieces {kind}")
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "preset": args.preset if args.model is None else args.model,
            "batch": B,
            "context": args.context,
            "round_ms": t0 * 1e3,
            "chunked": args.chunked,
            "pieces": {},
        }
        if args.profile and device.type == "cuda":
            result["round_kernels"] = kernels_of(round_step)
        for P in args.pieces:
            piece_ids = torch.tensor(ids(P), device=device)
            mixed_ids = torch.cat([round_ids, piece_ids])
            mixed = StepBatch(caches, [1] * B + [P], pieces_from=B, chunked=args.chunked)
            rows = torch.tensor([*range(B), B + P - 1], device=device)
            alone = StepBatch(caches[B:], [P], chunked=args.chunked)
            last = torch.tensor([P - 1], device=device)

            def mixed_step(mixed=mixed, mixed_ids=mixed_ids, rows=rows, P=P):
                runner.step.trunk(mixed, mixed_ids, logits, hidden[: B + P], logit_rows=rows)

            def piece_step(alone=alone, piece_ids=piece_ids, last=last, P=P):
                runner.step.trunk(alone, piece_ids, logits[:1], hidden[:P], store_all=False, logit_rows=last)

            t = timed(mixed_step, device, args.reps)
            tp = timed(piece_step, device, args.reps)
            a = (t - t0) / P
            ratio = predicted_ratio(t0, t, P, B)
            result["pieces"][str(P)] = {
                "mixed_ms": t * 1e3,
                "piece_alone_ms": tp * 1e3,
                "us_per_prompt_row_riding": a * 1e6,
                "us_per_prompt_row_alone": tp / P * 1e6,
                "predicted_served_over_offline": ratio,
            }
            print(
                f"piece of {P:4d} rows: mixed {t * 1e3:8.3f} ms (+{(t - t0) * 1e3:.3f}: {a * 1e6:6.1f} us a row), "
                f"alone {tp * 1e3:8.3f} ms ({tp / P * 1e6:6.1f} us a row); predicted served / offline {ratio:.3f}"
            )
            if args.profile and device.type == "cuda":
                result["pieces"][str(P)]["mixed_kernels"] = kernels_of(mixed_step)
        if args.wave:  # the round's sequences reset: B prompts of PROMPT rows in one prefill step, each GDN kind
            for cache in caches[:B]:
                cache.reset()
            wave_ids = torch.tensor(ids(B * PROMPT), device=device)
            wave_hidden = torch.empty(B * PROMPT, H, dtype=runner.dtype, device=device)
            lasts = torch.tensor([(b + 1) * PROMPT - 1 for b in range(B)], device=device)
            result["wave"] = {}
            for chunked in (False, True):
                batch = StepBatch(caches[:B], [PROMPT] * B, chunked=chunked)

                def wave_step(batch=batch):
                    runner.step.trunk(batch, wave_ids, logits[:B], wave_hidden, store_all=False, logit_rows=lasts)

                tw = timed(wave_step, device, max(2, args.reps // 4))
                kind = "chunked" if chunked else "steps"
                per_row = tw / (B * PROMPT) * 1e6
                result["wave"][kind] = {"ms": tw * 1e3, "us_per_row": per_row}
                print(f"wave of {B} x {PROMPT} prompt rows, GDN {kind}: {tw * 1e3:.1f} ms ({per_row:.1f} us a row)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
