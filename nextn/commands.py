"""The command implementations behind nextn's command line: generate, serve, bench, bench serve,
replay, draft-vocab, train, each a function of the parsed flags (an argparse Namespace) returning an exit
code. Parses nothing: every flag is defined in nextn.cli, which dispatches here through COMMANDS.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from nextn.core import MAX_TRACKED_POSITIONS

log = logging.getLogger("nextn.serve")


def _local(args, default_model: bool = True) -> None:
    """Resolve the model to a directory, and device / dtype "auto", for the commands that load the
    model themselves (replay, bench, train). generate and serve leave that to LLM."""
    from nextn.config import resolve_device, resolve_dtype
    from nextn.hub import resolve_model
    from nextn.models.loader import model_config

    args.device = resolve_device(args.device)
    if args.model is not None or default_model:
        args.model = str(resolve_model(args.model))
    if args.dtype == "auto":
        checkpoint_dtype = model_config(args.model).dtype if args.model is not None else None
        args.dtype = resolve_dtype("auto", args.device, checkpoint_dtype)


def _replay(args) -> int:
    from nextn.models.loader import model_config
    from nextn.spec.draft_vocab import load_draft_vocab
    from nextn.spec.replay import check_args, replay_from_args
    from nextn.tokenizer import load_tokenizer

    check_args(args)  # before a download or the load
    _check_out("--dump-hidden", args.dump_hidden)  # written after the trunk pass: refused before the load
    _local(args)
    if args.draft_vocab is not None:  # checked against the checkpoint before it loads (replay reads it again)
        load_draft_vocab(args.draft_vocab, model_config(args.model).vocab_size, load_tokenizer(args.model))
    return replay_from_args(args)


def _check_out(flag: str, path: str | None) -> None:
    """A file a command writes at its end: a name in a folder that exists, not a folder."""
    if path is None:
        return
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: a directory; give a file name")
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"{flag} {path}: its folder does not exist")


def _bench(args) -> int:
    from nextn.bench.offline import bench_from_args, check_args
    from nextn.config import check_gpu_memory_utilization

    check_gpu_memory_utilization(args.gpu_memory_utilization, "--gpu-memory-utilization")
    check_args(args)  # before a download
    _local(args, default_model=args.random_weights is None)  # MODEL (default: the bundled one) or --random-weights
    return bench_from_args(args)


def _bench_serve(args) -> int:
    from nextn.bench.serve import bench_serve_from_args

    _check_out("--json", args.json_out)  # written at the end: refused before the run
    return bench_serve_from_args(args)


def _draft_vocab(args) -> int:
    from nextn.hub import resolve_model
    from nextn.models.loader import model_config
    from nextn.spec.draft_vocab import build_draft_vocab
    from nextn.tokenizer import load_tokenizer

    _check_out("--out", args.out)  # before counting a corpus, not after
    model_dir = resolve_model(args.model)
    cfg, tokenizer = model_config(model_dir), load_tokenizer(model_dir)
    # a draft vocabulary that can end a reply
    eos = {t for t in (*cfg.eos_token_ids, tokenizer.eos_token_id) if t is not None and t < cfg.vocab_size}
    vocab = build_draft_vocab(
        tokenizer, args.data, args.size, cfg.vocab_size, args.glob, eos, settings={"model": str(model_dir)}
    )
    vocab.save(args.out)
    s = vocab.settings
    print(
        f"draft-vocab: {vocab.size} of {cfg.vocab_size} ids hold {s['coverage']:.2%} of the {s['tokens']} tokens "
        f"({s['files']} files, {s['distinct_tokens']} distinct tokens) -> {args.out}",
        file=sys.stderr,
    )
    return 0


def _train(args) -> int:
    from nextn.train import run_from_args

    if args.dtype == "auto":
        args.dtype = None  # train picks its autocast dtype itself: bfloat16 on CUDA, float32 on CPU
    _local(args, default_model=False)  # without a model train starts a new one
    return run_from_args(args)


def _serve(args) -> int:
    """The engine core in a process of its own (nextn.server.core_client), the HTTP server here,
    bound once the core has loaded the model."""
    from nextn.config.engine_args import EngineArgs
    from nextn.config.flags import values
    from nextn.config.serve import ServeConfig, ServerOptions
    from nextn.server import app
    from nextn.server.core_client import CoreProcess

    for flag, why in args.vllm_ignored:  # vLLM's flags that mean nothing here: one line each
        log.info("%s does nothing in nextn (accepted for vLLM command lines): %s", flag, why)
    # every setting checked before the model loads
    cfg, opts = ServeConfig(**values(args, ServeConfig)), ServerOptions(**values(args, ServerOptions))
    engine_args = EngineArgs.from_cli(args)
    _check_address(cfg.host, cfg.port)
    core = CoreProcess.launch(engine_args, args.log_level)  # a start-up error raises here: one line, as LLM's
    try:
        return app.serve(core, cfg, opts)
    finally:
        core.stop()


def _check_address(host: str, port: int) -> None:
    """The server's address free to bind, before the model loads (uvicorn would fail only after it,
    binding as here: IPv6 for a host with a colon, SO_REUSEADDR)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _generate(args) -> int:
    from nextn import LLM
    from nextn.config.engine_args import EngineArgs
    from nextn.core import with_defaults

    # the prompt and the sampling flags checked before the model loads
    prompt_ids, text = None, args.prompt
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not prompt_ids:
            raise ValueError("--prompt-ids is empty")
    elif args.prompt_file is not None:
        text = Path(args.prompt_file).read_text(errors="replace")
    request = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "structured_outputs": args.structured_outputs,
    }
    with_defaults({}, **request)
    llm = LLM.from_args(EngineArgs.from_cli(args))
    try:
        return _generate_with(llm, args, prompt_ids, text, request)
    finally:
        llm.close()


def _generate_with(llm, args, prompt_ids: list[int] | None, text: str | None, request: dict) -> int:
    if prompt_ids is None:
        if args.chat:
            text = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt_ids = llm.tokenizer.encode(text)
    params = llm.default_sampling_params(**request)
    streamed = not args.json
    out = None
    for ev in llm.stream(prompt_ids, params):
        if streamed:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        out = ev.output or out
    if streamed:
        sys.stdout.write("\n")
    s, k = out.spec, min(llm.num_speculative_tokens, MAX_TRACKED_POSITIONS)
    spec = "plain decoding (K=0: nothing drafted)"  # every step verifies the pending token alone
    if llm.num_speculative_tokens:
        spec = (
            f"spec K={llm.num_speculative_tokens}: drafted {s.num_drafted}, accepted {s.num_accepted} "
            f"({s.acceptance_rate:.1%}), mean acceptance length {s.mean_acceptance_length:.2f}, "
            f"zero-draft rounds {s.num_zero_draft_rounds} of {s.num_rounds}"
        )
    print(
        f"nextn: {len(out.token_ids)} tokens, prefill {out.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {out.decode_tokens_per_s:.1f} tok/s, {spec}",
        file=sys.stderr,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": out.token_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens,
                    "num_speculative_tokens": llm.num_speculative_tokens,
                    "num_drafted": s.num_drafted,
                    "num_accepted": s.num_accepted,
                    "num_rounds": s.num_rounds,
                    "num_zero_draft_rounds": s.num_zero_draft_rounds,
                    "drafted_per_position": s.drafted_per_position,
                    "accepted_per_position": s.accepted_per_position,
                    "accept_length_histogram": s.accept_length_histogram[: k + 1],
                    "acceptance_rate": s.acceptance_rate,
                    "mean_acceptance_length": s.mean_acceptance_length,
                    "decode_tokens_per_s": out.decode_tokens_per_s,
                    "prefill_tokens_per_s": out.prefill_tokens_per_s,
                    **({"rounds": [r._asdict() for r in out.rounds]} if args.trace else {}),
                }
            )
        )
    return 0


COMMANDS = {
    "generate": _generate,
    "serve": _serve,
    "replay": _replay,
    "bench": _bench,
    "bench serve": _bench_serve,
    "draft-vocab": _draft_vocab,
    "train": _train,
}
