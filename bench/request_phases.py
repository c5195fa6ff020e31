"""Where a bench generation's wall time goes: the request's start (the head's catch-up over the
prompt, the sampler's values and seeded uniforms, the first token), its rounds, and its close,
for plain decoding and K drafts, greedy and sampled, on one slot (the bundled model by default).
The bench times all three as decode time; a per-request cost there lowers every speed-up.

  python bench/request_phases.py [--model DIR] [--k 3] [--temperature 0.7] [--top-k 20 --top-p 0.95]
                                 [--seeds 4] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nextn.bench.measure import Bench, BenchConfig
from nextn.bench.offline import text_prompt
from nextn.engine.rounds import RequestRounds
from nextn.engine.scheduler import RoundSettings
from nextn.models.loader import load_model
from nextn.sample.pipeline import RequestRng, SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(bench: Bench, k: int, temperature: float, seed: int, filters: dict) -> dict:
    """ms of start, rounds and close of one generation (synchronised between phases)."""
    _, runner, proposer = bench.core(k)
    seq = bench.prefilled(k)
    params = SamplingParams(
        max_tokens=bench.cfg.gen_len, temperature=temperature, seed=seed, ignore_eos=True, **filters
    )
    _sync()
    t0 = time.perf_counter()
    rounds = RequestRounds(runner, proposer, seq, RoundSettings(params))
    _sync()
    t1 = time.perf_counter()
    n = 0
    while True:
        r = rounds.next()
        n += len(r.token_ids)
        if r.finish_reason is not None:
            break
    _sync()
    t2 = time.perf_counter()
    rounds.close()
    _sync()
    t3 = time.perf_counter()
    return {
        "start_ms": (t1 - t0) * 1e3,
        "rounds_ms": (t2 - t1) * 1e3,
        "close_ms": (t3 - t2) * 1e3,
        "tokens": n,
        "rounds": rounds.stats.num_rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="nextn/default_model")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    filters = dict(top_k=args.top_k, top_p=args.top_p)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, device, "bfloat16" if device == "cuda" else "float32")
    prompt = text_prompt(args.model, 512, Path("nextn/engine/rounds.py").read_text())
    bench = Bench(model, prompt, BenchConfig(spec_ks=[args.k], gen_len=256, kernels="auto"))
    report = {"model": args.model, "device": str(device), "k": args.k, "filters": filters, "runs": {}}
    for k in (0, args.k):
        for temperature in (0.0, args.temperature):
            sampled = filters if temperature > 0 else {}
            phases(bench, k, temperature, 0, sampled)  # warm: compiled, captured
            runs = [phases(bench, k, temperature, s, sampled) for s in range(args.seeds)]
            mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
            per_round = mean["rounds_ms"] / max(1, mean["rounds"] or mean["tokens"])
            print(
                f"K={k} T={temperature}: start {mean['start_ms']:.2f} ms, rounds {mean['rounds_ms']:.2f} ms "
                f"({mean['rounds']:.1f} rounds, {per_round:.3f} ms each), close {mean['close_ms']:.2f} ms, "
                f"{mean['tokens']:.0f} tokens"
            )
            report["runs"][f"K{k}_T{temperature}"] = {"mean": mean, "runs": runs}
    _sync()
    t0 = time.perf_counter()
    for s in range(10):
        RequestRng(s).table(0, 256 + 40, device)
    _sync()
    report["uniform_table_ms"] = (time.perf_counter() - t0) * 1e2
    print(f"uniform table (3 streams, 296 indices): {report['uniform_table_ms']:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
