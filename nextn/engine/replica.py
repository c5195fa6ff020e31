"""The engine on every tensor-parallel rank: each rank runs the same engine, and the same inputs
reach every engine before the same step, so every rank's scheduler makes the same plan and every
forward's collectives meet. Rank 0 (the caller: the CLI, the server, the Python API) owns the
requests: its `Leader` records what its engine was asked since the last step (requests added,
a sampled one's seed drawn here so every rank draws the same uniforms; requests aborted, or stopped
at a stop string its caller found) and sends
it to every other rank as the step begins; `follow` is a follower's loop: apply those inputs, step,
until rank 0 stops it (or is gone).

Draft, verify and accept are computed deterministically everywhere: every rank holds the same
gathered logits bitwise (nextn.parallel.comm) and the same seeded uniforms, and its sampler and
rounds keep the same tokens, with nothing broadcast back. Rank 0 alone hands results out.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from nextn.core import SamplingParams
from nextn.parallel.launch import STOP, Ranks


def seeded(params: SamplingParams, draw: bool) -> SamplingParams:
    """A sampled request's params with a seed, drawn here when it has none and `draw` (rank 0's
    engine): every rank must draw the same uniforms. Without draw (ranks started by torchrun, each
    making the same calls) a sampled request must bring its seed."""
    if params.greedy or params.seed is not None:
        return params
    if not draw:
        raise ValueError("under tensor parallelism started outside nextn, a sampled request needs a seed")
    return replace(params, seed=secrets.randbits(64) - 2**63)  # any 64-bit key, as a signed seed (core.SEED_RANGE)


class Leader:
    """Rank 0's side: the engine's inputs since the last step, sent to every rank as a step begins."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.pending: list[tuple] = []

    def added(self, request_id: int, args: dict) -> None:
        """Engine.add(**args) made request `request_id`."""
        self.pending.append(("add", request_id, args))

    def aborted(self, request_id: int) -> None:
        self.pending.append(("abort", request_id))

    def stopped(self, request_id: int, num_tokens: int) -> None:
        """Engine.stop(request, num_tokens): every rank cuts its slot alike."""
        self.pending.append(("stop", request_id, num_tokens))

    def step(self) -> None:
        self.ranks.send(self.pending)
        self.pending = []


def follow(engine, conn) -> None:
    """A follower rank's engine loop: rank 0's inputs, then a step, until STOP (or rank 0 is gone)."""
    requests = {}  # rank 0's request id -> this engine's request
    while True:
        try:
            message = conn.recv()
        except EOFError:  # rank 0 exited without a word
            return
        if message is STOP:
            return
        for command, request_id, *args in message:
            if command == "add":
                requests[request_id] = engine.add(**args[0])
                continue
            req = requests.pop(request_id, None)
            if req is not None and command == "stop":
                engine.stop(req, *args)
            elif req is not None:
                engine.abort(req)
        events = engine.step()
        finished = {req.request_id for req, ev in events if isinstance(ev, BaseException) or ev.output is not None}
        requests = {rid: req for rid, req in requests.items() if req.request_id not in finished}
