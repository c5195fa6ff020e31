"""Engine outputs -> OpenAI response objects: usage with spec stats, logprobs in the chat and the
completions shapes, full responses and SSE chunks. Does not know HTTP routing or the queue.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from nextn.core import RequestOutput, SpecStats
from nextn.server import protocol as P
from nextn.server import response_models as R
from nextn.tokenizer import Tokenizer

# nextn/vLLM extras left out of a response when unset, so plain OpenAI payloads stay plain
_OPTIONAL_EXTRAS = {
    *("token_ids", "prompt_token_ids", "prompt_logprobs", "spec_decode", "prompt_tokens_details", "bytes"),
    *("reasoning_content", "tool_calls", "stop_reason"),
}


def to_json(model: BaseModel) -> str:
    return json.dumps(_drop_unset_extras(model.model_dump()), ensure_ascii=False)


def sse(model: BaseModel) -> str:
    return f"data: {to_json(model)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _drop_unset_extras(obj, in_delta: bool = False):
    if isinstance(obj, dict):  # a chunk's delta carries only what it sets, as OpenAI's do
        return {
            k: _drop_unset_extras(v, k == "delta")
            for k, v in obj.items()
            if not (v is None and (in_delta or k in _OPTIONAL_EXTRAS))
        }
    if isinstance(obj, list):
        return [_drop_unset_extras(v) for v in obj]
    return obj


# pydantic's loc entries that name a member of a union type, not a field ("str", "list[int]", ...)
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list|dict)|[\w-]+\[.*\]")


def validation_error(err: dict) -> tuple[str, str]:
    """(the request field a pydantic error is about, as "messages[0].content"; its message). A body
    that is no JSON, or none, is about no field."""
    if err["type"] == "json_invalid":  # FastAPI's: loc ends at the character offset of the error
        what = str((err.get("ctx") or {}).get("error")).removesuffix(" at")  # "Unterminated string starting at"
        return "", f"the body is not valid JSON: {what} at character {err['loc'][-1]}"
    if err["type"] == "missing" and tuple(err["loc"]) == ("body",):
        return "", "the request body is empty"
    if err["type"] == "model_attributes_type" and tuple(err["loc"]) == ("body",):
        if isinstance(err.get("input"), bytes):  # FastAPI parses a body as JSON only under a JSON Content-Type
            return "", "the body was not read as JSON: send it with the header Content-Type: application/json"
        return "", "the body must be a JSON object"
    loc = _path([x for x in err["loc"] if x != "body" and not (isinstance(x, str) and _UNION_MEMBER.fullmatch(x))])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, P.FieldError):
        return (f"{loc}.{cause.param}" if loc else cause.param), cause.message
    return loc, err["msg"]


def _path(loc: list) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).removeprefix(".")


def spec_usage(stats: SpecStats, num_speculative_tokens: int) -> R.SpecDecodeUsage | None:
    if num_speculative_tokens == 0:
        return None
    k = min(num_speculative_tokens, len(stats.drafted_per_position))
    return R.SpecDecodeUsage(
        num_drafts=stats.drafted_per_position[0],
        num_draft_tokens=stats.num_drafted,
        num_accepted_tokens=stats.num_accepted,
        num_rounds=stats.num_rounds,
        num_zero_draft_rounds=stats.num_zero_draft_rounds,
        drafted_per_position=stats.drafted_per_position[:k],
        accepted_per_position=stats.accepted_per_position[:k],
        accept_length_histogram=stats.accept_length_histogram[: k + 1],
        acceptance_rate=stats.acceptance_rate,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


def usage(
    outputs: list[RequestOutput], num_speculative_tokens: int, prompts: list[RequestOutput] | None = None
) -> R.Usage:
    """Every output's tokens and spec counts; the prompt tokens of `prompts` (default all): one
    output per prompt when several are choices of one prompt (vLLM counts each prompt once)."""
    stats = SpecStats()
    for out in outputs:
        stats.merge(out.spec)
    prompts = outputs if prompts is None else prompts
    prompt = sum(o.prompt_tokens for o in prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    return R.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=R.PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in prompts)),
        spec_decode=spec_usage(stats, num_speculative_tokens),
    )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen's too): vocabulary character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


class LogprobFormatter:
    """Token logprob entries ({"token_id", "logprob", "top_logprobs": [(id, lp)]}) as OpenAI JSON."""

    _alphabet = BYTE_LEVEL_ALPHABET

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a lone token may be part of a UTF-8 character its text cannot show)."""
        piece = self.tokenizer.id_to_token(token_id) or ""
        if all(c in self._alphabet for c in piece):
            return [self._alphabet[c] for c in piece]
        return list(self.token(token_id).encode("utf-8"))

    def chat(self, entries: list[dict]) -> R.ChoiceLogprobs:
        def top(tid: int, lp: float) -> R.TopLogprob:
            return R.TopLogprob(token=self.token(tid), logprob=lp, bytes=self.token_bytes(tid))

        content = [
            R.TokenLogprob(
                **top(e["token_id"], e["logprob"]).model_dump(),
                top_logprobs=[top(t, lp) for t, lp in e["top_logprobs"]],
            )
            for e in entries
        ]
        return R.ChoiceLogprobs(content=content)

    def prompt(self, entries: list[dict | None], n: int) -> list[dict[int, R.PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per prompt token, {token id: entry} for the token and the top `n`."""
        out: list[dict[int, R.PromptLogprob] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            tops = e["top_logprobs"][:n]
            ranked = {
                tid: R.PromptLogprob(logprob=lp, rank=r, decoded_token=self.token(tid))
                for r, (tid, lp) in enumerate(tops, 1)
            }
            chosen = e["token_id"]
            if chosen not in ranked:
                ranked = {chosen: R.PromptLogprob(logprob=e["logprob"], decoded_token=self.token(chosen)), **ranked}
            out.append(ranked)
        return out

    def completion(
        self, entries: list[dict | None], token_ids: list[int], offset: int, n: int | None = None
    ) -> R.CompletionLogprobs:
        """`entries[i]` is token_ids[i]'s (None for a first prompt token); offsets start at `offset`;
        at most `n` top entries each (all given when None)."""
        out = R.CompletionLogprobs()
        for tid, e in zip(token_ids, entries, strict=True):
            s = self.token(tid)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e["logprob"])
            tops: dict[str, float] = {}
            for t, lp in e["top_logprobs"][:n]:  # most likely first: tokens sharing a text keep the best
                tops.setdefault(self.token(t), lp)
            tops.setdefault(s, e["logprob"])  # the chosen token is always listed (vLLM does the same)
            out.top_logprobs.append(tops)
        return out


def merge_completion_logprobs(a: R.CompletionLogprobs, b: R.CompletionLogprobs) -> R.CompletionLogprobs:
    return R.CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )
