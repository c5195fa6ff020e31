"""The engine loop: `step()` = schedule -> run -> postprocess. The scheduler admits waiting
requests into cache slots (the engine prefills them: under "chunked" prefill the step's prompt
pieces ride its round, one trunk step for both, a mixed step: `_riding`); every running request
then takes part in one batched round (nextn.engine.rounds: one forward for all of them); each
request's tokens become logprobs and events (and text, stop strings cut on the host: nextn.engine.detokenizer,
unless the caller does that: the served path's API process, which ends a request at a stop string
through `stop`), and a finished request hands its slot back to the scheduler (kept as a session
when asked).

Owns the model, the runner, the proposer and the aggregated spec counters. One thread calls it.
A request's structured_outputs compile when it is added (a ValueError names what is wrong); its
matcher (nextn.grammar.GrammarState) is made with its rounds, on its slot's mask rows.
Under tensor parallelism every rank runs one, fed the same inputs (nextn.engine.replica: rank 0's
holds the Leader that sends them).

With the prefix cache on (nextn.cache.prefix), a request's prefill first copies in the deepest
cached block boundary of its prompt (when that beats what a kept session holds), and a step's
prefill runs in passes that each end at a block boundary, where the slot's state is cached (the
prefill step keeps only its last state), as many as the step's budget holds; a request whose
prompt shares blocks that an earlier request is still prefilling waits for them (a pass or more)
instead of computing them too.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from nextn.cache import SlotPool
from nextn.config import GDN_CHUNK, SCRATCH_SLOTS, STEP_ROWS, EngineConfig
from nextn.core import RequestOutput, SamplingParams, SpecStats
from nextn.engine.detokenizer import Detokenizer
from nextn.engine.memory import cache_layout, fit_cache
from nextn.engine.replica import Leader, seeded
from nextn.engine.riding import Piece
from nextn.engine.rounds import RequestRounds, Round, advance, warm_up
from nextn.engine.runner import ModelRunner
from nextn.engine.scheduler import Request, RoundSettings, Scheduler
from nextn.grammar import GrammarState, compile_grammar
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.triton_utils import watch_compiles
from nextn.sample.pipeline import token_logprobs, top_logprobs
from nextn.spec.k_policy import make_policy, request_k
from nextn.spec.proposer import MTPProposer
from nextn.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens of this round
    text: str  # their text delta (incomplete UTF-8 held back; "" where the caller detokenizes)
    output: RequestOutput | None  # set on the last event
    logprobs: list[dict] | None = None  # entries of this round's tokens when params.logprobs is set
    # the verify round they came from, as read: (drafted, accepted, zero_draft); None for the first
    # token. A caller that cuts the tokens (a stop string) counts it with SpecStats.record_emitted
    round_counts: tuple[int, int, bool] | None = None


@dataclass
class EngineTime:
    """Where the engine's steps spent their wall time, cumulative (/metrics: a served run's split of
    its time between prompts and rounds). The prefill seconds end with the step's one host wait,
    which also waits out the round launched a step before (rounds run one ahead); the round
    seconds are `advance`'s, which waits for that round's results; the step seconds hold both and
    the admissions and events between."""

    steps: int = 0  # (Engine.steps)
    step_seconds: float = 0.0
    prefill_passes: int = 0  # runner.prefill calls (a step crosses prefix-cache block boundaries in several)
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    mixed_steps: int = 0  # rounds that prompt pieces rode (Engine._riding; their time is in round_seconds)


@dataclass
class _Prefill:
    """A request whose prompt is being prefilled, a chunk per engine step."""

    done: int  # prompt tokens in the slot
    split: int  # the session checkpoint goes after prompt[:split]
    entries: list | None  # prompt logprobs so far (when asked)
    seconds: float = 0.0
    checkpointed: bool = False
    looked_up: bool = False  # the prefix cache was asked (its first piece; it may wait for an earlier request first)
    admitted: int = 0  # the engine step it was admitted at (its age orders the prefill: Engine._order)


@dataclass
class _Live:
    """A running request's host state."""

    rounds: RequestRounds  # (its spec counters: rounds.stats)
    detok: Detokenizer | None  # None: the caller detokenizes (Engine.add(detokenize=False))
    started: float
    prefill: _Prefill  # its prompt's (prefill time, prompt logprobs)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


def build_core(model: CausalLM, config: EngineConfig) -> tuple[SlotPool, ModelRunner, MTPProposer | None]:
    """The cache slots (as many as fit when max_num_seqs is None; checked against the device's
    memory first), the runner (its `config` holds the slot count) and the proposer."""
    cfg, k_max = model.cfg, config.spec.num_speculative_tokens
    dtype = next(model.parameters()).dtype
    config, budget = fit_cache(cfg, config, dtype)
    layout = cache_layout(
        cfg, config.max_model_len, k_max, dtype, config.kv_cache_dtype, config.max_num_seqs, SCRATCH_SLOTS
    )
    pool = SlotPool(cfg, layout, config.device, dtype, budget)
    runner = ModelRunner(model, config, pool)
    return pool, runner, MTPProposer(runner) if k_max > 0 else None


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig, leader: Leader | None = None):
        """leader: rank 0's, under tensor parallelism (it sends this engine's inputs to the other ranks)."""
        self.model, self.tokenizer, self.config, self.leader = model, tokenizer, config, leader
        cfg = model.cfg
        self.pool, self.runner, self.proposer = build_core(model, config)
        self.config = config = self.runner.config  # max_num_seqs resolved (nextn.engine.memory)
        self.scheduler = Scheduler(config.max_num_seqs)
        self.stop_ids = set(cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.stop_ids.add(tokenizer.eos_token_id)
        self.stats = SpecStats()
        self.live: dict[int, _Live] = {}
        self.prefilling: dict[int, _Prefill] = {}
        self.batch_sizes: Counter[int] = Counter()  # requests per batched round -> rounds launched
        # the batch K policy (nextn.spec.k_policy; None: every round at the requests' own K). Under
        # tensor parallelism the ranks' wall times differ, so it is off there (every rank must agree)
        self.k_policy = make_policy(config.spec) if config.tensor_parallel_size == 1 else None
        self._timed: tuple | None = None  # the last step's (batch size, choice, counts, prefilled) for the policy
        self.prefilled_rows = 0  # prompt tokens the last step prefilled
        # the default seeds (config.seed): an unseeded sampled request takes the next, so a run repeats
        self.default_seeds = random.Random(config.seed) if config.seed is not None else None
        self.prefilled_tokens = 0  # prompt tokens prefilled so far (computed, not served from a cache)
        self.time = EngineTime()  # the engine's steps and where they spent their wall time (/metrics)
        if self.runner.use_graphs and self.runner.pad_rounds:  # the rounds' graphs before any request
            watch_compiles(warming=True)
            try:
                t0 = time.perf_counter()
                k_max = config.spec.num_speculative_tokens
                ks = list(range(k_max + 1)) if self.k_policy is not None else [k_max]
                n = warm_up(self.runner, self.proposer, config.max_num_seqs, ks)
                log.info("captured %d round graphs (K %s, batches up to %d) in %.1f s", n, ks,
                         config.max_num_seqs, time.perf_counter() - t0)  # fmt: skip
                self.runner.warm_prefill(heads=self.proposer is not None)
            finally:
                watch_compiles(warming=False)  # a compile from here on is one a request waits for: logged

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        use_sessions: bool = False,
        checkpoint_at: int | None = None,
        num_speculative_tokens: int | None = None,
        detokenize: bool = True,
    ) -> Request:
        """Queue a request. Its settings (RoundSettings: the params as the engine runs them, its stop
        ids, its K) are made here, once; the Request carries them to its rounds.
        num_speculative_tokens: its K (0..the engine's; default the engine's). detokenize False: the
        caller turns its tokens into text and looks for its stop strings (the served path's API
        process): its events carry no text, and a stop string ends it through `stop`. A bad
        structured_outputs grammar raises ValueError here."""
        k_max = self.config.spec.num_speculative_tokens
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= k_max:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} is outside 0..{k_max} (the engine's K)")
        grammar = None
        if params.structured_outputs is not None:
            grammar = compile_grammar(params.structured_outputs, self.tokenizer)
        if self.default_seeds is not None and not params.greedy and params.seed is None:
            params = replace(params, seed=self.default_seeds.getrandbits(64) - 2**63)  # a signed 64-bit seed
        if self.config.tensor_parallel_size > 1:
            params = seeded(params, draw=self.leader is not None)
        stop_ids = (set() if params.ignore_eos else self.stop_ids) | set(params.stop_token_ids)  # (vLLM's ignore_eos)
        settings = RoundSettings(params, frozenset(stop_ids), num_speculative_tokens, self.config.trace)
        # prompt logprobs need the logits of every prompt row: such a request prefills cold
        req = Request(prompt_ids, settings, use_sessions and params.prompt_logprobs is None, checkpoint_at)
        req.grammar, req.detokenize = grammar, detokenize
        self.scheduler.add(req)
        if self.leader is not None:
            args = dict(prompt_ids=prompt_ids, params=params, use_sessions=use_sessions, checkpoint_at=checkpoint_at)
            args.update(num_speculative_tokens=num_speculative_tokens, detokenize=detokenize)
            self.leader.added(req.request_id, args)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request (its slot stays consistent: rounds are atomic)."""
        if self.leader is not None:
            self.leader.aborted(req.request_id)
        if self.scheduler.cancel_waiting(req):
            return
        if self.prefilling.pop(req.request_id, None) is not None:  # the slot holds a prefix of the prompt
            self.scheduler.finish(req, keep=req.use_sessions)
            return
        live = self.live.pop(req.request_id, None)
        if live is not None:
            live.rounds.close()
            self.scheduler.finish(req, keep=req.use_sessions)

    def stop(self, req: Request, num_tokens: int) -> RequestOutput:
        """End a running request after its first `num_tokens` tokens: a stop string the caller found
        (a request added with detokenize=False; the rounds may have run past it). The slot's record
        stays what the slot holds: a cut inside the last round read closes the rounds there (as a
        stop string found here does); a cut in an earlier round leaves them whole (a later request
        extending the cut text rewinds to the session checkpoint: exact, with less reused). The
        output's tokens and logprobs are cut; its spec counts are the rounds run (the caller, who
        cut them, counts its own)."""
        live = self.live.get(req.request_id)
        emitted = None if live is None else len(live.token_ids)
        if emitted is None or not 0 < num_tokens <= emitted:
            raise ValueError(f"stop after {num_tokens} tokens of a request that is not running with that many")
        if self.leader is not None:
            self.leader.stopped(req.request_id, num_tokens)
        first = len(live.token_ids) - live.rounds.handed  # tokens before the last round read
        del live.token_ids[num_tokens:]
        if live.logprobs is not None:
            del live.logprobs[num_tokens:]
        return self._finish(req, live, "stop", num_tokens - first if num_tokens > first else None)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[tuple[Request, StreamEvent | BaseException]]:
        """Admit what fits, prefill the next chunks of the prompts in progress within the step's
        token budget (what the running requests' rounds leave of max_num_batched_tokens, at least
        STEP_ROWS), then one batched round of every running request."""
        t0 = time.perf_counter()
        self.time.steps += 1
        try:
            return self._step()
        finally:
            self.time.step_seconds += time.perf_counter() - t0

    @property
    def steps(self) -> int:
        """Engine steps so far, this one included (a prefilling request's age: `_order`)."""
        return self.time.steps

    def _step(self) -> list:
        if self.leader is not None:
            self.leader.step()
        events: list = []
        for req in self.scheduler.admit():
            try:
                events += self._begin(req)
            except Exception as e:
                events.append(self._fail(req, e))
        riding = self._riding()  # the step's prompt pieces, when they ride its round (a mixed step)
        if riding is None:
            events += self._prefill()
        running = [req for req in self.scheduler.running if req.request_id in self.live]
        if running:
            # what pad members may take: slots no round runs in (free, kept sessions', and those of
            # requests still prefilling: their committed state is a session's, the next piece
            # rewrites what a pad wrote past it), for this step's rounds only (a round run another
            # way must not pad onto a slot taken since). With prefilling slots, a pool full of
            # requests still pads every batch to its bucket (no new graph under load)
            prefilling = [r.seq.slot for r in self.scheduler.running if r.request_id in self.prefilling]
            scratch = self.pool.scratch_slots  # (no request's, ever: a pad piece's first, a round pad's last)
            self.runner.spare_slots = self.scheduler.free + list(self.scheduler.sessions) + prefilling + scratch
            self.runner.free_slots = scratch + self.scheduler.free  # (a mixed round's pad piece: rounds.launch)
            try:
                events += self._run(running, self.prefilled_rows > 0 or riding is not None, riding)
            finally:
                self.runner.spare_slots = self.runner.free_slots = []
        return events

    def _fail(self, req: Request, e: Exception) -> tuple[Request, Exception]:
        """A request the engine cannot run fails alone; its slot goes back free (reset when reused)."""
        self.live.pop(req.request_id, None)
        self.prefilling.pop(req.request_id, None)
        req.use_sessions = False
        self.scheduler.finish(req, keep=False)
        return req, e

    # --- prefill, a chunk per step

    def _begin(self, req: Request) -> list:
        """An admitted request: its slot reset (or rewound to a kept session's checkpoint); its
        prompt past the cached tokens is prefilled by the next steps (from a cached prefix, if one serves more)."""
        seq = req.seq
        if req.cached == 0:  # a fresh slot (or one taken from an evicted session)
            self.runner.reset(seq, heads=self.proposer is not None)
        elif req.rewind:
            self.runner.rewind(seq)
        entries = [None] if req.params.prompt_logprobs is not None else None  # the first token has no prediction
        looked_up = self.runner.prefix is None
        self.prefilling[req.request_id] = _Prefill(
            req.cached, _split(req), entries, looked_up=looked_up, admitted=self.steps
        )
        return []

    def _look_up(self, req: Request, state: _Prefill) -> None:
        """The prefix cache's deepest block boundary of the prompt, copied into the request's slot
        when it serves more than the slot holds (a kept session's tokens). A request that asks for
        prompt logprobs prefills cold (it needs every row's logits)."""
        state.looked_up = True
        if req.params.prompt_logprobs is not None:
            return
        match = self.runner.prefix.match(req.prompt_ids, count=True)
        if match.num_tokens > req.cached:
            req.seq = self.runner.restore_prefix(req.seq, match, req.prompt_ids)
            req.cached = state.done = match.num_tokens
            state.split = _split(req)

    def _behind(self, req: Request) -> bool:
        """An earlier request, still prefilling, will cache blocks of this prompt that the cache
        lacks now: wait for them (sixteen requests with one system prompt compute it once)."""
        B, prompt = self.config.prefix_block_size, req.prompt_ids
        if req.params.prompt_logprobs is not None:
            return False
        limit, have = (len(prompt) - 1) // B * B, None
        for other in self.scheduler.running:
            if other is req:
                return False
            state = self.prefilling.get(other.request_id)
            if state is None:
                continue
            shared = min(_shared_blocks(other.prompt_ids, prompt, B) * B, limit)
            if state.done < shared:
                if have is None:  # what the cache, or the kept session in its slot, serves now
                    have = max(self.runner.prefix.match(prompt).num_tokens, req.cached)
                if shared > have:
                    return True
        return False

    def _prefill(self) -> list:
        """The next pieces of the prompts being prefilled, shortest remaining first (`_order`), within the step's
        token budget (what the running requests' rounds leave of max_num_batched_tokens, at least
        STEP_ROWS), in one runner.prefill, a pass; a piece stops at its session checkpoint (taken
        after prompt[:split]). With the prefix cache, a piece also stops at the next block boundary,
        where its state is cached, and further passes continue the pieces (and start the requests
        that waited for those blocks) while the budget lasts: a prefill crosses as many boundaries
        in one engine step as its budget allows, its pieces' rounds run once. Requests whose prompt
        is in start their rounds. Returns their events."""
        budget = self._budget()
        self.prefilled_rows, events, timed = 0, [], {}
        limits: dict[int, int] = {}  # request id -> the prompt position it may reach this step (`_plan`)
        t0 = time.perf_counter()
        while budget > 0:
            todo = self._plan(budget, limits)
            if not todo:  # (no sync either: the rounds queued ahead keep running)
                break
            computed, new = self._prefill_pass(todo, self._pieces(todo))
            timed.update((id(state), state) for _, state, _ in todo)
            events += new
            budget -= computed
            if self.runner.prefix is None or computed == 0:
                break
        if self.prefilled_rows:  # the step's prefill wall time: one host wait, after its last pass
            _sync(self.runner.device)
            seconds = time.perf_counter() - t0
            for state in timed.values():
                state.seconds += seconds
            self.time.prefill_seconds += seconds
        return events

    def _budget(self) -> int:
        """The step's prompt tokens: what the running requests' rounds leave of max_num_batched_tokens,
        at least STEP_ROWS."""
        rows = sum(live.rounds.k + 1 for live in self.live.values())
        return max(self.config.max_num_batched_tokens - rows, STEP_ROWS)

    def _plan(self, budget: int, limits: dict[int, int]) -> list:
        """A pass's pieces: (request, its state, piece end) in `_order` within the step's budget
        left. A request's share of the step is set by the first pass of the step that plans it: the
        tokens it has left, as far as the budget no earlier request holds goes (`limits`: the prompt
        position each may reach). So with the prefix cache, whose passes end at block boundaries,
        the step's passes finish the first prompts of the order rather than spending the budget on
        every prompt's first block."""
        B, todo = self.config.prefix_block_size, []
        held = (limit - self.prefilling[i].done for i, limit in limits.items() if i in self.prefilling)
        free = budget - sum(held)
        waiting = self._order([r for r in self.scheduler.running if r.request_id in self.prefilling])
        for req in waiting:
            state = self.prefilling[req.request_id]
            if req.request_id not in limits and free <= 0:
                continue  # (one that holds a share may still take it)
            if not state.looked_up:
                if self._behind(req):
                    continue
                self._look_up(req, state)
            lo = state.done
            if req.request_id not in limits:
                share = min(len(req.prompt_ids) - lo, free)
                limits[req.request_id], free = lo + share, free - share
            # (a prompt with nothing left, all of it cached, is planned all the same: so that it starts)
            if limits[req.request_id] <= lo < len(req.prompt_ids):
                continue
            end = state.split if lo < state.split else len(req.prompt_ids)
            hi = min(end, limits[req.request_id])
            if self.config.prefill == "chunked" and hi < end:  # whole chunks of the chunked delta rule;
                # a budget short of one: the step's first piece takes one all the same (no prompt stalls)
                chunks = (hi - lo) // GDN_CHUNK or (0 if todo else 1)
                if not chunks:
                    continue
                hi = min(end, lo + chunks * GDN_CHUNK)
            if self.runner.prefix is not None:  # a pass ends at each block boundary: its state is cached there
                hi = min(hi, (lo // B + 1) * B)
            todo.append((req, state, hi))
        return todo

    def _order(self, waiting: list[Request]) -> list[Request]:
        """The prompts being prefilled, the fewest tokens left first, each step waited counting as a
        step's budget fewer (ties: admission order). When prompts arrive together (a server's
        streams move in waves) most of them get their first token a step sooner: the short ones
        finish in the first steps instead of waiting behind a long one admitted before them
        (bench/serve_core_probe.py on the CPU, 16 prompts of 60-900 tokens cut from rounds.py at
        serve's 3,072-token budget: 11 first tokens after the first step, against 6 in admission
        order). The age bounds the wait of a long prompt under a stream of short ones: it goes
        first once it has waited (its tokens left - theirs) / budget steps. Where prompts finish
        never changes what they compute: a prefill's pieces give the same bits however they are
        cut (steps: the decode step's arithmetic; chunked: whole chunks)."""
        if len(waiting) < 2:
            return waiting
        budget = self.config.max_num_batched_tokens

        def rank(req: Request) -> int:
            state = self.prefilling[req.request_id]
            return len(req.prompt_ids) - state.done - (self.steps - state.admitted) * budget

        return sorted(waiting, key=rank)  # (stable: admission order among equals)

    def _prefill_pass(self, todo: list, pieces: list[Piece]) -> tuple[int, list]:
        """One runner.prefill of the planned pieces (`_pieces` of todo), then `_prefilled`. Returns
        (tokens, events)."""
        computed = sum(len(p.token_ids) for p in pieces)
        self.time.prefill_passes += 1
        try:
            self.runner.prefill(pieces)
        except Exception as e:  # the step's pieces fail together (their slots are taken back whole)
            return computed, [self._fail(req, e) for req, _, _ in todo]
        return computed, self._prefilled(todo)

    def _pieces(self, todo: list) -> list[Piece]:
        """The planned pieces (counted in prefilled_rows, the step's, and prefilled_tokens)."""
        pieces = [
            Piece(req.seq, req.prompt_ids[state.done : hi], self._prompt_logprobs(req, state, state.done))
            for req, state, hi in todo
            if hi > state.done
        ]
        computed = sum(len(p.token_ids) for p in pieces)
        self.prefilled_rows += computed
        self.prefilled_tokens += computed
        return pieces

    def _prefilled(self, todo: list) -> list:
        """The planned pieces are in: the cache's snapshots at the boundaries they reach, session
        checkpoints; requests whose prompt is in start. Returns their events."""
        B = self.config.prefix_block_size
        events = []
        for req, state, hi in todo:
            if self.runner.prefix is not None and hi > state.done and hi % B == 0:
                self.runner.snapshot_prefix(req.seq)
            state.done = hi
            if req.use_sessions and state.done == state.split and not state.checkpointed:
                self.runner.checkpoint(req.seq)
                state.checkpointed = True
        for req, state, _ in todo:
            if state.done < len(req.prompt_ids):
                continue
            del self.prefilling[req.request_id]
            try:
                events += self._start(req, state)
            except Exception as e:
                events.append(self._fail(req, e))
        return events

    def _riding(self) -> list | None:
        """The step's prompt pieces when they ride its round, a mixed step (their plan, as one pass
        of `_prefill` plans it): under "chunked" prefill, when an unconstrained round of running
        requests launches this step and no piece asks for prompt logprobs. A prompt piece's rows
        then share the round's trunk step, its weights read once for both (a 9B round of 16 rows
        reads 18 GB; a piece's few hundred rows add their arithmetic, bench/mixed_step_probe.py),
        each row with its own step's arithmetic: the round's rows are the bits of a round alone,
        the piece's those of a prefill step (whole chunks from the prompt's first: `_plan`).
        None: the step prefills apart (`_prefill`)."""
        if self.config.prefill != "chunked" or not self.prefilling:
            return None
        free = [live.rounds for live in self.live.values() if live.rounds.grammar is None]
        if not any(r.needs_round() or r.wants_ahead() for r in free):
            return None
        self.prefilled_rows = 0
        todo = [(req, state, hi) for req, state, hi in self._plan(self._budget(), {}) if hi > state.done]
        if not todo or any(state.entries is not None for _, state, _ in todo):
            return None
        return todo

    def _prompt_logprobs(self, req: Request, state: _Prefill, lo: int):
        """The on_logits callback of a prefill piece starting at prompt[lo] that collects prompt
        logprobs (None: not asked)."""
        if state.entries is None:
            return None
        prompt, num_top = req.prompt_ids, req.params.prompt_logprobs

        def take(start: int, rows: torch.Tensor) -> None:  # rows[i] predicts prompt[lo + start + i + 1]
            targets = prompt[lo + start + 1 : lo + start + 1 + rows.shape[0]]
            if targets:
                state.entries.extend(logprob_entries(rows, targets, num_top))

        return take

    def _start(self, req: Request, state: _Prefill) -> list:
        """The prompt is in: the request's rounds begin (or it ends at once: max_tokens 0)."""
        params = req.params
        now = time.perf_counter()
        if params.max_tokens == 0:
            output = self._output(req, state, "length")
            self.scheduler.finish(req, keep=req.use_sessions)
            return [(req, StreamEvent([], "", output))]
        rounds = RequestRounds(self.runner, self.proposer, req.seq, req.settings, self._grammar_state(req))
        detok = Detokenizer(self.tokenizer, params) if req.detokenize else None
        self.live[req.request_id] = _Live(
            rounds, detok, now, state, logprobs=[] if params.logprobs is not None else None
        )
        return []

    def _grammar_state(self, req: Request) -> GrammarState | None:
        """A constrained request's matcher, writing into its slot's mask rows."""
        if req.grammar is None:
            return None
        masks = self.runner.slot(req.seq.slot).t("grammar_mask")
        return GrammarState(req.grammar, masks, self.stop_ids, self.config.spec.grammar_draft_mask)

    # --- rounds and their tokens

    def _run(self, reqs: list[Request], prefilled: bool, riding: list | None = None) -> list:
        """One engine step of the running requests (nextn.engine.rounds.advance), each request's
        round turned into its event. riding (`_riding`'s plan): prompt pieces that ride the step's
        round, or, where no round took them, prefill apart after it. With a K policy, the step's K
        is chosen for the batch first and the step's wall time and the rounds read are fed back to
        it (`_policy_step`)."""
        lives = [self.live[req.request_id] for req in reqs]
        t0 = time.perf_counter()
        choice = self._choose_k(reqs, lives)
        riders, events = None, []
        if riding:
            try:
                riders = self.runner.ride(self._pieces(riding))
            except Exception as e:  # (the pieces' requests fail together, as a prefill pass's do)
                events, riding = [self._fail(req, e) for req, _, _ in riding], None
        # a round that cannot run, or a read that fails (a grammar failing mid-output), fails its
        # request alone: the others' rounds stand (the engine serves on)
        rounds, sizes, rode = advance(self.runner, self.proposer, [live.rounds for live in lives], riders)
        self.batch_sizes.update(sizes)
        seconds = time.perf_counter() - t0
        self.time.round_seconds += seconds
        if self.k_policy is not None:
            self._policy_step(lives, choice, prefilled, seconds)
        events += [self._event(req, live, r) for req, live, r in zip(reqs, lives, rounds, strict=True)]
        if riding and rode:
            self.time.mixed_steps += 1
            for _, state, _ in riding:
                state.seconds += seconds
            events += self._prefilled(riding)
        elif riding:  # no round launched, or its launch failed: the pieces prefill apart
            events += self._prefill_pass(riding, riders.pieces)[1]
        return events

    def _choose_k(self, reqs: list[Request], lives: list[_Live]) -> int | None:
        """The policy's K for this step's batch, set on each request's rounds as request_k says
        (greedy and unseeded requests follow it; seeded sampled ones keep their own K)."""
        if self.k_policy is None:
            return None
        choice = self.k_policy.choose(len(lives))
        for req, live in zip(reqs, lives, strict=True):
            live.rounds.step_k = request_k(live.rounds.k_ctl.k, choice, req.params)
        return choice

    def _policy_step(self, lives: list[_Live], choice: int, prefilled: bool, seconds: float) -> None:
        """Feed the policy: the rounds just read, and the step's wall time as the cost of the round it
        waited for. That round was launched a step earlier (one runs ahead), so the time counts for
        the last step's choice, when the batch size is the same and neither step prefilled, captured
        a graph or ran one eagerly (their time is not a round's)."""
        for live in lives:
            read = live.rounds.unrecorded  # the round just read (before a stop or max_tokens cut it)
            if read is not None and read.k > 0:
                self.k_policy.observe_round(read.drafted, read.accepted)
        counts = (self.runner.graph_counts["captures"], self.runner.graph_counts["eager"])
        last, self._timed = self._timed, (len(lives), choice, counts, prefilled)
        if last is not None and last[0] == len(lives) and last[2] == counts and not (prefilled or last[3]):
            self.k_policy.observe_step(len(lives), last[1], seconds)

    def _event(self, req: Request, live: _Live, r: Round | Exception) -> tuple:
        """A request's round as its event; a failed round, or its host work failing (decoding, stop
        strings, logprobs), fails that request alone."""
        if isinstance(r, Exception):
            return self._fail(req, r)
        try:
            return req, self._postprocess(req, live, r)
        except Exception as e:  # noqa: BLE001 (any of this request's own failures: it ends with it)
            if req.request_id not in self.live:  # (it had finished: its slot is already back)
                raise
            live.rounds.close()
            return self._fail(req, e)

    def _postprocess(self, req: Request, live: _Live, r: Round) -> StreamEvent:
        ids, finish_reason, detok = r.token_ids, r.finish_reason, live.detok
        read = live.rounds.unrecorded  # the round these tokens came from (before a cut)
        counts = None if read is None else (read.drafted, read.accepted, read.zero_draft)
        text = ""
        if detok is not None:  # a stop string keeps the tokens up to the one completing it
            ids, text = detok.push(ids, last=finish_reason is not None)
            finish_reason = "stop" if detok.stopped else finish_reason
        live.token_ids.extend(ids)
        entries = None
        if live.logprobs is not None:
            entries = logprob_entries(r.logits, ids, req.params.logprobs) if ids else []
            live.logprobs.extend(entries)
        if finish_reason is None:
            return StreamEvent(ids, text, None, entries, counts)
        kept = len(ids) if detok is not None and detok.stopped else None
        return StreamEvent(ids, text, self._finish(req, live, finish_reason, kept), entries, counts)

    def _finish(self, req: Request, live: _Live, finish_reason: str, kept: int | None) -> RequestOutput:
        """The request is over after `kept` tokens of its last round read (None: all it handed out):
        its rounds closed there, its output made, its slot back to the scheduler. No host wait: what
        runs in the slot next queues behind the rounds still in flight (one stream)."""
        live.rounds.close(kept)
        output = self._output(req, live.prefill, finish_reason, live)
        output.stop_reason = self._stop_reason(req, live, finish_reason)
        self.stats.merge(live.rounds.stats)
        del self.live[req.request_id]
        self.scheduler.finish(req, keep=req.use_sessions)
        return output

    def _stop_reason(self, req: Request, live: _Live, finish_reason: str) -> int | str | None:
        """vLLM's stop_reason: the stop string that ended the output, or the request's stop token id
        (EOS, unless ignored, comes first, as there), else None."""
        if live.detok is not None and live.detok.stopped:
            return live.detok.stop_string
        last = live.token_ids[-1] if finish_reason == "stop" and live.token_ids else None
        if last in req.params.stop_token_ids and (req.params.ignore_eos or last not in self.stop_ids):
            return last
        return None

    def _output(self, req: Request, prefill: _Prefill, finish_reason: str, live: _Live | None = None) -> RequestOutput:
        """The request's output: its prompt's part from `prefill` (its time, prompt logprobs), the
        rest from its rounds (live; None: none ran, max_tokens 0)."""
        output = RequestOutput(
            token_ids=[],
            text="",
            finish_reason=finish_reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached,
            spec=SpecStats(),
            prefill_seconds=prefill.seconds,
            decode_seconds=0.0,
            prompt_logprobs=prefill.entries,
        )
        if live is not None:
            output.token_ids, output.spec, output.rounds = live.token_ids, live.rounds.stats, live.rounds.trace
            output.text = "" if live.detok is None else live.detok.text
            output.decode_seconds, output.logprobs = time.perf_counter() - live.started, live.logprobs
        return output


def _split(req: Request) -> int:
    """Where the request's session checkpoint goes: after prompt[:split]."""
    prompt = req.prompt_ids
    return len(prompt) if req.checkpoint_at is None else min(max(req.checkpoint_at, req.cached), len(prompt))


def _shared_blocks(a: list[int], b: list[int], size: int) -> int:
    """How many whole blocks of `size` tokens a and b start with alike."""
    n = 0
    while (n + 1) * size <= min(len(a), len(b)) and a[n * size : (n + 1) * size] == b[n * size : (n + 1) * size]:
        n += 1
    return n


def logprob_entries(rows: torch.Tensor, ids: list[int], n: int) -> list[dict]:
    rows = rows[: len(ids)]
    ids_t = torch.tensor(ids, device=rows.device)
    chosen = token_logprobs(rows, ids_t).tolist()
    # vLLM's rank: 1 + the tokens more probable than the chosen one
    ranks = ((rows > rows.gather(1, ids_t[:, None])).sum(-1) + 1).tolist()
    top = top_logprobs(rows, n) if n > 0 else None
    entries = []
    for i, (tok, lp) in enumerate(zip(ids, chosen, strict=True)):
        tops = list(zip(top.ids[i].tolist(), top.logprobs[i].tolist(), strict=True)) if top is not None else []
        entries.append({"token_id": tok, "logprob": lp, "rank": ranks[i], "top_logprobs": tops})
    return entries


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
