"""The chunked sampling kernels (nextn.sample.triton_wide), which serve vocabularies wider than
one program holds, against their references: the temperature law with top-k, top-p and min-p and
its draw (nextn.sample.pipeline.probs_from_logits, sample), decided on the chunks' candidates where they
cover the cut and by passes over the row where they do not; a row's result whatever rows run beside
it. Small chunks (128 columns) give many chunks a row at test sizes. Their rejection sampling and
the slot sampler's use of them above MAX_V: tests/test_sample_kernel.py.

On CPU the kernels run under Triton's interpreter (triton_interp.py); on a GPU compiled.
"""

from __future__ import annotations

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)

pytest.importorskip("triton")

from nextn.sample.pipeline import (  # noqa: E402
    Law,  # noqa: E402
    SamplingParams,
    probs_from_logits,
    sample,
)
from nextn.sample.triton_wide import Chunks, temperature_sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNKS = Chunks(128, 16)

# (filters, logits scale, whether the candidates decide every row): a peaked row's cuts lie among
# its chunks' 16 best; a flat row's nucleus (or a top-k of 500 > 16 candidates x 9 chunks) does not
CASES = [
    (dict(), 3.0, None),
    (dict(top_k=8), 3.0, True),
    (dict(top_k=1), 3.0, True),
    (dict(top_k=100000), 3.0, False),  # above V: every token, which the candidates cannot hold
    (dict(top_k=500), 3.0, False),
    (dict(top_p=0.3), 3.0, True),
    (dict(top_p=0.9), 0.05, False),
    (dict(top_k=50, top_p=0.3), 3.0, True),
    (dict(min_p=0.05), 3.0, True),
    (dict(min_p=0.5), 0.05, False),
    (dict(top_k=12, top_p=0.9, min_p=0.02), 3.0, True),
]


def _device_filters(f: dict, params: SamplingParams) -> dict:
    return {
        name: torch.tensor(getattr(params, name), device=DEVICE) if name in f else None
        for name in ("top_k", "top_p", "min_p")
    }


@pytest.mark.parametrize("V", [1031])
def test_the_chunked_law_keeps_and_draws_what_the_reference_does(V):
    """Every filter and combination keeps the tokens the reference's stable sort keeps, with its
    probabilities, and draws the reference's token; `covered` says which rows the candidates
    decided, and both ways are taken. Ties (logits on a coarse grid) included, masked tokens never
    drawn, and u at the CDF's top gives a token with mass."""
    g = torch.Generator().manual_seed(V)
    N = 4
    base = torch.randn(N, V, generator=g)
    base[1] = (base[1] * 4).round() / 4  # ties, at the cuts too
    base[2, : V // 2] = float("-inf")  # a ban: never drawn
    u = torch.rand(N, generator=g, dtype=torch.float64)
    u[3] = 1.0 - 2.0**-53
    decided = set()
    for f, scale, covered in CASES:
        logits = base * scale
        params = SamplingParams(temperature=0.8, **f)
        want = probs_from_logits(logits, params)
        bounds = torch.zeros(N, 3, dtype=torch.int32, device=DEVICE)
        law = Law(torch.tensor(0.8, device=DEVICE), **_device_filters(f, params))
        probs, ids = temperature_sample(logits.to(DEVICE), law, u.to(DEVICE), bounds=bounds, chunks=CHUNKS)
        probs, ids = probs.cpu(), ids.cpu()
        assert torch.equal(probs > 0, want > 0), f
        assert torch.allclose(probs, want, rtol=1e-5, atol=1e-7), f
        assert torch.equal(ids[:3], sample(want, u)[:3]), f
        assert want[3, ids[3]] > 0 and ids[2] >= V // 2, f
        if covered is not None:
            rows = [0, 1, 3]  # row 2 is half banned: the candidates of its empty chunks differ
            assert bounds.cpu()[rows, 2].tolist() == [int(covered)] * 3, f
            decided.add(covered)
    assert decided == {True, False}


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_the_released_vocabulary_at_the_default_chunks_gpu():
    """At 248,320 columns and the module's own CHUNK and KCAP (compiled): Qwen's suggested law
    (top-k 20, top-p 0.8) decided on the candidates, a flat row's top-p by passes over the row, and
    each equal to the reference's law and draws over 9 rows."""
    g = torch.Generator().manual_seed(0)
    N, V = 9, 248_320
    logits = torch.randn(N, V, generator=g) * 4
    u = torch.rand(N, generator=g, dtype=torch.float64)
    for f, scale, covered in ((dict(top_k=20, top_p=0.8), 1.0, 1), (dict(top_p=0.9), 0.01, 0), (dict(), 1.0, None)):
        params = SamplingParams(temperature=0.7, **f)
        x = (logits * scale).to(DEVICE, torch.bfloat16)
        want = probs_from_logits(x, params)
        bounds = torch.zeros(N, 3, dtype=torch.int32, device=DEVICE)
        law = Law(torch.tensor(0.7, device=DEVICE), **_device_filters(f, params))
        probs, ids = temperature_sample(x, law, u.to(DEVICE), bounds=bounds)
        assert torch.equal(probs > 0, want > 0), f
        assert torch.allclose(probs, want, rtol=1e-4, atol=1e-8), f
        assert torch.equal(ids, sample(want, u.to(DEVICE))), f
        if covered is not None:
            assert bounds[:, 2].tolist() == [covered] * N, f


def test_a_rows_law_and_draw_do_not_depend_on_the_rows_beside_it():
    """Row i computed alone, among 3 rows or among 7 (other values around it) gives the same bits:
    the verify's rows equal the decode's."""
    g = torch.Generator().manual_seed(7)
    V = 900
    rows = (torch.randn(7, V, generator=g) * 2).to(DEVICE)
    u = torch.rand(7, generator=g, dtype=torch.float64).to(DEVICE)
    law = Law(
        torch.tensor(0.7, device=DEVICE), top_k=torch.tensor(20, device=DEVICE), top_p=torch.tensor(0.8, device=DEVICE)
    )
    full, full_ids = temperature_sample(rows, law, u, chunks=CHUNKS)
    for i in (0, 3, 6):
        alone, alone_ids = temperature_sample(rows[i : i + 1], law, u[i : i + 1], chunks=CHUNKS)
        assert torch.equal(alone[0], full[i]) and alone_ids[0] == full_ids[i]
    three, three_ids = temperature_sample(rows[2:5], law, u[2:5], chunks=CHUNKS)
    assert torch.equal(three, full[2:5]) and torch.equal(three_ids, full_ids[2:5])
