"""Stop strings: cut generated text at the first stop string, and while streaming hold back only
the tail that could still grow into one (so no client ever sees part of a stop string).

Pure string work; does not know tokens (LLM._stream maps the cut back to the tokens it covers).
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...], keep: bool = False):
        self.stops = tuple(stops)
        self.keep = keep  # the text ends with the stop string (vLLM's include_stop_str_in_output)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text so far; after a hit, the text up to the stop string (through it: keep)
        self.released = 0  # characters of `text` already handed out
        self.hit: int | None = None  # end of the stop string in the uncut text, once found
        self.matched: str | None = None  # that stop string

    def push(self, delta: str, floor: float = -1) -> str:
        """Add a text delta; return what may be released now. Sets `hit` when a stop string appears
        ending past `floor` characters (min_tokens: none before it counts)."""
        if self.hit is not None:
            return ""
        # a stop string may straddle the old end of the text, so look back max_len - 1 characters
        start = max(0, len(self.text) - self.max_len + 1)
        self.text += delta
        found = []
        for s in self.stops:
            i = self.text.find(s, start)
            while i >= 0 and i + len(s) <= floor:
                i = self.text.find(s, i + 1)
            if i >= 0:
                found.append((i, i + len(s), s))
        if found:
            cut, self.hit, self.matched = min(found)
            self.text = self.text[: self.hit if self.keep else cut]
            return self.flush()
        end = max(self.released, len(self.text) - self._held_back())
        out, self.released = self.text[self.released : end], end
        return out

    def flush(self) -> str:
        out, self.released = self.text[self.released :], len(self.text)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.max_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
