"""Continuous batching on the CPU, in one process, on the bundled model: 8 requests together
against the same 8 one after another, through `LLM.generate` and through the server with the
openai client (8 concurrent completions against 8 sequential ones), greedy, outputs compared.

python bench/batching_cpu.py [--max-tokens 64] [--out bench/results/batching_cpu.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable

import openai
import torch
import uvicorn

import nextn
from nextn.config.serve import ServeConfig
from nextn.server.app import create_app

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef list_files(path):",
    "def quicksort(items):",
    "def read_json(path):\n    with open(path) as f:",
    "async def fetch(session, url):",
    "def is_prime(n: int) -> bool:",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:",
]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def serve_in_thread(llm) -> tuple[str, Callable[[], None]]:
    """`nextn serve`'s app for llm on a free local port in a thread: (its /v1 url, a stop function)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(llm, ServeConfig()), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(15)

    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    llm = nextn.LLM(device="cpu", max_num_seqs=8)
    params = nextn.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)  # warm-up
    batched, t_batched = _timed(lambda: llm.generate(PROMPTS, params))
    alone, t_alone = _timed(lambda: [llm.generate([p], params)[0] for p in PROMPTS])
    res = {
        "model": "default_model",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "requests": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "spec_k": llm.num_speculative_tokens,
        "llm_generate_batched_s": t_batched,
        "llm_generate_one_by_one_s": t_alone,
        "llm_generate_time_ratio": t_batched / t_alone,
        "llm_generate_outputs_equal": [b.outputs[0].token_ids for b in batched]
        == [a.outputs[0].token_ids for a in alone],
    }
    print(f"LLM.generate: 8 together {t_batched:.2f} s, one by one {t_alone:.2f} s ({t_batched / t_alone:.2f})")

    url, stop = serve_in_thread(llm)
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def complete(prompt: str) -> str:
        r = client.completions.create(model="default_model", prompt=prompt, max_tokens=args.max_tokens, temperature=0.0)
        return r.choices[0].text

    complete(PROMPTS[0])  # warm-up
    sequential, t_seq = _timed(lambda: [complete(p) for p in PROMPTS])
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent_out, t_conc = _timed(lambda: list(pool.map(complete, PROMPTS)))
    stop()
    res.update(
        server_concurrent_s=t_conc,
        server_sequential_s=t_seq,
        server_time_ratio=t_conc / t_seq,
        server_outputs_equal=concurrent_out == sequential,
        command="python bench/batching_cpu.py" + (f" --out {args.out}" if args.out else ""),
    )
    print(f"server: 8 concurrent {t_conc:.2f} s, 8 sequential {t_seq:.2f} s ({t_conc / t_seq:.2f})")
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
