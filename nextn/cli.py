"""Every command-line flag of nextn is parsed here: generate, serve, bench, bench serve, replay,
draft-vocab, train; logging set up (nextn.console); errors a user can fix printed as one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nextn import __version__
from nextn.cli_vllm import add_ignored
from nextn.commands import COMMANDS
from nextn.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DRAFT_GATES,
    DTYPE_NAMES,
    K_POLICIES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    check_gpu_memory_utilization,
)
from nextn.console import setup_logging, user_errors
from nextn.server.options import DEFAULT_MAX_LOGPROBS, TOOL_CALL_PARSERS, UVICORN_LOG_LEVELS

LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}  # vLLM's name of the one FP8 K/V format nextn keeps


def _model(p: argparse.ArgumentParser, model_help: str = "default: the bundled model") -> None:
    help = f"checkpoint directory or Hugging Face hub id ({model_help})"
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=help)
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="debug also shows tracebacks")


def _common(p: argparse.ArgumentParser, model_help: str = "default: the bundled model") -> None:
    _model(p, model_help)
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_NAMES, *DTYPE_ALIASES],
        help="auto (default): the checkpoint's dtype on CUDA, float32 on CPU (vLLM's half and float: float16, float32)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="decode/verify/draft step: reference PyTorch modules, or batch-invariant Triton "
        "kernels in CUDA graphs (an error if they cannot run); auto: triton on CUDA, torch on CPU",
    )


def _random_weights(p: argparse.ArgumentParser, tokenizer: bool = True) -> None:
    """generate / serve / bench: a released shape with random weights instead of a checkpoint."""
    p.add_argument(
        "--random-weights",
        default=None,
        metavar="PRESET",
        help="instead of MODEL, a released config with random weights drawn on the device (qwen3.5-9b, "
        "qwen3.5-27b, qwen3.5-35b-a3b)" + ("; needs --tokenizer" if tokenizer else ""),
    )
    if tokenizer:
        p.add_argument(
            "--tokenizer",
            default=None,
            metavar="DIR",
            help="a directory with tokenizer.json (and tokenizer_config.json) to use instead of the checkpoint's "
            "(bench/qwen_tokenizer.py writes Qwen3.5's for --random-weights)",
        )


def _draft_vocab_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-vocab",
        default=None,
        metavar="FILE",
        help="draft over this reduced vocabulary (a file from `nextn draft-vocab`; exactness is unchanged)",
    )


def _quantization(p: argparse.ArgumentParser) -> None:
    """generate / serve / bench: FP8 weights and the K/V cache's dtype."""
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: quantize a bf16 checkpoint's weights at load (128x128 blocks of e4m3); "
        "FP8 checkpoints load as they are without it",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
        help="auto (default): K/V in the model dtype; fp8: the attention layers' K/V in e4m3 with a "
        "scale per row (half the bytes of bf16; the MTP head's draft K/V stay in the model dtype)",
    )


def _memory(p: argparse.ArgumentParser) -> None:
    """generate / serve / bench: how much of the GPU nextn may use (vLLM's flag)."""
    p.add_argument(
        "--gpu-memory-utilization",
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="F",
        help="the fraction of the GPU's memory nextn may use: weights, cache, activations, graphs (default "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}); without --max-num-seqs the cache holds as many sequences as fit, "
        "up to 256 (on the CPU: 8, and this does not apply)",
    )


def _prefix_caching(p: argparse.ArgumentParser) -> None:
    """serve: automatic prefix caching (vLLM's flag), its block size and memory."""
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="requests share the cached state of the prompt blocks they start with (default: on with "
        "--prefill steps, where a cached prefix changes nothing a request emits; not available with chunked)",
    )
    p.add_argument(
        "--prefix-block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens per cached block: a prompt's state is kept at every block boundary (default 128 on the CPU, "
        "256 on a GPU)",
    )
    p.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory the prefix cache may hold, least recently used blocks evicted (default: a tenth of what "
        "the engine may use beside the weights, set aside before the cache's sequences are counted)",
    )


def _tensor_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N processes started here (rank r on cuda:r; gloo on the CPU)",
    )


def _spec(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-k",
        type=int,
        default=None,
        help="draft tokens per round (default: 3 with an MTP head, 0 without; 0 = plain decoding)",
    )
    p.add_argument("--p-min", type=float, default=0.0, help="stop a draft chain below this head confidence")
    p.add_argument("--adaptive-k", action="store_true", help="adapt the draft length to recent acceptance")
    p.add_argument(
        "--spec-k-policy",
        default=None,
        choices=K_POLICIES,
        help="auto (default): each step's K chosen for the batch's tokens/s, 0..--spec-k; fixed: always --spec-k",
    )
    p.add_argument(
        "--hidden-before-norm",
        action="store_true",
        help="feed the MTP head the trunk hidden before the final norm (default: after)",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='vLLM\'s form of --spec-k: \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    p.add_argument(
        "--no-grammar-draft-mask",
        action="store_true",
        help="under structured outputs, draft from the head's unmasked logits (default: grammar-masked; "
        "the output is the same either way, the acceptance is not)",
    )
    _draft_vocab_flag(p)


def _max_model_len(p: argparse.ArgumentParser, help: str) -> None:
    help += " (vLLM's 32k, 32K forms too)"
    p.add_argument("--max-model-len", type=_model_len, default=None, metavar="N", help=help)


def _load(p: argparse.ArgumentParser) -> None:
    """generate / serve: vLLM's flags for where and how the checkpoint loads and what it defaults to."""
    p.add_argument("--revision", default=None, help="a hub id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None, metavar="DIR", help="download a hub id here (default: the HF cache)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the same output, slower)")
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: auto (default) the checkpoint's generation_config.json, vllm none (SamplingParams' "
        "own), or a directory's generation_config.json",
    )
    p.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='sampling defaults over those: \'{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 512}\'',
    )


def _frontend(s: argparse.ArgumentParser) -> None:
    """serve: vLLM's front-end flags (templates, tool calls, logging, CORS, TLS) and the server's seed."""
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="default seeds: a sampled request without a seed takes the next of a sequence drawn from this, so "
        "a server's run repeats (default: fresh ones)",
    )
    s.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the same as --prefill chunked (--no-enable-chunked-prefill: --prefill steps)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) instead of the checkpoint's",
    )
    s.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="chat_template_kwargs every chat request gets (its own win): '{\"enable_thinking\": false}'",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="the <tool_call> body form read as a call and written by a forced one: hermes JSON, qwen3_coder / "
        "qwen3_xml <function=...> XML (default: either is read, the chat template's form forced)",
    )
    s.add_argument(
        "--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, help="logprobs a request may ask for, at most"
    )
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log lines")
    s.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    s.add_argument("--disable-uvicorn-access-log", action="store_true")
    s.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json")
    s.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=[],
        metavar="JSON",
        help="CORS: origins a browser page may call from, as a JSON list ('[\"*\"]'; default: none, no CORS headers)",
    )
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help='CORS (default ["*"])')
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help='CORS (default ["*"])')
    s.add_argument("--allow-credentials", action="store_true", help="CORS")
    s.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under")
    s.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS: the key (with --ssl-certfile)")
    s.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS: the certificate")
    s.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="TLS: CA certificates for client certificates")
    s.add_argument(
        "--ssl-cert-reqs", type=int, default=0, help="TLS: 0 no client certificate, 1 optional, 2 required (ssl's)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nextn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    _common(g, model_help="default: the bundled model; or --random-weights")
    _random_weights(g)
    _quantization(g)
    _memory(g)
    _tensor_parallel(g)
    _spec(g)
    _load(g)
    _max_model_len(g, "tokens per sequence, at most the checkpoint's max_position_embeddings (default: 8192, or that)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--prompt-file", help="prompt text from this file")
    g.add_argument(
        "--chat", action="store_true", help="wrap --prompt (or --prompt-file) as a user turn with the chat template"
    )
    sampling = g.add_argument_group(
        "sampling", "defaults: the checkpoint's generation_config.json, else SamplingParams' own (temperature 1)"
    )
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    sampling.add_argument(
        "--structured-outputs",
        type=_json_object,
        default=None,
        help='a grammar the output must match: \'{"json": SCHEMA}\', \'{"regex": "..."}\', \'{"choice": [...]}\', '
        '\'{"grammar": "LARK"}\' or \'{"json_object": true}\'',
    )
    g.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    g.add_argument(
        "--trace",
        action="store_true",
        help="with --json: a record per round (K, drafts, accepted, draft / verify / commit wall time) in its "
        '"rounds"; rounds then run one at a time',
    )
    g.add_argument(
        "--prefill",
        default="chunked",
        choices=["chunked", "steps"],
        help="chunked (default): the chunked delta rule; steps: the decode step's arithmetic",
    )

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        epilog="vLLM's serve flags that mean nothing here (--trust-remote-code, --block-size, ...) are accepted "
        "and logged: docs/vllm_serve_flags.md lists every vLLM flag and what nextn does with it.",
        allow_abbrev=False,  # a vLLM flag nextn refuses must not pass as an abbreviation of one it takes
    )
    _common(s, model_help="default: the bundled model; or --random-weights")
    _random_weights(s)
    _quantization(s)
    _memory(s)
    _tensor_parallel(s)
    _spec(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may use (responses carry the first; default: MODEL as given)",
    )
    _max_model_len(s, "tokens per sequence, at most the checkpoint's max_position_embeddings (default: 8192, or that)")
    _load(s)
    _frontend(s)
    add_ignored(s)
    s.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="cache slots, allocated at start: requests running at once (one batched forward) plus "
        "conversations kept (default: as many as fit --gpu-memory-utilization, up to 256; 8 on the CPU)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step: the running requests' rows, then chunks of prompts being prefilled "
        "(default 2048 plus 16 per slot: prompts then prefill in 2048-token chunks)",
    )
    s.add_argument("--max-queue", type=int, default=64)
    s.add_argument(
        "--max-request-bytes", type=int, default=16 * 2**20, help="a larger request body is answered 413 unread"
    )
    s.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds open requests get after SIGTERM")
    s.add_argument("--metrics-open", action="store_true", help="/metrics without the API key (for scrapers)")
    s.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines (0: none)")
    s.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="seconds an idle kept-alive connection stays open (uvicorn's)"
    )
    s.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client gets to send a request's headers (from connecting or its last response), "
        "then as long for its body; a late one is closed (headers) or answered 408 (body)",
    )
    s.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="open connections at most; past it the oldest idle one is closed, or the new one answered 503 "
        "(default: half the open-file limit, raised at start towards the hard one; at most 4096)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3"],
        help="qwen3: a reply's <think>...</think> goes to reasoning_content; structured outputs apply after it",
    )
    s.add_argument(
        "--prefill",
        default=None,
        choices=["chunked", "steps"],
        help="steps (default here): prompts run through the decode step's arithmetic, so a "
        "resumed or rewound session emits exactly what a cold run emits; chunked: faster prefill",
    )
    _prefix_caching(s)

    r = sub.add_parser("replay", help="teacher-forced draft acceptance over a text file")
    _common(r)
    r.add_argument("--file", required=True, help="text file to replay")
    r.add_argument("--k", type=int, default=3, help="draft tokens per evaluated position")
    r.add_argument("--stride", type=int, default=1, help="evaluate every S-th position")
    r.add_argument("--max-tokens", type=int, default=None, help="evaluate at most N tokens of the file")
    r.add_argument("--hidden-before-norm", action="store_true")
    r.add_argument(
        "--dump-hidden", default=None, help="write the head-input hidden states (bf16) to this .safetensors file"
    )
    _draft_vocab_flag(r)
    r.add_argument("--json", action="store_true")

    d = sub.add_parser(
        "draft-vocab", help="rank token frequencies over a corpus into a reduced draft vocabulary (FR-Spec)"
    )
    _model(d)
    d.add_argument(
        "--data",
        nargs="+",
        required=True,
        help='text files, folders (walked for --glob) or .jsonl files of chats ({"messages": [...]}, '
        'rendered with the checkpoint\'s chat template) or texts ({"text": ...})',
    )
    d.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary (e.g. 32768)")
    d.add_argument("--out", required=True, help="the draft vocabulary file to write (JSON)")
    d.add_argument("--glob", default="*", help="file names to read in folders (default: every file)")

    b = sub.add_parser(
        "bench",
        help="speed and exactness measurements (`nextn bench serve --help`: load an OpenAI-compatible server)",
        epilog="nextn bench serve [FLAGS]: streamed requests against a server; see nextn bench serve --help",
    )
    _common(b, model_help="or --random-weights")
    _quantization(b)
    _memory(b)
    _tensor_parallel(b)
    _random_weights(b, tokenizer=False)  # the bench's prompts are token ids: no tokenizer
    b.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the context of the cache fit the report gives (max_num_seqs at --gpu-memory-utilization; "
        "default: the bench's own sequences, prompt + generated + 32); the timed runs keep their own",
    )
    b.add_argument("--spec-k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    b.add_argument("--prompt-len", type=int, default=512)
    b.add_argument("--gen-len", type=int, default=256)
    b.add_argument("--repeats", type=int, default=3, help="end-to-end generations per K (median reported)")
    b.add_argument(
        "--prompt-file",
        default=None,
        help="prompt text from this file (its first --prompt-len tokens, repeated if shorter)",
    )
    b.add_argument(
        "--temperature",
        type=float,
        nargs="*",
        default=[],
        help="sampled runs at these temperatures besides the greedy ones (seeded)",
    )
    b.add_argument(
        "--acceptance-profile",
        default=None,
        help="p1,p2,...: also run greedy spec with drafts that are right with probability p_j at "
        "position j (the head still runs), for models whose head guesses nothing",
    )
    b.add_argument(
        "--batch",
        type=int,
        nargs="*",
        default=[],
        help="also decode B sequences together for each B (plain, and spec at the largest --spec-k)",
    )
    b.add_argument("--prefill-len", type=int, default=None, help="measure prefill on a prompt of N tokens")
    b.add_argument(
        "--p-min",
        type=float,
        nargs="+",
        default=[0.0],
        help="the spec runs, greedy and sampled, at each of these draft confidence gates (the first: the main "
        'results; the others under "p_min_runs")',
    )
    b.add_argument(
        "--draft-gate",
        default="skip",
        choices=DRAFT_GATES,
        help="head steps after every draft of a round was cut: skip them in the graph (default) or mask them",
    )
    vocab = b.add_mutually_exclusive_group()
    _draft_vocab_flag(vocab)
    vocab.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="draft over the first N token ids (random-weight presets, where no token is more frequent)",
    )
    b.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file")

    t = sub.add_parser("train", help="train a Qwen3.5-layout model with its MTP head, or distill a head")
    _common(t, model_help="with --distill-from omitted: the checkpoint whose MTP head to train")
    from nextn.train import add_train_args

    add_train_args(t)
    return parser


def build_bench_serve_parser() -> argparse.ArgumentParser:
    """`nextn bench serve`: its own parser; the flags it does not know go to the `nextn serve` it starts."""
    p = argparse.ArgumentParser(
        prog="nextn bench serve",
        description="Streamed requests against an OpenAI-compatible server, measured as vLLM's `vllm bench serve`.",
        epilog="Without --base-url every other flag goes to the `nextn serve` it starts "
        "(e.g. --spec-k 3 --max-num-seqs 64 --device cuda); it picks the host and port.",
        allow_abbrev=False,  # an abbreviation of a serve flag must not match one of the bench's
    )
    p.set_defaults(command="bench serve", model_pos=None)
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="debug also shows tracebacks")
    p.add_argument("--base-url", default=None, help="a running server, http://HOST:PORT (default: start nextn serve)")
    p.add_argument(
        "--model",
        default=None,
        help="with --base-url: the model the requests name (default: the first of /v1/models); "
        "without: the checkpoint nextn serve loads (default: the bundled model)",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--dataset", default=None, choices=["random"], help="random token ids (the default)")
    p.add_argument("--prompt-file", default=None, help="prompts cut from this text file at random offsets")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a directory with tokenizer.json, to count lengths in tokens (default: the checkpoint started, "
        "else --model if a directory; without one a token is 4 characters)",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="every prompt starts with the same N tokens (a shared system prompt) before its own "
        "--random-input-len (default 0)",
    )
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="input and output lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM's random dataset "
        "(with --prompt-file: the input lengths only)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM's extension)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no bound)")
    p.add_argument("--seed", type=int, default=0, help="for the prompts and the arrival times")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (and awaited) before the timed run")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds nextn serve gets to come up")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (vLLM's names)")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra fields of the JSON")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:2] != ["bench", "serve"]:
        return build_parser().parse_args(argv)
    args, args.serve_flags = build_bench_serve_parser().parse_known_args(argv[2:])
    args.argv = ["nextn", *argv]
    # the flags for the server it starts, checked now by serve's own parser (an unknown one is an error there)
    args.serve = None if args.base_url is not None else build_parser().parse_args(["serve", *args.serve_flags])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    setup_logging(args.log_level)
    try:
        if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
            raise ValueError(f"two models given: {args.model_pos} and --model {args.model}")
        args.model = args.model or args.model_pos
        _check_combinations(args)
        _check_numbers(args)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except user_errors() as e:
        if args.log_level == "debug":
            raise
        print(f"nextn: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2


def _check_combinations(args: argparse.Namespace) -> None:
    """Flags that mean nothing without another are an error, not silently ignored."""
    if args.command == "generate":
        if args.chat and args.prompt_ids is not None:
            raise ValueError("--chat wraps a text prompt (--prompt or --prompt-file), not --prompt-ids")
        if args.trace and not args.json:
            raise ValueError('--trace needs --json: the rounds are its "rounds"')
        if args.no_grammar_draft_mask and args.structured_outputs is None:
            raise ValueError("--no-grammar-draft-mask needs --structured-outputs: without a grammar no draft is masked")
    if args.command == "bench serve":
        if args.base_url is not None and args.serve_flags:
            raise ValueError(
                f"unrecognized arguments: {' '.join(args.serve_flags)} (other flags go to the nextn serve that "
                "the bench starts, and with --base-url it starts none)"
            )
        if given := [f for f in args.serve_flags if f.split("=")[0] in ("--host", "--port")]:
            raise ValueError(f"{', '.join(given)}: the bench picks the address of the server it starts")
    if args.command == "serve":
        _check_serve(args)
    if args.command in ("generate", "serve"):
        # K unknown here (None) is the checkpoint's default; only an explicit 0 is known to draw no drafts
        if 0 in (args.spec_k, (args.speculative_config or {}).get("num_speculative_tokens")):
            draft_flags = {
                "--p-min": args.p_min != 0.0,
                "--adaptive-k": args.adaptive_k,
                "--spec-k-policy": args.spec_k_policy is not None,
                "--hidden-before-norm": args.hidden_before_norm,
                "--no-grammar-draft-mask": args.no_grammar_draft_mask,
            }
            if given := [flag for flag, on in draft_flags.items() if on]:
                raise ValueError(f"{', '.join(given)} would do nothing: speculation is off (K=0), nothing is drafted")


def _check_serve(args: argparse.Namespace) -> None:
    """serve's vLLM flags that overlap nextn's own, resolved: a pair that disagrees is an error."""
    chunked = {True: "chunked", False: "steps", None: None}[args.enable_chunked_prefill]
    if chunked is not None and args.prefill not in (None, chunked):
        flag = "--enable-chunked-prefill" if args.enable_chunked_prefill else "--no-enable-chunked-prefill"
        raise ValueError(f"{flag} means --prefill {chunked}, not --prefill {args.prefill}")
    args.prefill = args.prefill or chunked or "steps"  # serve's default: steps (a resumed session == a cold run)
    # --served-model-name takes one or more names: one that is a directory, with no MODEL given, was
    # probably the model (`--served-model-name a DIR`), which must not be served under a name silently
    names = args.served_model_name or []
    if args.model is None and args.random_weights is None and (dirs := [n for n in names if Path(n).is_dir()]):
        raise ValueError(
            f"--served-model-name took {dirs[0]}, a directory, and no model was given: put the model first "
            f"(nextn serve {dirs[0]} --served-model-name ...) or give it as --model"
        )


def _check_numbers(args: argparse.Namespace) -> None:
    """--gpu-memory-utilization read here rather than by argparse: a bad value is one line naming the flag.
    vLLM's dtype names as nextn's."""
    if getattr(args, "dtype", None) in DTYPE_ALIASES:
        args.dtype = DTYPE_ALIASES[args.dtype]
    if getattr(args, "kv_cache_dtype", None) in KV_CACHE_DTYPE_ALIASES:
        args.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES[args.kv_cache_dtype]
    value = getattr(args, "gpu_memory_utilization", None)
    if value is None:
        return
    try:
        value = float(value)
    except ValueError:
        pass  # the check names it
    args.gpu_memory_utilization = check_gpu_memory_utilization(value, "--gpu-memory-utilization")


def _model_len(text: str) -> int:
    """A token count as vLLM writes it: 32768, 32k (x 1000) or 32K (x 1024), 1m / 1M likewise."""
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 2**20}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def _json_list(text: str) -> list[str]:
    """vLLM's list flags: a JSON list of strings ('["a", "b"]'); a bare string is a list of one."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
