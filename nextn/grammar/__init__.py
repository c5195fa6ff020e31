"""Grammar constraints (the constraint adapter: token masks, rollback), built on llguidance.

Owns: turning a request's `structured_outputs` ({"json": schema} | {"regex": r} | {"choice": [...]}
| {"grammar": lark or GBNF} | {"json_object": True}) into a compiled llguidance grammar, with a
ValueError naming what is wrong (`compile_grammar`, also the server's validation); and one
sequence's matcher on the host, advanced over the tokens a round emits and rolled back over the
drafts it rejected, which writes the token masks of a round's rows into the slot's device buffer
(`GrammarState`, nextn.grammar.state).

Does not know models, rounds or sampling: the engine's sampler applies the masks to the logits
before its own transforms (nextn.sample.sampler), the rounds decide when they are computed
(nextn.engine.rounds).
"""

from nextn.grammar import limits
from nextn.grammar.build import choice_terminal, json_schema
from nextn.grammar.compile import STRUCTURED_OUTPUT_KEYS, CompiledGrammar, compile_grammar
from nextn.grammar.state import GrammarState

__all__ = [
    "STRUCTURED_OUTPUT_KEYS",
    "CompiledGrammar",
    "GrammarState",
    "choice_terminal",
    "compile_grammar",
    "json_schema",
    "limits",
]
