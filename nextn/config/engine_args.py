"""EngineArgs: every setting of an engine as `LLM(**kwargs)` takes it and as `nextn generate` /
`nextn serve` flags give it (vLLM's EngineArgs): names, defaults and help in one place, the flags
generated from it (nextn.config.flags), validated once when it is made. `engine_config()` turns it,
with what the checkpoint says (its MTP head, its context limit, its dtype), into the engine's
EngineConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nextn.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_MODEL_LEN,
    DRAFT_GATES,
    DTYPE_NAMES,
    K_POLICIES,
    KERNELS,
    KV_CACHE_DTYPES,
    PREFILL_MODES,
    QUANTIZATIONS,
    EngineConfig,
    SpecConfig,
    check_gpu_memory_utilization,
    resolve_device,
    resolve_dtype,
)
from nextn.config.flags import (
    aliased,
    cli_fields,
    command_defaults,
    fields_given,
    json_object,
    model_len,
    setting,
    values,
)

if TYPE_CHECKING:
    from nextn.spec.draft_vocab import DraftVocab

# K when none is given and the checkpoint has an MTP head (0 without one)
DEFAULT_K_WITH_HEAD = 3
# speculative_config "method" values that mean the checkpoint's own MTP head (vLLM's names)
MTP_METHODS = ("mtp", "qwen3_next_mtp")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}  # vLLM's name of the one FP8 K/V format nextn keeps
PRESETS_HELP = "qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, qwen3.5-122b-a10b"
# the draft settings that do nothing when nothing is drafted (K=0 given)
# the command line's defaults where they differ from the Python API's (EngineArgs' own): generate's
# and serve's K policy; serve's prefill (steps: a resumed session == a cold run, prefix caching on)
CLI_DEFAULTS = {"k_policy": "auto"}
SERVE_DEFAULTS = {**CLI_DEFAULTS, "prefill": "steps"}
DRAFT_SETTINGS = ("p_min", "adaptive_k", "k_policy", "hidden_after_norm", "grammar_draft_mask")


def _fraction(text: str):
    """--gpu-memory-utilization's value: a float, or the text as given (EngineArgs' check names it)."""
    try:
        return float(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class EngineArgs:
    """The engine's settings. Each field is a flag of `nextn serve` and `nextn generate` (the field's
    name with dashes; docs/flags.md lists them) and an argument of LLM(...)."""

    # --- the model
    model: str | Path | None = setting(
        None, "checkpoint directory or Hugging Face hub id (default: the bundled model)", positional="MODEL"
    )
    random_weights: str | None = setting(
        None,
        f"instead of MODEL, a released shape with random weights drawn on the device ({PRESETS_HELP}); "
        "generate and serve need --tokenizer with it",
        metavar="PRESET",
    )
    tokenizer: str | Path | None = setting(
        None,
        "a directory with tokenizer.json (and tokenizer_config.json) used instead of the checkpoint's; its "
        "vocabulary must fit the model's (bench/qwen_tokenizer.py writes Qwen3.5's for --random-weights)",
        metavar="DIR",
    )
    revision: str | None = setting(None, "a hub id's branch, tag or commit (default: main)")
    download_dir: str | None = setting(None, "download a hub id here (default: the HF cache)", metavar="DIR")
    generation_config: str = setting(
        "auto",
        "sampling defaults: auto, the checkpoint's generation_config.json; vllm, none (SamplingParams' own); "
        "or a directory holding a generation_config.json",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: dict | None = setting(
        None,
        'sampling defaults over those (vLLM\'s names): \'{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 512}\'',
        type=json_object,
        metavar="JSON",
    )
    # --- where and how it runs
    device: str = setting("auto", "auto (cuda when torch sees a GPU, else cpu), cpu or cuda[:N]")
    dtype: str = setting(
        "auto",
        "auto: the checkpoint's dtype on CUDA, float32 on the CPU (vLLM's half and float: float16, float32)",
        type=aliased(DTYPE_ALIASES),
        choices=("auto", *DTYPE_NAMES),
    )
    kernels: str = setting(
        "auto",
        "the step path: torch, the reference PyTorch modules; triton, batch-invariant Triton kernels in CUDA "
        "graphs (an error where they cannot run); auto: triton on CUDA, torch on the CPU",
        choices=KERNELS,
    )
    quantization: str | None = setting(
        None,
        "fp8: a bf16 checkpoint's weights quantized at load (128x128 blocks of e4m3); q8_0: into GGUF's Q8_0 "
        "(int8 with an fp16 scale per 32 weights), kept quantized; FP8 checkpoints load as they are without it",
        aliases=("-q",),
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto: K/V in the model dtype; fp8: the attention layers' K/V in e4m3 with a scale per row (half the "
        "bytes of bf16; the MTP head's draft K/V stay in the model dtype)",
        type=aliased(KV_CACHE_DTYPE_ALIASES),
        choices=KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = setting(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "the fraction of the GPU's memory nextn may use: weights, cache, activations, graphs; without "
        "--max-num-seqs the cache holds as many sequences as fit, up to 256 (on the CPU: 8, and this does not apply)",
        type=_fraction,
        metavar="F",
    )
    tensor_parallel_size: int = setting(
        1,
        "shard the model over N processes started here (rank r on cuda:r; gloo on the CPU)",
        aliases=("-tp",),
        type=int,
        metavar="N",
    )
    enforce_eager: bool = setting(False, "no CUDA graphs (the same output, slower)")
    # --- the cache and the batch
    max_model_len: int | None = setting(
        None,
        f"tokens per sequence, at most the checkpoint's max_position_embeddings (default: {DEFAULT_MAX_MODEL_LEN}, "
        "or that); vLLM's 32k, 32K forms too",
        type=model_len,
        metavar="N",
    )
    max_num_seqs: int | None = setting(
        None,
        "cache slots, allocated at start: requests running at once (one batched forward) plus conversations "
        "kept (default: as many as fit --gpu-memory-utilization, up to 256; 8 on the CPU)",
        type=int,
        metavar="N",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "tokens per engine step: the running requests' rows, then chunks of prompts being prefilled (default "
        "2048 plus 16 per slot: prompts then prefill in 2048-token chunks)",
        type=int,
        metavar="N",
    )
    prefill: str = setting(
        "chunked",
        "chunked: the chunked delta rule, prompt pieces riding the running requests' rounds (faster); steps: "
        "prompts run through the decode step's arithmetic, so a "
        "resumed or rewound session emits exactly what a cold run emits (vLLM's --enable-chunked-prefill: chunked, "
        "--no-enable-chunked-prefill: steps)",
        choices=PREFILL_MODES,
        consts={"--enable-chunked-prefill": "chunked", "--no-enable-chunked-prefill": "steps"},
    )
    enable_prefix_caching: bool | None = setting(
        None,
        "requests share the cached state of the prompt blocks they start with (default: on with --prefill steps, "
        "where a cached prefix changes nothing a request emits; not available with chunked)",
    )
    prefix_block_size: int | None = setting(
        None,
        "tokens per cached block: a prompt's state is kept at every block boundary (default 128 on the CPU, 256 "
        "on a GPU)",
        type=int,
        metavar="N",
    )
    prefix_cache_gb: float | None = setting(
        None,
        "memory the prefix cache may hold, least recently used blocks evicted (default: a tenth of what the "
        "engine may use beside the weights, set aside before the cache's sequences are counted)",
        type=float,
        metavar="GB",
    )
    seed: int | None = setting(
        None,
        "default seeds: a sampled request without a seed takes the next of a sequence drawn from this, so a run "
        "repeats (default: fresh ones)",
        type=int,
    )
    # --- speculative decoding
    num_speculative_tokens: int | None = setting(
        None,
        f"draft tokens per round (default: {DEFAULT_K_WITH_HEAD} with an MTP head, 0 without; 0 = plain decoding)",
        aliases=("--spec-k",),
        type=int,
        metavar="K",
    )
    speculative_config: dict | None = setting(
        None,
        'vLLM\'s form of --spec-k: \'{"method": "mtp", "num_speculative_tokens": 3}\'',
        type=json_object,
        metavar="JSON",
    )
    p_min: float = setting(
        0.0, "stop a draft chain when the head's confidence in its pick falls below this", type=float
    )
    adaptive_k: bool = setting(False, "each round drafts what the last accepted + 1, up to K")
    k_policy: str = setting(
        "fixed",
        "auto: each step's K chosen for the batch's tokens/s, 0..K; fixed: every round at K",
        aliases=("--spec-k-policy",),
        choices=K_POLICIES,
    )
    hidden_after_norm: bool = setting(
        True,
        "feed the MTP head the trunk's hidden after the final norm (vLLM's, SGLang's, llama.cpp's); "
        "--hidden-before-norm: before it",
        negations=("--hidden-before-norm",),
    )
    grammar_draft_mask: bool = setting(
        True,
        "under structured outputs, draft from grammar-masked logits (--no-grammar-draft-mask: the head's own; "
        "the output is the same either way, the acceptance is not)",
    )
    draft_vocab: str | Path | DraftVocab | None = setting(
        None,
        "draft over this reduced vocabulary (a file from `nextn draft-vocab`; exactness is unchanged)",
        metavar="FILE",
    )
    draft_gate: str = setting(
        "skip",
        "head steps after every draft of a round was cut: skip them in the graph, or run and mask them",
        choices=DRAFT_GATES,
    )
    trace: bool = setting(
        False,
        "a record per round (K, drafts, accepted, draft / verify / commit wall time) in each output; rounds "
        "then run one at a time",
    )
    # the fields the caller gave, each as written (LLM's keyword, the flag on a command line: errors
    # name it so), and the defaults they are compared with where that matters (a command's own)
    given: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    defaults: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, **kwargs) -> EngineArgs:
        """LLM's keyword arguments (each given as its name)."""
        known = {f.name for f in cli_fields(cls)}
        if unknown := sorted(set(kwargs) - known):
            raise TypeError(f"unknown engine settings: {', '.join(unknown)} (nextn.config.EngineArgs lists them)")
        return cls(**kwargs, given={k: k for k in kwargs})

    @classmethod
    def from_cli(cls, args) -> EngineArgs:
        """The settings of parsed flags (nextn.config.flags.add_cli_args put them on the parser)."""
        given, settings = fields_given(args), values(args, cls)
        return cls(**settings, given={k: v for k, v in given.items() if k in settings}, defaults=command_defaults(args))

    def name(self, field: str) -> str:
        """A field as the user wrote it (its flag on a command line), else its name."""
        return self.given.get(field, field)

    def __post_init__(self):
        # checked here (EngineConfig checks it again) for its error to name the flag as given
        value = check_gpu_memory_utilization(self.gpu_memory_utilization, self.name("gpu_memory_utilization"))
        object.__setattr__(self, "gpu_memory_utilization", value)
        self._check_weights_source()
        self._check_generation_config()
        self._check_draft_settings()
        # everything else EngineConfig checks (quantization, K/V dtype, kernels, the numbers), on the
        # device: K and the context provisional (the checkpoint's head and limit are known once it is
        # read), a draft vocabulary file not yet read
        device = resolve_device(self.device)
        self.engine_config(self.model, device, resolve_dtype(self.dtype, device, None), None, None, None)

    @property
    def k(self) -> int | None:
        """K as given, by num_speculative_tokens or vLLM's speculative_config (None: the checkpoint's default)."""
        return speculative_tokens(self.num_speculative_tokens, self.speculative_config)

    def engine_config(self, model, device: str, dtype: str, k, draft_vocab, max_len: int | None) -> EngineConfig:
        """The engine's configuration: these settings on the resolved device and dtype, with K (None:
        DEFAULT_K_WITH_HEAD, while the checkpoint is not read), the loaded draft vocabulary (None while
        a file is not read: a stand-in checks the rest) and the context (None: the setting or the default)."""
        if draft_vocab is None and self.draft_vocab is not None:
            from nextn.spec.draft_vocab import DraftVocab

            draft_vocab = DraftVocab((0,)) if isinstance(self.draft_vocab, str | Path) else self.draft_vocab
        k = (DEFAULT_K_WITH_HEAD if self.k is None else self.k) if k is None else k
        spec = SpecConfig(
            num_speculative_tokens=k,
            p_min=self.p_min,
            adaptive=self.adaptive_k,
            hidden_after_norm=self.hidden_after_norm,
            draft_vocab=draft_vocab,
            grammar_draft_mask=self.grammar_draft_mask,
            draft_gate=self.draft_gate,
            k_policy=self.k_policy,
        )
        if max_len is None:
            max_len = DEFAULT_MAX_MODEL_LEN if self.max_model_len is None else self.max_model_len
        return EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            spec=spec,
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            kernels=self.kernels,
            prefill=self.prefill,
            max_num_batched_tokens=self.max_num_batched_tokens,
            quantization=self.quantization,
            tensor_parallel_size=self.tensor_parallel_size,
            trace=self.trace,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_block_size=self.prefix_block_size,
            prefix_cache_gb=self.prefix_cache_gb,
        )

    def _check_draft_settings(self) -> None:
        """A draft setting given (not its default) while K=0 is given would do nothing: an error, not
        silently ignored."""
        if self.k != 0:
            return
        base = {f.name: f.default for f in cli_fields(EngineArgs)} | self.defaults
        if given := [n for n in DRAFT_SETTINGS if n in self.given and getattr(self, n) != base[n]]:
            names = ", ".join(map(self.name, given))
            raise ValueError(f"{names} would do nothing: speculation is off (K=0), nothing is drafted")

    def _check_weights_source(self) -> None:
        """A checkpoint or a random-weight preset, not both; a preset known and given a tokenizer; a
        tokenizer directory that holds a tokenizer.json (before any download or weight)."""
        if self.random_weights is not None:
            from nextn.models.random_weights import preset_config

            if self.model is not None:
                raise ValueError(
                    f"random_weights={self.random_weights!r} replaces the checkpoint: give it or a model "
                    f"({self.model}), not both"
                )
            preset_config(self.random_weights)  # an unknown preset names the known ones
            if self.tokenizer is None:
                raise ValueError(
                    f"random_weights={self.random_weights!r} needs a tokenizer: a directory with tokenizer.json "
                    "(--tokenizer DIR; bench/qwen_tokenizer.py writes Qwen3.5's)"
                )
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {self.tokenizer}: no tokenizer.json there (give the directory that holds it)")

    def _check_generation_config(self) -> None:
        """vLLM's generation_config ("auto", "vllm" or a directory) and override_generation_config (a dict)."""
        from nextn.core import GENERATION_CONFIG_KEYS

        gc, override = self.generation_config, self.override_generation_config
        if not isinstance(gc, str | Path) or (
            gc not in ("auto", "vllm") and not (Path(gc) / "generation_config.json").is_file()
        ):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a directory holding a generation_config.json, got {gc!r}"
            )
        if override is not None and not isinstance(override, dict):
            raise ValueError(f"override_generation_config must be a dict, got {override!r}")
        unknown = sorted(set(override or {}) - {*GENERATION_CONFIG_KEYS, "do_sample"})
        if unknown:
            raise ValueError(
                f"override_generation_config keys {unknown} are not sampling defaults nextn reads "
                f"({', '.join(GENERATION_CONFIG_KEYS)})"
            )


def speculative_tokens(num_speculative_tokens: int | None, speculative_config: dict | None) -> int | None:
    """K from nextn's argument or vLLM's speculative_config (None: the default for the checkpoint)."""
    if speculative_config is None:
        return num_speculative_tokens
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict, got {speculative_config!r}")
    unknown = sorted(set(speculative_config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(
            f"speculative_config keys {unknown} are not supported: nextn takes 'method' and "
            "'num_speculative_tokens' (its own draft settings are LLM arguments: p_min, adaptive_k)"
        )
    method = speculative_config.get("method", "mtp")
    if method not in MTP_METHODS:
        raise ValueError(f"speculative_config method {method!r}: nextn drafts with the MTP head ({MTP_METHODS})")
    k = speculative_config.get("num_speculative_tokens")
    if k is not None and not isinstance(k, int):
        raise ValueError(f"speculative_config num_speculative_tokens must be an integer, got {k!r}")
    if num_speculative_tokens is not None and k is not None and k != num_speculative_tokens:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} and speculative_config's {k} disagree")
    return k if k is not None else num_speculative_tokens
