"""The delta-rule and conv references: chunked == recurrent across chunk boundaries, grouped heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nextn.layers.gdn import l2norm
from nextn.ops.conv import causal_conv1d
from nextn.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(T, H=2, HV=4, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(1, T, H, K, generator=g))
    k = l2norm(torch.randn(1, T, H, K, generator=g))
    v = torch.randn(1, T, HV, V, generator=g)
    gate = -F.softplus(torch.randn(1, T, HV, generator=g))  # log decay <= 0
    beta = torch.rand(1, T, HV, generator=g)
    state = torch.randn(1, HV, K, V, generator=g) * 0.1
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, with_state):
    q, k, v, g, beta, state = _inputs(T)
    init = state if with_state else None
    o_c, final_c = chunk_gated_delta_rule(q, k, v, g, beta, init)
    o_r, states = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    assert torch.allclose(o_c, o_r, atol=2e-5)
    assert torch.allclose(final_c, states[:, -1], atol=2e-5)


def test_grouped_heads_equal_repeated_heads():
    q, k, v, g, beta, state = _inputs(40)
    o_g, s_g = chunk_gated_delta_rule(q, k, v, g, beta, state)
    qr, kr = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    o_r, s_r = chunk_gated_delta_rule(qr, kr, v, g, beta, state)
    assert torch.allclose(o_g, o_r) and torch.allclose(s_g, s_r)


def test_chunked_continues_from_its_own_state():
    q, k, v, g, beta, _ = _inputs(100)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta)
    o1, s1 = chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37])
    o2, s2 = chunk_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1)
    assert torch.allclose(torch.cat([o1, o2], 1), o_all, atol=2e-5)
    assert torch.allclose(s2, s_all, atol=2e-5)


def test_conv_window_gives_every_per_token_state():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 9, 6, generator=g), torch.randn(6, 4, generator=g)
    y_all, _ = causal_conv1d(x, w, None)
    state, ys = None, []
    _, window = causal_conv1d(x[:, 2:7], w, causal_conv1d(x[:, :2], w, None)[1][:, :, -3:])
    for t in range(9):
        y, win = causal_conv1d(x[:, t : t + 1], w, state)
        state = win[:, :, -3:]
        ys.append(y)
        if 2 <= t < 7:  # window slice after token t of the 5-token step == stepwise state
            assert torch.equal(window[:, :, t - 1 : t + 2], state)
    assert torch.allclose(torch.cat(ys, 1), y_all, atol=1e-6)
