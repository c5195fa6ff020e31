"""What the API process knows of the model it serves: the tokenizer (and its chat template), the
facts the engine core resolved when it loaded the model (name, context, slots, vocabulary, spec K,
the checkpoint's sampling defaults), and the request checks made from them. Built from an `LLM` of
this process (the engine-thread mode) or from the core process's Ready message plus the
checkpoint's tokenizer files: the API process never loads weights or touches a device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from nextn.core import SamplingParams, with_defaults
from nextn.engine.core import ModelFacts, model_facts
from nextn.engine.llm import LLM, check_params, check_prompt
from nextn.tokenizer import Tokenizer, load_tokenizer


@dataclass
class ServedModel:
    tokenizer: Tokenizer
    facts: ModelFacts

    @classmethod
    def of_llm(cls, llm: LLM) -> ServedModel:
        return cls(llm.tokenizer, model_facts(llm))  # the LLM's own tokenizer: one object for both

    @classmethod
    def load(cls, facts: ModelFacts) -> ServedModel:
        return cls(load_tokenizer(facts.model_dir), facts)

    def with_chat_template(self, template: str) -> ServedModel:
        """This model with `template` rendering its chats (`--chat-template`; the engine's tokenizer keeps its own)."""
        tok = copy.copy(self.tokenizer)
        tok.chat_template = template
        return replace(self, tokenizer=tok)

    @property
    def model_name(self) -> str:
        return self.facts.model_name

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.facts.max_num_seqs

    @property
    def num_speculative_tokens(self) -> int:
        return self.facts.num_speculative_tokens

    def default_sampling_params(self, **request) -> SamplingParams:
        """A request's own values (None = not given) over the checkpoint's defaults over ours (LLM's)."""
        return with_defaults(self.facts.sampling_defaults, **request)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.facts.vocab_size, self.facts.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        check_params(params, self.facts.vocab_size)
