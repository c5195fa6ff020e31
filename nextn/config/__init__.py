"""Configuration, one package. Here: the engine's frozen settings as it runs them (EngineConfig,
SpecConfig), their constants and checks, and device / dtype "auto" resolved. Beside it:
engine_args (EngineArgs: the settings as a user gives them, LLM's keyword arguments and the flags,
checked once and turned into an EngineConfig), serve (ServeConfig, ServerOptions: `nextn serve`'s
own), model (ModelConfig: the checkpoint's hyperparameters), flags (the parsers generated from the
dataclasses) and reference (docs/flags.md).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nextn.core import checked_number

if TYPE_CHECKING:
    from nextn.spec.draft_vocab import DraftVocab

# layer_types values of a hybrid model (nextn.config.model.ModelConfig)
LINEAR = "linear_attention"
FULL = "full_attention"

# Rows of one decode / verify step: the pending token and up to STEP_ROWS - 1 drafts. Every step
# computes its rows at this fixed shape, so a row's arithmetic never depends on the row count.
STEP_ROWS = 16
# rows of the chunked delta rule's chunks (nextn.ops.gdn, nextn.ops.triton_gdn_chunk), from a piece's
# first row: a "chunked" prefill cuts prompts at whole chunks, where the cut leaves the bits as they are
GDN_CHUNK = 64
PREFILL_CHUNK = 2048  # at most this many tokens per chunked prefill forward: bounds attention score memory
# rows of a prefill step's attention per launch (its float32 partials grow with rows x the context's chunks)
ATTENTION_ROWS = 512
# positions per step-attention partial (nextn.ops.triton_attention): absolute chunk boundaries, so fixed
ATTENTION_CHUNK = 128
# the context a sequence gets unless max_model_len says otherwise (the checkpoint's own, if shorter)
DEFAULT_MAX_MODEL_LEN = 8192
KERNELS = ("auto", "torch", "triton")
PREFILL_MODES = ("chunked", "steps")
DRAFT_GATES = ("skip", "mask")
# the K of each round: "auto" the batch K policy (nextn.spec.k_policy) under the cap, "fixed" the cap
K_POLICIES = ("auto", "fixed")
# max_num_seqs unless given: on a GPU what fits gpu_memory_utilization of its memory, up to this many
# (nextn.engine.memory); on the CPU, which has no GPU memory to size, CPU_MAX_NUM_SEQS
MAX_NUM_SEQS = 256
# cache slots beside the requests' that no request ever holds: a mixed round's pad piece runs there
# (nextn.engine.rounds._pad_piece), so ragged prompts' mixed rounds share graphs when every request slot is
# taken (a full pool, or kept sessions in the free ones); its bytes are counted where the slots are sized
SCRATCH_SLOTS = 1
CPU_MAX_NUM_SEQS = 8
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# what `quantization=` makes of a checkpoint's bf16 weights at load
QUANTIZATIONS = ("fp8", "q8_0")  # nextn.ops.fp8.FORMATS
# the attention layers' K/V cache: "auto" the model dtype, "fp8" e4m3 rows with float32 scales
KV_CACHE_DTYPES = ("auto", "fp8")
# the prefix cache (nextn.cache.prefix): a prompt's state is kept at every block boundary, and a
# prefill step must end there, so a prompt new to the cache prefills in pieces of at most a block:
# smaller blocks serve more of a shared prefix (a hit recomputes less than a block) and cost more
# steps. CPU, the bundled model, a 1,536-token prompt prefilled whole in 1.74-1.84 s: in pieces of
# 256 1.65-1.67 s, of 128 1.81-1.83 s, of 64 2.05-2.12 s, of 32 2.45-2.54 s; so 128. On a GPU a
# step of fewer rows than a few hundred is bound by reading the weights (a 9B model's 16 GB per
# step), so 256 (to be measured there: `nextn bench serve --prefix-len`, `--prefix-block-size`)
PREFIX_BLOCK_SIZE = {"cpu": 128, "cuda": 256}
# what the prefix cache may hold unless prefix_cache_gb says: this share of the memory the engine
# may take once the weights are in (nextn.engine.memory), set aside before the slots are sized
PREFIX_CACHE_SHARE = 0.1


def check_quantization(quantization: str | None) -> None:
    """The `quantization=` setting (what to make of bf16 weights at load): None or one of QUANTIZATIONS."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r} is not supported; nextn quantizes at load to {' or '.join(QUANTIZATIONS)} "
            "(and loads FP8 checkpoints as they are)"
        )


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """The `kv_cache_dtype=` setting: one of KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def check_gpu_memory_utilization(value, name: str = "gpu_memory_utilization") -> float:
    """The fraction of the GPU's total memory nextn may use (weights, cache, activations, graphs),
    vLLM's: a number in (0, 1]. `name`: what the error calls it (the CLI's flag)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1] (a fraction of the GPU's memory), got {value}")
    return float(value)


def check_kernels(kernels: str, device: str) -> None:
    """The `kernels=` setting on this (resolved) device: one of KERNELS; "triton" needs CUDA (or
    Triton's CPU interpreter, which tests turn on)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "triton" and not device.startswith("cuda"):
        from nextn.ops.triton_utils import interpreting

        if not interpreting():
            raise ValueError(
                f"kernels='triton' needs a CUDA device (or Triton's interpreter, for CPU tests), got device {device!r}"
            )


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_device(device: str) -> str:
    """Device "auto": cuda when torch sees a GPU, else cpu. Anything but auto, cpu or cuda[:N] is an
    error, and so is a CUDA device torch cannot use, saying why (a CPU-only build of torch, no
    visible GPU, an index past the GPU count)."""
    import torch

    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.backends.cuda.is_built():
            raise ValueError(
                f"device {device!r}: this torch ({torch.__version__}) is a CPU-only build; "
                "install a CUDA build of torch, or use device cpu"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?)")
        index = device.partition(":")[2]
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> str:
    """Dtype "auto": float32 on the CPU (its bfloat16 matmuls are slow and inexact), the checkpoint's own
    dtype on CUDA (bfloat16 when it names none nextn runs: released Qwen3.5 checkpoints are bf16).
    Any other name than auto or one of DTYPE_NAMES is an error."""
    if dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {('auto', *DTYPE_NAMES)}, got {dtype!r}")
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in DTYPE_NAMES else "bfloat16"


def _check_ints(config, *names: str) -> None:
    """The named fields of a frozen config as Python ints (nextn.core.checked_number; None stays)."""
    for name in names:
        value = getattr(config, name)
        if value is not None:
            object.__setattr__(config, name, checked_number(name, value, integer=True))


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. num_speculative_tokens 0 means plain decoding."""

    num_speculative_tokens: int = 0
    # stop a draft chain when the head's probability of its own pick falls below this
    p_min: float = 0.0
    # adaptive K: the next round drafts what the last accepted + 1, between a floor and a cap
    # (nextn.spec.adaptive)
    adaptive: bool = False
    # feed the MTP head the trunk's hidden after the final norm (vLLM/SGLang/llama.cpp
    # convention for released Qwen heads) or before it (the reference design's)
    hidden_after_norm: bool = True
    # the MTP head drafts over these target ids only (FR-Spec; nextn.spec.draft_vocab); None: all
    draft_vocab: DraftVocab | None = None
    # under structured outputs, the head drafts from grammar-masked logits (legal drafts by
    # construction; one host read per draft step); off: only the verify is masked
    grammar_draft_mask: bool = True
    # head steps after every draft of a round was cut: "skip" them (their kernels read a device
    # flag and return: ModelRunner.when) or "mask" (run them, discard their drafts); the same output either way
    draft_gate: str = "skip"
    # each step's K: "fixed", every round at the cap (the Python API's default), or "auto" (`serve`'s
    # and `generate`'s), chosen per batch for the most tokens/s, 0..num_speculative_tokens (the cap;
    # nextn.spec.k_policy says which requests follow it). adaptive works under it: a request drafts
    # min(its adaptive K, the step's K)
    k_policy: str = "fixed"

    def __post_init__(self):
        _check_ints(self, "num_speculative_tokens")
        object.__setattr__(self, "p_min", checked_number("p_min", self.p_min, integer=False))
        # a verify step holds the pending token and the drafts in STEP_ROWS rows
        if not 0 <= self.num_speculative_tokens < STEP_ROWS:
            raise ValueError(f"num_speculative_tokens must be in 0..{STEP_ROWS - 1}, got {self.num_speculative_tokens}")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min}")
        if self.draft_gate not in DRAFT_GATES:
            raise ValueError(f"draft_gate must be one of {DRAFT_GATES}, got {self.draft_gate!r}")
        if self.k_policy not in K_POLICIES:
            raise ValueError(f"k_policy must be one of {K_POLICIES}, got {self.k_policy!r}")
        # draft controls with nothing drafted would be silently ignored (the CLI refuses its flags the same way)
        ignored = [name for name, on in (("p_min", self.p_min > 0.0), ("adaptive_k", self.adaptive)) if on]
        if ignored and self.num_speculative_tokens == 0:
            raise ValueError(
                f"{' and '.join(ignored)} would do nothing: speculation is off (num_speculative_tokens=0), "
                "nothing is drafted"
            )
        if self.draft_vocab is not None:
            from nextn.spec.draft_vocab import DraftVocab

            if not isinstance(self.draft_vocab, DraftVocab):
                raise ValueError(f"draft_vocab must be a DraftVocab (load_draft_vocab), got {self.draft_vocab!r}")
            if self.num_speculative_tokens == 0:
                raise ValueError("a draft vocabulary needs speculative decoding (num_speculative_tokens > 0)")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, validated once here and passed down as they are."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # cache slots, allocated up front: requests running at once plus conversations kept between turns
    # (None: on a GPU what fits gpu_memory_utilization, up to MAX_NUM_SEQS, resolved once the model
    # is loaded (nextn.engine.memory.fit_cache: the engine's config holds the count); on the CPU 8)
    max_num_seqs: int | None = None
    # step path: "torch" (the reference modules), "triton" (the fused step in CUDA graphs) or "auto":
    # triton on CUDA, torch on the CPU (stored resolved)
    kernels: str = "auto"
    # prompt prefill: "chunked" (fast) or "steps" (the decode step's arithmetic: resumed == cold bitwise)
    prefill: str = "chunked"
    # tokens one engine step computes: the running requests' round rows, then prompt tokens of
    # requests being prefilled (a long prompt is prefilled over several steps while streams run);
    # None: PREFILL_CHUNK plus every slot's round rows, so prompts prefill in whole PREFILL_CHUNKs
    max_num_batched_tokens: int | None = None
    # "fp8" / "q8_0": the checkpoint's bf16 weights quantized at load (an FP8 checkpoint loads as it is either way)
    quantization: str | None = None
    # ranks the model is sharded over (nextn.parallel: one process per rank, cuda:<rank> on CUDA);
    # `device` is this rank's
    tensor_parallel_size: int = 1
    # per-round records (K, drafts, accepted, draft / verify / commit wall time) in each output;
    # rounds then run one at a time (none queued ahead)
    trace: bool = False
    # the full-attention layers' K/V: "auto" (the model dtype) or "fp8" (e4m3 rows with float32
    # scales, half the bytes in bf16; the MTP head's draft K/V stay in the model dtype)
    kv_cache_dtype: str = "auto"
    # the fraction of the GPU's total memory nextn may use: weights, cache, activations and graphs
    # (vLLM's); sizes max_num_seqs when that is None and bounds it when given. The CPU has no GPU
    # memory to size: there max_num_seqs defaults to CPU_MAX_NUM_SEQS and this does not apply
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # no CUDA graphs: every round runs eagerly (vLLM's enforce_eager; the output is the same)
    enforce_eager: bool = False
    # the seed of the engine's default seeds (vLLM's LLM(seed=) / `--seed`): a sampled request without a seed of its
    # own takes the next of a sequence drawn from it, so the same requests in the same order give the same outputs.
    # None: such a request draws a fresh seed
    seed: int | None = None
    # automatic prefix caching (nextn.cache.prefix; vLLM's enable_prefix_caching): None, on where it
    # is exact (prefill "steps": a row's bits do not depend on where a prefill step ends; the
    # chunked kernels' do, so a cached prefix would change what a request emits); stored resolved
    enable_prefix_caching: bool | None = None
    # tokens per cached block (None: PREFIX_BLOCK_SIZE of the device; stays None with the cache off)
    # and the bytes the cache may hold (None: PREFIX_CACHE_SHARE of the engine's memory budget)
    prefix_block_size: int | None = None
    prefix_cache_gb: float | None = None

    def __post_init__(self):
        _check_ints(self, "max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "seed")
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "gpu_memory_utilization", check_gpu_memory_utilization(self.gpu_memory_utilization))
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.spec.draft_vocab is not None:
            raise ValueError("a draft vocabulary does not run under tensor parallelism yet")
        check_kernels(self.kernels, self.device)
        if self.kernels == "auto":
            object.__setattr__(self, "kernels", "triton" if self.device.startswith("cuda") else "torch")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs is None and not self.device.startswith("cuda"):
            object.__setattr__(self, "max_num_seqs", CPU_MAX_NUM_SEQS)
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # derived from the slot count once it is known (on a GPU: after fit_cache resolves it)
        if self.max_num_batched_tokens is None and self.max_num_seqs is not None:
            object.__setattr__(self, "max_num_batched_tokens", PREFILL_CHUNK + self.max_num_seqs * STEP_ROWS)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < STEP_ROWS:
            raise ValueError(f"max_num_batched_tokens must be >= {STEP_ROWS}, got {self.max_num_batched_tokens}")
        self._check_prefix_caching()

    def _check_prefix_caching(self) -> None:
        """enable_prefix_caching resolved (None: on under prefill "steps"), its settings checked;
        on under "chunked", or a setting of a cache that is off, is an error."""
        _check_ints(self, "prefix_block_size")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True, False or None, got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", self.prefill == "steps")
        if self.enable_prefix_caching and self.prefill != "steps":
            raise ValueError(
                "prefix caching needs prefill='steps' (--prefill steps): the chunked prefill's arithmetic depends "
                "on where a prompt is cut, so a cached prefix would change what a request emits"
            )
        given = [n for n in ("prefix_block_size", "prefix_cache_gb") if getattr(self, n) is not None]
        if given and not self.enable_prefix_caching:
            raise ValueError(f"{' and '.join(given)} would do nothing: prefix caching is off")
        if self.prefix_block_size is None and self.enable_prefix_caching:
            object.__setattr__(self, "prefix_block_size", PREFIX_BLOCK_SIZE["cuda" if self.device != "cpu" else "cpu"])
        if self.prefix_block_size is not None and self.prefix_block_size < 1:
            raise ValueError(f"prefix_block_size must be >= 1, got {self.prefix_block_size}")
        if self.prefix_cache_gb is not None:
            gb = checked_number("prefix_cache_gb", self.prefix_cache_gb, integer=False)
            if gb < 0:
                raise ValueError(f"prefix_cache_gb must be >= 0, got {gb}")
            object.__setattr__(self, "prefix_cache_gb", float(gb))

    @property
    def prefill_chunk(self) -> int:
        """Tokens per piece of a prompt prefilled outside the engine's steps (ModelRunner.extend): what
        the budget leaves when every slot's round (up to STEP_ROWS rows each) runs beside it, at most
        PREFILL_CHUNK, in whole GDN_CHUNKs (where a "chunked" prefill may cut a prompt)."""
        room = self.max_num_batched_tokens - self.max_num_seqs * STEP_ROWS
        return max(STEP_ROWS, min(PREFILL_CHUNK, room) // GDN_CHUNK * GDN_CHUNK)


# the checkpoint bundled with the package: the default model of every command
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
