"""The bundled tokenizer: incremental decoding equals whole decoding; the chat template renders."""

from __future__ import annotations

import random

from nextn.config import DEFAULT_MODEL_DIR
from nextn.tokenizer import IncrementalDecoder, Tokenizer


def test_incremental_deltas_concatenate_to_the_full_text():
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    rng = random.Random(0)
    texts = ["def f(x):\n    return x  # ünïcødé ✓ 漢字 🙂\n", "a" * 50 + " ∑∫ end"]
    for text in texts:
        ids = tok.encode(text)
        for _ in range(5):
            dec, out, i = IncrementalDecoder(tok), [], 0
            while i < len(ids):
                n = rng.randint(1, 4)
                out.append(dec.push(ids[i : i + n]))
                i += n
            assert "".join(out) == tok.decode(ids) == text
    random_ids = [rng.randrange(tok.vocab_size) for _ in range(300)]  # arbitrary byte sequences
    dec = IncrementalDecoder(tok)
    streamed = "".join(dec.push(random_ids[i : i + 3]) for i in range(0, 300, 3))
    assert tok.decode(random_ids).startswith(streamed)


def test_chat_template_renders_a_generation_prompt():
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
