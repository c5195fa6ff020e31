"""The cache of the Triton step path (nextn.engine.fast): a HybridCache whose GDN conv and
recurrent states are views of stacked tensors, with stacked buffers for what a step keeps per
token and the device scalars that tell the step kernel where the committed state is.

Owns the step buffers and their commit / discard / materialize rules; knows nothing of kernels.
"""
from __future__ import annotations

import torch

from nextn.cache.hybrid import HybridCache
from nextn.layers.linear import STEP_ROWS


class FastCache(HybridCache):
    """HybridCache whose GDN conv / recurrent states are views of two stacked tensors, with
    stacked buffers for what a Triton step keeps per token.

    After a Triton step, `commit(n)` copies the conv windows but not the recurrent states (50 MB
    per token on a 9B model): the committed state stays where the step wrote it, in `states_all`,
    and the next step reads it there. `states_all` holds two halves of `max_step` token slots and
    a step writes the half that does not hold the committed state, so a step that is discarded
    (`discard_step`) leaves the committed state intact. The device scalars `slots` = [where the
    committed state is (-1: `recurrent_all`), first slot the next step writes] steer the kernel,
    so one CUDA graph serves every round. Code that reads `recurrent` itself (prefill through the
    reference modules, snapshots) calls `materialize()` first, which copies the states home.
    """

    def __init__(self, cfg, max_len: int, device, dtype, max_step: int = STEP_ROWS):
        super().__init__(cfg, max_len, device, dtype)
        self.gdn_layers = sorted(self.conv)
        n, W = len(self.gdn_layers), cfg.linear_conv_kernel_dim
        HV, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_all = torch.zeros(n, cfg.conv_dim, W - 1, device=device, dtype=dtype)
        self.recurrent_all = torch.zeros(n, HV, K, V, device=device, dtype=torch.float32)
        for j, i in enumerate(self.gdn_layers):
            self.conv[i], self.recurrent[i] = self.conv_all[j][None], self.recurrent_all[j][None]
        self.max_step = max_step
        self.window_all = torch.zeros(n, cfg.conv_dim, W - 1 + max_step, device=device, dtype=dtype)
        self.states_all = torch.zeros(n, 2 * max_step, HV, K, V, device=device, dtype=torch.float32)
        self.slots = torch.tensor([-1, 0], device=device, dtype=torch.int32)
        self._committed_at, self._write_at = -1, 0  # host copies of `slots`
        self.fast_step = False  # the last keep-states step ran the Triton kernels
        self.graphs = None  # CUDA graphs captured against this cache (nextn.engine.cuda_graphs)

    def commit(self, num_kept: int) -> None:
        if not self.fast_step:
            return super().commit(num_kept)
        if not 1 <= num_kept <= self.step_tokens:
            raise ValueError(f"commit({num_kept}) after a step of {self.step_tokens} tokens")
        W = self.cfg.linear_conv_kernel_dim
        self.conv_all.copy_(self.window_all[:, :, num_kept : num_kept + W - 1])
        committed = self._write_at + num_kept - 1
        self._set_slots(committed, self.max_step - self._write_at)
        self.fast_step = False
        self.seq_len += num_kept
        self.step_tokens = 0

    def _set_slots(self, committed_at: int, write_at: int) -> None:
        if committed_at != self._committed_at:
            self.slots[0].fill_(committed_at)
        if write_at != self._write_at:
            self.slots[1].fill_(write_at)
        self._committed_at, self._write_at = committed_at, write_at

    def materialize(self) -> None:
        """Bring the committed recurrent states home to `recurrent_all` (before anything but a
        Triton step reads them)."""
        if self._committed_at >= 0:
            self.recurrent_all.copy_(self.states_all[:, self._committed_at])
            self._set_slots(-1, self._write_at)

    def discard_step(self) -> None:
        super().discard_step()
        self.fast_step = False

    def snapshot(self):
        self.materialize()
        return super().snapshot()

    def restore(self, snap) -> None:
        super().restore(snap)  # overwrites recurrent_all: the committed states are there again
        self._set_slots(-1, self._write_at)
        self.fast_step = False
