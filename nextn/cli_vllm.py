"""The `vllm serve` flags that mean nothing in nextn, as data: `nextn serve` accepts each (a command
line pasted from a vLLM guide starts) and logs one line saying why it does nothing; a flag that
takes a value nextn cannot honour only at vLLM's default refuses any other value, naming it.

The vLLM flags nextn maps to its own behaviour are ordinary flags in nextn.cli; every vLLM flag and
what nextn does with it is listed in docs/vllm_serve_flags.md (tests/test_vllm_cli.py holds the two
to each other). Any flag in neither place stays an error naming it (argparse's).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Ignored:
    """One vLLM flag taken and ignored. flags: its names (vLLM's short form after the long one).
    switch: it takes no value (vLLM's booleans also have a --no- form, accepted too). only: the
    values accepted (vLLM's default and its equals here); None: any value."""

    flags: tuple[str, ...]
    why: str
    switch: bool = False
    only: tuple[str, ...] | None = None
    nargs: str | None = None  # "+": a list of values


_MEMORY = "nextn sizes its cache from --gpu-memory-utilization and --max-num-seqs"
_GRAPHS = "nextn captures a CUDA graph per batch size bucket it runs (--enforce-eager: none)"
_PROCESS = "nextn runs one API process and one engine core process"
_SCHEDULE = "nextn's scheduler admits waiting prompts by arrival and prefills them in whole chunks"

IGNORED: tuple[Ignored, ...] = (
    Ignored(("--trust-remote-code",), "nextn runs no code from a checkpoint (its model code is its own)", switch=True),
    Ignored(
        ("--enable-auto-tool-choice",),
        "tool calls are parsed whenever a request gives tools (tool_choice auto is always on)",
        switch=True,
    ),
    Ignored(("--disable-log-requests",), "nextn does not log requests", switch=True),
    Ignored(("--enable-log-requests",), "nextn does not log requests", switch=True),
    Ignored(("--enable-log-outputs",), "nextn does not log requests", switch=True),
    Ignored(("--max-log-len",), "nextn does not log requests"),
    Ignored(("--disable-custom-all-reduce",), "nextn's tensor parallelism picks its own all-reduce", switch=True),
    Ignored(("--disable-frontend-multiprocessing",), _PROCESS, switch=True),
    Ignored(("--disable-sliding-window",), "Qwen3.5 / Qwen3-Next have no sliding-window attention", switch=True),
    Ignored(("--disable-cascade-attn",), "nextn has no cascade attention", switch=True),
    Ignored(("--async-scheduling",), "nextn always queues the next round before reading the last", switch=True),
    Ignored(("--use-tqdm-on-load",), "nextn shows its own load progress", switch=True),
    Ignored(("--calculate-kv-scales",), "nextn's FP8 K/V cache keeps a scale per row", switch=True),
    Ignored(("--disable-mm-preprocessor-cache",), "nextn serves text only", switch=True),
    Ignored(("--block-size",), "nextn's cache is one contiguous slot per sequence, not blocks"),
    Ignored(("--swap-space",), "nextn does not swap sequences to the CPU"),
    Ignored(("--num-gpu-blocks-override",), _MEMORY),
    Ignored(("--max-seq-len-to-capture",), _GRAPHS),
    Ignored(("--max-cudagraph-capture-size",), _GRAPHS),
    Ignored(("--cuda-graph-sizes",), _GRAPHS, nargs="+"),
    Ignored(("--compilation-config", "-O"), "nextn compiles nothing with torch.compile (Triton kernels, CUDA graphs)"),
    Ignored(("--distributed-executor-backend",), "nextn starts its own tensor-parallel processes"),
    Ignored(("--worker-cls",), "nextn has one worker kind"),
    Ignored(("--max-parallel-loading-workers",), "nextn streams the tensors one at a time"),
    Ignored(("--code-revision",), "nextn runs no code from a checkpoint"),
    Ignored(("--tokenizer-revision",), "--tokenizer is a local directory in nextn"),
    Ignored(("--config-format",), "nextn reads config.json (Hugging Face's format)"),
    Ignored(("--safetensors-load-strategy",), "nextn streams the tensors one at a time"),
    Ignored(("--prefix-caching-hash-algo",), "nextn matches kept prefixes by their token ids"),
    Ignored(("--limit-mm-per-prompt",), "nextn serves text only"),
    Ignored(("--mm-processor-cache-gb",), "nextn serves text only"),
    Ignored(("--max-num-partial-prefills",), _SCHEDULE),
    Ignored(("--max-long-partial-prefills",), _SCHEDULE),
    Ignored(("--long-prefill-token-threshold",), _SCHEDULE),
    Ignored(("--pipeline-parallel-size", "-pp"), "one pipeline stage is nextn's only one", only=("1",)),
    Ignored(("--data-parallel-size", "-dp"), "one engine per server is nextn's only layout", only=("1",)),
    Ignored(("--api-server-count", "-asc"), _PROCESS, only=("1",)),
    Ignored(("--cpu-offload-gb",), "nextn keeps every weight on the device", only=("0",)),
    Ignored(
        ("--scheduling-policy",),
        "nextn admits waiting requests by arrival (admitted prompts share each step's prefill shortest first)",
        only=("fcfs",),
    ),
    Ignored(("--load-format",), "nextn loads safetensors", only=("auto", "safetensors")),
    Ignored(("--tokenizer-mode",), "nextn reads tokenizer.json with the tokenizers library", only=("auto", "hf")),
    Ignored(("--runner",), "nextn generates text", only=("auto", "generate")),
    Ignored(("--task",), "nextn generates text", only=("auto", "generate")),
    Ignored(("--model-impl",), "nextn's model code is its own", only=("auto",)),
    Ignored(("--response-role",), "replies are the assistant's", only=("assistant",)),
    Ignored(
        ("--chat-template-content-format",),
        "a message's text parts reach the template as one string",
        only=("auto", "string"),
    ),
    Ignored(("--mamba-ssm-cache-dtype",), "the Gated DeltaNet state is float32", only=("auto", "float32")),
)


class _Take(argparse.Action):
    """Record the flag (and its why) in namespace.vllm_ignored; refuse a value outside `only`."""

    def __init__(self, option_strings, dest, why: str, only: tuple[str, ...] | None = None, **kwargs):
        self.why, self.only = why, only
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.only is not None and values not in self.only:
            parser.error(f"{option_string} {values}: nextn takes only {' or '.join(self.only)} ({self.why})")
        taken = getattr(namespace, "vllm_ignored", ())
        namespace.vllm_ignored = *taken, (option_string, self.why)


def add_ignored(p: argparse.ArgumentParser) -> None:
    """IGNORED's flags, on `nextn serve`'s parser (out of its --help: docs/vllm_serve_flags.md lists them)."""
    p.set_defaults(vllm_ignored=())
    for entry in IGNORED:
        dest = "_vllm_" + entry.flags[0].lstrip("-").replace("-", "_")
        common = dict(action=_Take, dest=dest, why=entry.why, help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        if entry.switch:
            p.add_argument(*entry.flags, nargs=0, **common)
            p.add_argument("--no-" + entry.flags[0].removeprefix("--"), nargs=0, **common)
        else:
            p.add_argument(*entry.flags, only=entry.only, nargs=entry.nargs, metavar="VALUE", **common)


def ignored_flags() -> list[str]:
    """Every flag name IGNORED accepts (--no- forms included)."""
    names = []
    for entry in IGNORED:
        names += entry.flags
        if entry.switch:
            names.append("--no-" + entry.flags[0].removeprefix("--"))
    return names
