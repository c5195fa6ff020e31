"""Pure data shared by the engine, the CLI and the server: sampling settings (and the defaults a
checkpoint's generation_config.json recommends), outputs, spec stats.

Nothing here touches tensors or devices.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields

MAX_TRACKED_POSITIONS = 8  # per-position spec counters kept for draft positions 0..7
# the grammar forms of SamplingParams.structured_outputs (vLLM's names), compiled by nextn.grammar
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# SamplingParams' numbers by type: an int field takes an int, a float field an int or a float (a
# bool or a str is neither); None means off for the optional ones
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
OPTIONAL_FIELDS = ("seed", "logprobs", "prompt_logprobs")
# a seed is a signed 64-bit integer: its two's complement is the Philox key (nextn.sample.pipeline.RequestRng)
SEED_RANGE = (-(2**63), 2**63 - 1)
# the least temperature above 0 (greedy) and repetition_penalty's range: a logit is divided by
# both (by the penalty where positive, multiplied by it where negative); past them the result
# overflows float32 (the sampler's dtype), even together, for logits up to 1e8, and the draws come
# out of NaN or infinite probabilities: token 0 or stray ids, silently
MIN_TEMPERATURE = 1e-15
REPETITION_PENALTY_RANGE = (1e-15, 1e15)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's form of SamplingParams.structured_outputs: one of json (a schema, or its text), regex,
    choice, grammar (Lark or GBNF) or json_object=True; `SamplingParams` keeps it as the one-key
    dict nextn.grammar compiles. disable_any_whitespace and disable_fallback ask for what nextn
    does anyway (JSON without free whitespace, no other backend), so True is taken."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    def as_dict(self) -> dict:
        given = {k: getattr(self, k) for k in STRUCTURED_OUTPUT_KEYS if getattr(self, k) not in (None, False)}
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {STRUCTURED_OUTPUT_KEYS}, got {sorted(given)}")
        return given


@dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log probability, its rank in the distribution (1: the most probable) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def checked_number(name: str, value, integer: bool, optional: bool = False):
    """value as Python's int (integer) or float, numpy's numbers included; a bool, a str or a float
    where an integer is due is a ValueError naming the field (it would fail deep in the engine, or
    True would silently mean 1). None passes when optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")
    return int(value) if integer else float(value)


class RequestError(ValueError):
    """A request the engine refuses (the engine stays usable)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy."""

    max_tokens: int = 256
    min_tokens: int = 0  # EOS and stop tokens are not taken before this many tokens
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # number of top logprobs to return per token (None = off)
    prompt_logprobs: int | None = None  # the same for every prompt token (prefills cold: no session reuse)
    stop: tuple[str, ...] = ()  # stop strings: the output text ends before the first one
    include_stop_str_in_output: bool = False  # ... or with it (vLLM's)
    # a grammar the output must match, one of STRUCTURED_OUTPUT_KEYS: {"json": schema (dict or str)},
    # {"regex": r}, {"choice": [str, ...]}, {"grammar": Lark or GBNF}, {"json_object": True}
    structured_outputs: dict | None = None

    def __post_init__(self):
        self._check_types()
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN too
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a signed 64-bit integer, in [-2**63, 2**63 - 1], got {self.seed}")
        if any(n is not None and n < 0 for n in (self.logprobs, self.prompt_logprobs)):
            raise ValueError("logprobs and prompt_logprobs must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))  # numpy's as Python's
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            object.__setattr__(self, "structured_outputs", self.structured_outputs.as_dict())
        so = self.structured_outputs
        if so is not None and not (isinstance(so, dict) and len(so) == 1 and next(iter(so)) in STRUCTURED_OUTPUT_KEYS):
            raise ValueError(f"structured_outputs must hold exactly one of {STRUCTURED_OUTPUT_KEYS}, got {so!r}")

    def _check_types(self) -> None:
        """Every number of its type (a float max_tokens would fail deep in the engine, a str
        temperature in a comparison); `stop` and `stop_token_ids` as tuples, a str one stop string
        (as in vLLM), not a set of one-character ones."""
        for name in INT_FIELDS + FLOAT_FIELDS:
            value = checked_number(name, getattr(self, name), name in INT_FIELDS, name in OPTIONAL_FIELDS)
            object.__setattr__(self, name, value)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        for name, value, kind in (
            ("stop", stop, "a str or a list of str"),
            ("stop_token_ids", self.stop_token_ids, "a list of token ids"),
        ):
            value = () if value is None else value  # None: none (as vLLM takes it)
            if not isinstance(value, list | tuple):
                raise ValueError(f"{name} must be {kind}, got {value!r}")
            object.__setattr__(self, name, tuple(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# generation_config.json key -> SamplingParams field: the keys vLLM reads as a model's defaults
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def vllm_logprobs(entries: list[dict], decode) -> list[dict[int, Logprob]]:
    """nextn's logprob entries ({"token_id", "logprob", "rank", "top_logprobs": [(id, logprob), ...]})
    as vLLM's: per token a dict of its id and the top ids -> Logprob; `decode` gives a token's text."""
    out = []
    for e in entries:
        d = {tid: Logprob(lp, rank, decode(tid)) for rank, (tid, lp) in enumerate(e["top_logprobs"], start=1)}
        d.setdefault(e["token_id"], Logprob(e["logprob"], e.get("rank"), decode(e["token_id"])))
        out.append(d)
    return out


def sampling_defaults(generation_config: dict | None) -> dict:
    """The SamplingParams fields a checkpoint's generation_config.json recommends (its publisher's
    temperature, top_p, top_k, ...). `do_sample: false` means greedy, as in transformers; a top_k of
    0 or below means off, as 0 does here."""
    gen = generation_config or {}
    defaults = {name: gen[key] for key, name in GENERATION_CONFIG_KEYS.items() if gen.get(key) is not None}
    if gen.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if defaults.get("top_k", 0) < 0:
        defaults["top_k"] = 0
    SamplingParams(**defaults)  # a bad value fails here, where the caller can name the file
    return defaults


def with_defaults(defaults: dict, **request) -> SamplingParams:
    """SamplingParams from a request's own values (None = not given) over `defaults` over ours."""
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(request) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {unknown}")
    return SamplingParams(**{**defaults, **{k: v for k, v in request.items() if v is not None}})


@dataclass
class SpecStats:
    """Draft/accept counters of one request (or an aggregate of many). Drafts a confidence gate
    cut are counted in neither drafted nor accepted; a round cut short by max_tokens or a stop
    counts the tokens it emitted (nextn.engine.rounds), so 1 + rounds + accepted is the output's length."""

    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_zero_draft_rounds: int = 0  # rounds that verified the pending token alone
    drafted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_TRACKED_POSITIONS)
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_TRACKED_POSITIONS)
    # rounds by drafts accepted, 0..MAX_TRACKED_POSITIONS (more counts in the last)
    accept_length_histogram: list[int] = field(default_factory=lambda: [0] * (MAX_TRACKED_POSITIONS + 1))

    def record_round(self, num_drafted: int, num_accepted: int, zero_draft: bool | None = None) -> None:
        """zero_draft: the round verified the pending token alone (default: num_drafted == 0; a
        round cut to its first token counts no drafts, though it verified some)."""
        self.num_rounds += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_zero_draft_rounds += (num_drafted == 0) if zero_draft is None else zero_draft
        self.accept_length_histogram[min(num_accepted, MAX_TRACKED_POSITIONS)] += 1
        for j in range(min(num_drafted, MAX_TRACKED_POSITIONS)):
            self.drafted_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    def record_emitted(self, drafted: int, accepted: int, zero_draft: bool, emitted: int) -> tuple[int, int] | None:
        """Count a verify round by the `emitted` of its accepted + 1 tokens a user gets: one cut short
        (max_tokens, a stop token or string came first) counts emitted - 1 accepted of
        min(drafted, emitted - 1) drafted; one that emitted none is not counted (None). Returns the
        (drafted, accepted) counted."""
        if emitted == 0:
            return None
        if emitted < accepted + 1:
            drafted, accepted = min(drafted, emitted - 1), emitted - 1
        self.record_round(drafted, accepted, zero_draft)
        return drafted, accepted

    def merge(self, other: SpecStats) -> None:
        """Fieldwise self += other (an aggregate of requests)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, [x + y for x, y in zip(a, b, strict=True)] if isinstance(a, list) else a + b)

    def delta_since(self, prev: SpecStats) -> SpecStats:
        """Fieldwise self - prev: what was counted since the snapshot prev. Saturating: a snapshot
        that is not an earlier state of these counters gives zeros, never negative counts."""
        d = SpecStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(prev, f.name)
            setattr(
                d, f.name, [max(0, x - y) for x, y in zip(a, b, strict=True)] if isinstance(a, list) else max(0, a - b)
            )
        return d

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify round: 1 (bonus) + accepted drafts."""
        return 1.0 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM's `RequestOutput.outputs[i]`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, Logprob]] | None = None  # vLLM's: per token, its id and the top ids -> Logprob
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # the sum of the chosen tokens' logprobs (with logprobs asked)


@dataclass
class RequestOutput:
    """The result of one generate call. vLLM's shape is there too: `.outputs[0].text`,
    `.outputs[0].token_ids`, `.prompt`, `.prompt_token_ids`."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from a kept session state or the prefix cache
    spec: SpecStats
    prefill_seconds: float
    decode_seconds: float
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None  # one per prompt token; the first is None
    prompt: str | None = None  # the prompt text, when it was given as text
    prompt_token_ids: list[int] | None = None
    rounds: list | None = None  # with EngineConfig.trace: a RoundTrace per verify round (nextn.engine.rounds)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS, length)
    # `logprobs` as vLLM's Logprob objects (LLM fills it in, with each token's text): outputs[0].logprobs
    sample_logprobs: list[dict[int, Logprob]] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        cumulative = sum(e["logprob"] for e in self.logprobs) if self.logprobs is not None else None
        return [
            CompletionOutput(
                0, self.text, self.token_ids, self.finish_reason, self.sample_logprobs, self.stop_reason, cumulative
            )
        ]

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name of cached_tokens."""
        return self.cached_tokens

    @property
    def num_drafted(self) -> int:
        return self.spec.num_drafted

    @property
    def num_accepted(self) -> int:
        return self.spec.num_accepted

    @property
    def prefill_tokens_per_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0
