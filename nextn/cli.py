"""Every command-line flag of nextn is parsed here: generate, serve, bench, bench serve, replay,
draft-vocab, train; logging set up (nextn.console); errors a user can fix printed as one line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nextn import __version__
from nextn.cli_vllm import add_ignored
from nextn.commands import COMMANDS
from nextn.config.engine_args import CLI_DEFAULTS, SERVE_DEFAULTS, EngineArgs
from nextn.config.flags import add_cli_args, fields_given, json_object
from nextn.config.serve import ServeConfig, ServerOptions
from nextn.console import setup_logging, user_errors

LOG_LEVELS = ("debug", "info", "warning", "error")
# EngineArgs fields of the commands that load a model themselves (replay, bench, train, draft-vocab)
LOCAL = ("model", "device", "dtype", "kernels")
BENCH = (*LOCAL, "random_weights", "quantization", "kv_cache_dtype", "gpu_memory_utilization")
BENCH += ("tensor_parallel_size", "draft_gate")


class Parser(argparse.ArgumentParser):
    """argparse's parser with a flag error on one line, as every other error of the CLI (the usage is
    `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="debug also shows tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="nextn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nextn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    _log_level(g)
    add_cli_args(g, EngineArgs, skip=("seed",), defaults=CLI_DEFAULTS)  # --seed: the request's (sampling)
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
        type=json_object,
        default=None,
        help='a grammar the output must match: \'{"json": SCHEMA}\', \'{"regex": "..."}\', \'{"choice": [...]}\', '
        '\'{"grammar": "LARK"}\' or \'{"json_object": true}\'',
    )
    g.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        epilog="vLLM's serve flags that mean nothing here (--trust-remote-code, --block-size, ...) are accepted "
        "and logged: docs/vllm_serve_flags.md lists every vLLM flag and what nextn does with it.",
        allow_abbrev=False,  # a vLLM flag nextn refuses must not pass as an abbreviation of one it takes
    )
    _log_level(s)
    add_cli_args(s, EngineArgs, skip=("trace",), defaults=SERVE_DEFAULTS)
    add_cli_args(s, ServeConfig, group="server")
    add_cli_args(s, ServerOptions, group="HTTP and vLLM's front end")
    add_ignored(s)

    r = sub.add_parser("replay", help="teacher-forced draft acceptance over a text file")
    _log_level(r)
    add_cli_args(r, EngineArgs, only=LOCAL)
    r.add_argument("--file", required=True, help="text file to replay")
    r.add_argument("--k", type=int, default=3, help="draft tokens per evaluated position")
    r.add_argument("--stride", type=int, default=1, help="evaluate every S-th position")
    r.add_argument("--max-tokens", type=int, default=None, help="evaluate at most N tokens of the file")
    r.add_argument("--hidden-before-norm", action="store_true")
    r.add_argument(
        "--dump-hidden", default=None, help="write the head-input hidden states (bf16) to this .safetensors file"
    )
    r.add_argument("--draft-vocab", default=None, metavar="FILE", help="draft over this reduced vocabulary")
    r.add_argument("--json", action="store_true")

    d = sub.add_parser(
        "draft-vocab", help="rank token frequencies over a corpus into a reduced draft vocabulary (FR-Spec)"
    )
    _log_level(d)
    add_cli_args(d, EngineArgs, only=("model",))
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
    _log_level(b)
    add_cli_args(b, EngineArgs, only=BENCH)
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
        "--no-tune",
        dest="tune",
        action="store_false",
        help="run the skinny GEMM's block configs of nextn.ops.linear_configs' table, as serve and generate do "
        "(default: measure each weight shape's candidates first, triton on a GPU)",
    )
    b.add_argument(
        "--p-min",
        type=float,
        nargs="+",
        default=[0.0],
        help="the spec runs, greedy and sampled, at each of these draft confidence gates (the first: the main "
        'results; the others under "p_min_runs")',
    )
    vocab = b.add_mutually_exclusive_group()
    vocab.add_argument("--draft-vocab", default=None, metavar="FILE", help="draft over this reduced vocabulary")
    vocab.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="draft over the first N token ids (random-weight presets, where no token is more frequent)",
    )
    b.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file")

    t = sub.add_parser("train", help="train a Qwen3.5-layout model with its MTP head, or distill a head")
    _log_level(t)
    add_cli_args(t, EngineArgs, only=LOCAL)
    from nextn.train import add_train_args

    add_train_args(t)
    return parser


def build_bench_serve_parser() -> argparse.ArgumentParser:
    """`nextn bench serve`: its own parser; the flags it does not know go to the `nextn serve` it starts."""
    p = Parser(
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
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help=(
            "requests sent (and awaited) before the timed run: prompts drawn apart from the measured"
            " ones (the next seed, no shared prefix), as long as they"
        ),
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds nextn serve gets to come up")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (vLLM's names)")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra fields of the JSON")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="the JSON also lists each request's ttfts, e2els and sent_at (seconds), vLLM's detail",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:2] != ["bench", "serve"]:
        args = build_parser().parse_args(argv)
        fields_given(args)  # the flag fields not given set to their defaults
        return args
    args, args.serve_flags = build_bench_serve_parser().parse_known_args(argv[2:])
    args.argv = ["nextn", *argv]
    # the flags for the server it starts, checked now by serve's own parser (an unknown one is an error there)
    args.serve = None if args.base_url is not None else parse_args(["serve", *args.serve_flags])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    setup_logging(args.log_level)
    try:
        _check_combinations(args)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except user_errors() as e:
        if args.log_level == "debug":
            raise
        print(f"nextn: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2


def _check_combinations(args: argparse.Namespace) -> None:
    """Flags that mean nothing without another are an error, not silently ignored (EngineArgs checks
    its own: a draft setting with K=0)."""
    if args.command == "generate":
        if args.chat and args.prompt_ids is not None:
            raise ValueError("--chat wraps a text prompt (--prompt or --prompt-file), not --prompt-ids")
        if args.trace and not args.json:
            raise ValueError('--trace needs --json: the rounds are its "rounds"')
        if not args.grammar_draft_mask and args.structured_outputs is None:
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


def _check_serve(args: argparse.Namespace) -> None:
    """--served-model-name takes one or more names: one that is a directory, with no MODEL given, was
    probably the model (`--served-model-name a DIR`), which must not be served under a name silently."""
    names = args.served_model_name or []
    if args.model is None and args.random_weights is None and (dirs := [n for n in names if Path(n).is_dir()]):
        raise ValueError(
            f"--served-model-name took {dirs[0]}, a directory, and no model was given: put the model first "
            f"(nextn serve {dirs[0]} --served-model-name ...) or give it as --model"
        )


if __name__ == "__main__":
    sys.exit(main())
