"""Executor: runs a whole batch of requests in the planner's order over the radix-tree KV cache.

Each request's uncached tokens go into ragged forward batches of at most `max_tokens_per_batch`
tokens. A request's prompt is inserted into the tree as soon as its slots are allocated, so a later
request of the same batch already matches it and reads KV that the same forward pass writes: siblings
batched together compute their shared prefix once. Logits are computed only at positions some
request scores or samples from, and are captured whichever request happens to compute the position.

Generation is continuous batching. A generation request's prompt is prefilled ahead, in the same
large batches as every other prompt, and the request waits in a queue until a decode row is free;
admitting it costs no forward pass (its first token comes from the prompt's logits; those of every
queued request are sampled together, as soon as they are computed), so a row that finishes is refilled
at the next step. A finished request is released (its output inserted into the tree) while the
device computes the next step. Prefill runs ahead while the pool keeps room for the decode
slots of every queued request; when it does not, running requests decode until an eighth of them
have finished.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch

from lmbatch.attention import ForwardBatch, default_backend, make_backend, to_device
from lmbatch.attention.kv_pool import KVPool
from lmbatch.engine.radix_cache import Node, RadixTree
from lmbatch.engine.sampling import sample
from lmbatch.model.config import ModelConfig
from lmbatch.model.network import Transformer
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, SamplingParams, ScoreRequest, ScoreResult
from lmbatch.scheduler.planner import Plan, PlanNode, plan_requests

if TYPE_CHECKING:      # lmbatch.grammar imports xgrammar: loaded only where a grammar is used
    from lmbatch.grammar import Constraint

FULL_ROW = -1  # demand marker: keep the whole logits row (to sample from it)
REFILL_DIVISOR = 8  # a full decode batch admits new requests once 1/8 of its requests have finished
Key = tuple[PlanNode, int]
# When a grammar row's token mask is filled: "overlap" before sampling while the device computes the
# logits (else only if the grammar rejects the row's unconstrained pick), "lazy" only on rejection,
# "eager" always before sampling. The three pick the same tokens.
MASK_MODES = ("overlap", "lazy", "eager")
AHEAD_ROWS = 4      # masks filled between two looks at the device (one by one: a batched fill overshoots)
FIRST_TOKEN_ROWS = 1024  # queued requests' first tokens sampled per round (bounds the stacked logits)


@dataclass
class Captured:
    argmax: int
    logprobs: dict[int, float]
    row: torch.Tensor | None = None


@dataclass
class _Batch:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_slots: list[torch.Tensor] = field(default_factory=list)
    kv: list[torch.Tensor] = field(default_factory=list)
    qo_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indptr: list[int] = field(default_factory=lambda: [0])
    logit_rows: list[int] = field(default_factory=list)
    logit_keys: list[Key | None] = field(default_factory=list)    # None: rows nobody captures
    locks: list[Node] = field(default_factory=list)
    to_free: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.qo_indptr[-1]

    def add(self, ids, start: int, out_slots, kv_slots, wanted: Sequence[tuple[int, Key | None]]) -> None:
        row0 = self.num_tokens
        n = len(ids)
        self.ids.extend(ids)
        self.positions.extend(range(start, start + n))
        self.out_slots.append(out_slots)
        self.kv.append(kv_slots)
        self.qo_indptr.append(row0 + n)
        self.kv_indptr.append(self.kv_indptr[-1] + len(kv_slots))
        for pos, key in wanted:
            self.logit_rows.append(row0 + pos - start)
            self.logit_keys.append(key)

    def build(self) -> ForwardBatch:
        return ForwardBatch(torch.tensor(self.ids), torch.tensor(self.positions), torch.cat(self.out_slots),
                            self.qo_indptr, self.kv_indptr, torch.cat(self.kv),
                            torch.as_tensor(self.logit_rows, dtype=torch.int64))


@dataclass
class _InFlight:
    """Logits of a launched batch, reduced on the device and on their way to the host."""
    keys: list[Key]
    pairs: list[tuple[int, int]]    # (row, target token) for each value
    values: torch.Tensor            # logprob of each pair
    argmax: torch.Tensor
    rows: dict[int, torch.Tensor]   # full logits rows, for sampling
    event: torch.cuda.Event | None


@dataclass
class _Queued:
    """A generation request whose prompt is in the pool, waiting for a decode row."""
    index: int
    node: Node | None
    slots: torch.Tensor             # prompt slots
    reserve: int                    # decode slots it takes when admitted
    key: Key                        # where its prompt's last logits are captured
    run: "_Running | None" = None   # made once its first token is sampled (or when it is admitted)


@dataclass
class _Running:
    """A generation request between its prefill and its end."""
    index: int
    node: Node | None
    slots: torch.Tensor             # prompt slots, then the reserved decode slots
    prompt_len: int
    params: SamplingParams
    constraint: Constraint | None = None
    out: list[int] = field(default_factory=list)
    fed: int = 0                    # tokens of `out` whose KV is in the pool
    steps: int = 0                  # forward passes that sampled a token for it
    jumped: int = 0                 # tokens appended by jump-forward
    rejected: bool = False          # its grammar rejected its last unconstrained pick
    finish: str = ""


class Engine:
    def __init__(self, model: Transformer, *, kv_cache_tokens: int = 32768, max_tokens_per_batch: int = 4096,
                 attention: str | None = None, cache: bool = True, max_running: int = 256, tokenizer=None,
                 cuda_graphs: bool = True, jump_forward: bool = True, masks: str = "overlap"):
        cfg = model.cfg
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        attention = attention or default_backend(self.device, dtype)
        # decode steps replay CUDA graphs (not for the torch reference backend, which stays eager);
        # one extra slot is their scratch for padded rows
        use_graphs = cuda_graphs and self.device.type == "cuda" and attention != "torch"
        self.pool = KVPool(kv_cache_tokens + use_graphs, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                           self.device)
        self.attn = make_backend(attention, self.pool, cfg.num_heads, cfg.head_dim)
        self.graphs = None
        if use_graphs:
            from lmbatch.engine.graphs import DecodeGraphs
            # a row per token: a step's rows after jump-forwards may outnumber its requests
            self.graphs = DecodeGraphs(model, self.pool, int(self.pool.reserve(1)), 2 * max_running)
            self.graphs.capture_all()
        self.tree = RadixTree(self.pool.free) if cache else None
        self.max_tokens_per_batch = max_tokens_per_batch
        self.max_running = max_running
        self.jump_forward = jump_forward
        if masks not in MASK_MODES:
            raise ValueError(f"masks must be one of {MASK_MODES}, not {masks!r}")
        self.masks = masks
        self._mask_buf: torch.Tensor | None = None
        self._retok_memo: dict = {}     # retokenized jump boundaries (the tokenizer never changes)

    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=torch.float32, load_format="auto", **kw) -> "Engine":
        from lmbatch.model.weights import init_dummy, load_weights

        cfg = ModelConfig.from_dir(path)
        with torch.device(device):
            model = Transformer(cfg).to(dtype)
        init_dummy(model) if load_format == "dummy" else load_weights(model, path)
        return cls(model.eval(), **kw)

    @torch.inference_mode()
    def warm_up(self, tokens: int = 16) -> None:
        """Run one small prefill batch and its logit reduction, so that kernel compilation and
        library loading happen now (on the loader's thread) rather than in the first real batch.
        Its KV goes to slots that are freed again."""
        if self.device.type != "cuda":
            return
        slots = cast(torch.Tensor, self.pool.alloc(tokens))     # before any run: the pool has room
        b = _Batch()
        b.add([0] * tokens, 0, slots, slots, [(tokens - 1, None)])
        logits = self.model(b.build().to(self.device), self.attn)
        torch.log_softmax(logits, dim=-1).argmax(dim=-1).cpu()
        self.pool.free(slots)

    # ---- public API -------------------------------------------------------------------------
    def score(self, requests: Sequence[ScoreRequest], **kw) -> tuple[list[ScoreResult], RunStats]:
        return self.run(requests, **kw)

    def generate(self, requests: Sequence[GenerateRequest], **kw) -> tuple[list[GenerateResult], RunStats]:
        return self.run(requests, **kw)

    @torch.inference_mode()
    def run(self, requests: Sequence[ScoreRequest | GenerateRequest], schedule: str = "dfs", seed: int = 0,
            progress: Callable[[int, RunStats], None] | None = None, plan: Plan | None = None):
        """Execute every request; results come back in the order of `requests`.

        `progress(i, stats)` is called as request i's last prompt token is issued (scoring) or as
        its generation ends. `plan`: `plan_requests(requests, schedule, seed)`, if made already."""
        t0 = time.perf_counter()
        if plan is None:
            plan = plan_requests(requests, schedule, seed)
        self._requests, self._progress = requests, progress
        self._captured: dict[Key, Captured] = {}
        self._pending: set[Key] = set()
        self._inflight: list[_InFlight] = []
        self._positions: dict[int, list[int]] = {}
        self._register_demands(plan, requests)
        self.stats = RunStats(requests=len(requests), executed=len(plan.order), prompt_tokens=plan.prompt_tokens,
                              unique_tokens=plan.unique_tokens, optimal_hit_rate=plan.optimal_hit_rate,
                              engine_optimal_hit_rate=plan.engine_optimal_hit_rate, order=list(plan.order),
                              members=plan.members)
        t1 = time.perf_counter()
        self._results = [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult() for r in requests]
        self._running: list[_Running] = []
        self._queue: deque[_Queued] = deque()
        self._unsampled: list[_Queued] = []             # queued requests without their first token
        self._finished: list[_Running] = []             # ended, released during the next step's forward
        self._queued_reserve = 0                        # pool slots kept free for the queue's decode slots
        self._batch = _Batch()
        self._own_slots: dict[int, torch.Tensor] = {}   # without a cache: each request's own KV
        for i in plan.order:
            self._prefill(i)
        self._flush()
        self._decode_all()
        self._drain()
        for i, r in enumerate(requests):
            if isinstance(r, ScoreRequest):
                self._finish_score(i, r)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.plan_s, self.stats.execute_s = t1 - t0, time.perf_counter() - t1
        return self._results, self.stats

    # ---- planning of logits ---------------------------------------------------------------
    def _register_demands(self, plan: Plan, requests) -> None:
        self._paths: list[list[PlanNode]] = [plan.path(i) for i in range(len(requests))]
        for i, r in enumerate(requests):
            if isinstance(r, ScoreRequest):
                positions = self._score_positions(r)
                for node, p, t in zip(self._nodes_at(i, positions), positions, r.continuation):
                    wanted = node.demands.get(p)
                    if wanted is None:
                        node.demands[p] = {t}
                    else:
                        wanted.add(t)
            else:
                p = len(r.prompt) - 1
                self._node_at(i, p).demands.setdefault(p, set()).add(FULL_ROW)

    def _node_at(self, i: int, pos: int) -> PlanNode:
        for node in self._paths[i]:
            if node.start <= pos < node.end:
                return node
        raise IndexError(pos)

    def _nodes_at(self, i: int, positions) -> list[PlanNode]:
        """The node of request i's path holding each of `positions` (ascending), in one walk of the
        path (a scored continuation's ~25 positions looked up one by one walked it ~25 times)."""
        path, out, k = self._paths[i], [], 0
        for p in positions:
            while path[k].end <= p:
                k += 1
            out.append(path[k])
        return out

    def _wanted(self, i: int, start: int, end: int) -> list[tuple[int, Key]]:
        """Demanded positions in [start, end) of request i's path that nobody has captured yet."""
        out = []
        for node in self._paths[i]:
            if node.end <= start or node.start >= end:
                continue
            for p in node.demands:
                key = (node, p)
                if start <= p < end and key not in self._captured and key not in self._pending:
                    out.append((p, key))
        return out

    @staticmethod
    def _score_positions(r: ScoreRequest) -> range:
        return range(len(r.context) - 1, len(r.context) + len(r.continuation) - 1)

    def _own_positions(self, j: int) -> list[int]:
        """Positions where executed request j (and the requests merged into it) need logits."""
        if j not in self._positions:
            out: set[int] = set()
            for i in self.stats.members[j]:
                r = self._requests[i]
                out.update(self._score_positions(r) if isinstance(r, ScoreRequest) else [len(r.prompt) - 1])
            self._positions[j] = sorted(out)
        return self._positions[j]

    def _first_missing(self, j: int, end: int) -> int:
        """Lowest position below `end` where request j needs logits that are neither captured nor
        on their way (only after an earlier call left them in the cache); `end` if none."""
        positions = [p for p in self._own_positions(j) if p < end]
        for node, p in zip(self._nodes_at(j, positions), positions):
            key = (node, p)
            if key not in self._captured and key not in self._pending:
                return p
        return end

    # ---- prefill ---------------------------------------------------------------------------
    def _match(self, i: int, toks: list[int]) -> tuple[torch.Tensor, Node | None, int]:
        if self.tree is None:
            return self._own_slots.get(i, torch.empty(0, dtype=torch.int64)), None, len(self._own_slots.get(i, ()))
        slots, node = self.tree.match_prefix(toks)
        return slots, node, len(slots)

    def _prefill(self, i: int) -> None:
        req, res = self._requests[i], self._results[i]
        toks = req.prompt
        n = len(toks)
        res.prompt_tokens = n
        first = True
        while True:
            slots, node, matched = self._match(i, toks)
            m = self._first_missing(i, matched)
            if first:
                res.cached_tokens, first = m, False
                self.stats.cached_tokens += m
            if m == n:
                break
            if node is not None:    # a node comes only from the tree
                cast(RadixTree, self.tree).lock(node)
            chunk = min(n - m, self.max_tokens_per_batch - self._batch.num_tokens)
            new = self._alloc(chunk) if chunk > 0 else None
            if node is not None:
                cast(RadixTree, self.tree).unlock(node)
            if new is None:
                self._wait_for_room(f"request {i} ({n} tokens)")
                continue
            full = torch.cat([slots[:m], new])
            self._issue(i, toks, m, m + chunk, full)
            res.computed_tokens += chunk
            self.stats.computed_tokens += chunk
            if m + chunk == n:
                break
        if isinstance(req, GenerateRequest):
            self._enqueue(i, req)
        else:
            for member in self.stats.members[i]:
                self._request_done(member)

    def _issue(self, i: int, toks: list[int], start: int, end: int, full: torch.Tensor) -> None:
        b = self._batch
        wanted = self._wanted(i, start, end)
        self._pending.update(k for _, k in wanted)
        if self.tree is not None:
            present, node = self.tree.insert(toks[:end], full)
            if present > start:  # we recompute tokens the tree already holds: free our copies after
                b.to_free.append(full[start:present])
            self.tree.lock(node)
            b.locks.append(node)
        else:
            self._own_slots[i] = full
        b.add(toks[start:end], start, full[start:end], full, wanted)

    def _alloc(self, n: int) -> torch.Tensor | None:
        """n slots, leaving free those promised to queued requests."""
        return self.pool.alloc(n) if self._make_free(n + self._queued_reserve) else None

    def _make_free(self, n: int) -> bool:
        """Whether n slots are free, after evicting unlocked cache if needed."""
        short = n - self.pool.num_free
        if short > 0 and self.tree is not None:
            # Evict in bulk: one scan of the tree per 1/16 of the pool, not per request. In DFS order
            # every node a later request needs is on the current (locked) path, so this loses no hit.
            self.stats.evicted_tokens += self.tree.evict(max(short, self.pool.num_slots // 16))
        return self.pool.num_free >= n

    def _wait_for_room(self, what: str) -> None:
        """Free pool space: run the pending prefill batch, admit queued requests, or decode."""
        if self._batch.num_tokens:
            self._flush()
        elif self._queue and len(self._running) < self.max_running:
            self._admit_queued()
        elif self._running:
            self._make_room()
        else:
            raise RuntimeError(f"KV pool of {self.pool.num_slots} tokens cannot hold {what}; raise kv_cache_tokens")

    def _flush(self) -> None:
        b = self._batch
        if b.num_tokens == 0:
            return
        fb = b.build().to(self.device)
        logits = self.model(fb, self.attn)
        self.stats.forward_batches += 1
        # Keep one batch in flight: the host schedules the next batch while the device runs this one.
        # Unlocking now is safe: later batches run after this one on the same stream.
        self._drain()
        if b.logit_keys:    # a prefill batch's keys (from _issue) are never None
            self._inflight.append(self._start_capture(cast("list[Key]", b.logit_keys), logits))
        for node in b.locks:    # locks are taken only with a tree
            cast(RadixTree, self.tree).unlock(node)
        for slots in b.to_free:
            self.pool.free(slots)
        self._batch = _Batch()
        if self.tree is None:  # without a cache, a scored request's slots die with its batch
            for i in [i for i in self._own_slots if not isinstance(self._requests[i], GenerateRequest)
                      and self._results[i].computed_tokens == len(self._requests[i].prompt)]:
                self.pool.free(self._own_slots.pop(i))

    def _start_capture(self, keys: list[Key], logits: torch.Tensor) -> _InFlight:
        """Reduce logits to what was asked for (logprobs of wanted tokens, argmax, rows to sample from)
        on the device, and start one copy of them to the host."""
        pairs = [(r, t) for r, key in enumerate(keys) for t in key[0].demands[key[1]] if t != FULL_ROW]
        logprobs = torch.log_softmax(logits, dim=-1)
        rows_idx = to_device(torch.tensor([r for r, _ in pairs], dtype=torch.int64), logits.device)
        toks_idx = to_device(torch.tensor([t for _, t in pairs], dtype=torch.int64), logits.device)
        reduced = torch.cat([logprobs[rows_idx, toks_idx], logits.argmax(dim=-1).float()])
        rows = {r: logits[r] for r, key in enumerate(keys) if FULL_ROW in key[0].demands[key[1]]}
        event = None
        if logits.device.type == "cuda":
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            reduced = host
        n = len(pairs)
        return _InFlight(keys, pairs, reduced[:n], reduced[n:], rows, event)

    def _drain(self) -> None:
        """Record the logits of every batch still in flight."""
        for f in self._inflight:
            if f.event is not None:
                f.event.synchronize()
            values, argmax = f.values.tolist(), f.argmax.tolist()
            for r, key in enumerate(f.keys):
                self._captured[key] = Captured(int(argmax[r]), {}, f.rows.get(r))
                self._pending.discard(key)
            for (r, t), v in zip(f.pairs, values):
                self._captured[f.keys[r]].logprobs[t] = v
        self._inflight = []

    def _request_done(self, i: int) -> None:
        if self._progress:
            self._progress(i, self.stats)

    def _finish_score(self, i: int, req: ScoreRequest) -> None:
        res = cast(ScoreResult, self._results[i])
        greedy, total = True, 0.0
        positions = self._score_positions(req)
        for node, p, t in zip(self._nodes_at(i, positions), positions, req.continuation):
            cap = self._captured[(node, p)]
            total += cap.logprobs[t]
            greedy &= cap.argmax == t
        res.logprob, res.num_tokens, res.is_greedy = total, len(req.continuation), greedy

    # ---- generation ------------------------------------------------------------------------
    def _enqueue(self, i: int, req: GenerateRequest) -> None:
        """Hold the prompt's KV, promise its decode slots, and queue it for a decode row."""
        n = len(req.prompt)
        reserve = max(req.params.max_new_tokens - 1, 0)
        while True:
            slots, node, _ = self._match(i, req.prompt)
            if node is not None:    # a node comes only from the tree
                cast(RadixTree, self.tree).lock(node)
            if self._make_free(self._queued_reserve + reserve):
                break
            if node is not None:
                cast(RadixTree, self.tree).unlock(node)
            self._wait_for_room(f"request {i} ({n} prompt + {reserve} new tokens)")
        if self.tree is None:
            slots = self._own_slots.pop(i)
        assert len(slots) >= n, "prompt KV must be in the pool"
        q = _Queued(i, node, slots[:n], reserve, (self._node_at(i, n - 1), n - 1))
        self._queue.append(q)
        self._unsampled.append(q)
        self._queued_reserve += reserve
        self._admit_queued()

    def _admit_queued(self) -> None:
        """Give free decode rows to queued requests whose prompt logits have been computed (those in
        the pending prefill batch wait for it, rather than run it small)."""
        while self._queue and len(self._running) < self.max_running:
            q = self._queue[0]
            if q.key in self._batch.logit_keys:
                break
            self._queue.popleft()
            self._queued_reserve -= q.reserve
            extra = self._alloc(q.reserve)
            assert extra is not None, "queued requests' decode slots are kept free"
            if q.run is None:
                q.run = self._new_run(q)
            q.run.slots = torch.cat([q.slots, extra])
            self._running.append(q.run)

    def _new_run(self, q: _Queued) -> _Running:
        req = cast(GenerateRequest, self._requests[q.index])
        return _Running(q.index, q.node, q.slots, len(q.slots), req.params, req.constraint)

    def _make_room(self) -> None:
        """Decode until a share of the running requests has finished: refilling after every single
        finish would add a prefill forward to nearly every step."""
        want = max(1, len(self._running) // REFILL_DIVISOR)
        done = 0
        while self._running and done < want:
            done += self._step()
            self._admit_queued()
        self._release_finished()

    def _decode_all(self) -> None:
        while self._running or self._queue:
            self._admit_queued()
            self._step()
        self._release_finished()

    def _step(self) -> int:
        """One decode step of every running request (after the first tokens of those that have none,
        from their prompt's logits); returns how many requests finished."""
        self._first_tokens()
        live = [r for r in self._running if not r.finish]
        logits = self._forward(live) if live else None
        self._release_finished()    # host work while the device computes the step
        if live:
            self._sample(live, cast(torch.Tensor, logits))
        done = [r for r in self._running if r.finish]
        if done:
            self._finished += done
            self._running = [r for r in self._running if not r.finish]
        return len(done)

    def _release_finished(self) -> None:
        for r in self._finished:
            self._release(r)
        self._finished = []

    def _first_tokens(self) -> None:
        """Sample the first token of every request whose prompt logits are computed and that has
        none yet, running or still queued (FIRST_TOKEN_ROWS queued ones at most), in one call: a
        wave's first step samples them all, and a later step that admits a request runs no extra
        sampling round (and device sync)."""
        fresh = [r for r in self._running if not r.out]
        queued: list[_Queued] = []
        if self._unsampled:
            pending = set(self._batch.logit_keys)   # logits of the prefill batch not launched yet
            waiting = [q for q in self._unsampled if q.run is None]
            ready = [q for q in waiting if q.key not in pending]
            queued = ready[:FIRST_TOKEN_ROWS]
            self._unsampled = ready[FIRST_TOKEN_ROWS:] + [q for q in waiting if q.key in pending]
        if not fresh and not queued:
            return
        self._drain()               # their prompts' logits were launched already
        for q in queued:
            q.run = self._new_run(q)
        rows = fresh + cast("list[_Running]", [q.run for q in queued])
        # a prompt's last position demands its FULL_ROW: its captured row is there
        logits = cast("list[torch.Tensor]",
                      [self._captured[(self._node_at(r.index, r.prompt_len - 1), r.prompt_len - 1)].row for r in rows])
        self._sample(rows, torch.stack(logits).to(self.device))

    def _forward(self, rows: list[_Running]) -> torch.Tensor:
        """Run each row's tokens that are not in the KV pool yet (one after a sampled token, several
        after a jump-forward); logits at each row's last token. On CUDA every token is one row of
        the decode graphs: a row's tokens sit at consecutive positions, and every layer stores all
        rows' KV before attending, so each token attends to those before it in the same step."""
        self.stats.forward_batches += 1
        if self.graphs is not None:
            toks, positions, seqs, last = [], [], [], []
            for r in rows:
                start = r.prompt_len + r.fed
                slots = r.slots.numpy()
                for j, t in enumerate(r.out[r.fed:]):
                    toks.append(t)
                    positions.append(start + j)
                    seqs.append(slots[:start + j + 1])
                last.append(len(toks) - 1)
                r.fed = len(r.out)
            return self.graphs.run(toks, positions, seqs, last)
        b = _Batch()
        for r in rows:
            start, end = r.prompt_len + r.fed, r.prompt_len + len(r.out)
            b.add(r.out[r.fed:], start, r.slots[start:end], r.slots[:end], [(end - 1, None)])
            r.fed = len(r.out)
        return self.model(b.build().to(self.device), self.attn)

    def _sample(self, rows: list[_Running], logits: torch.Tensor) -> None:
        """Pick each row's next token (within its grammar, if it has one) and append it.

        Masking only removes candidates and the sampling noise is fixed per (seed, step, token), so
        a grammar row's pick is the same whether its mask is applied before sampling or only after
        its grammar rejected the unconstrained pick. Rows masked ahead (`_mask_ahead`) sample once;
        every other grammar row first takes its unconstrained pick, and only the rejected ones fill a
        mask and pick again (a second round on the device)."""
        from lmbatch.grammar import accept_tokens
        grammar = [k for k, r in enumerate(rows) if r.constraint is not None]
        ahead = self._mask_ahead(rows, grammar, logits) if grammar else []
        tokens = sample(logits, [r.params for r in rows], [r.steps for r in rows])
        # the rows listed in `grammar` (and its subsets redo, must, chunk) have a constraint
        ok = accept_tokens(cast("list[Constraint]", [rows[k].constraint for k in grammar]),
                           [tokens[k] for k in grammar])
        redo = [k for k, a in zip(grammar, ok) if not a]
        for k, a in zip(grammar, ok):
            rows[k].rejected = not a
        if redo:
            from lmbatch.grammar import apply_mask, fill_masks
            bitmask = self._mask_rows(len(redo))[:len(redo)]
            fill_masks(cast("list[Constraint]", [rows[k].constraint for k in redo]), bitmask)
            sub = logits[to_device(torch.tensor(redo), logits.device)]
            apply_mask(sub, bitmask)
            picked = sample(sub, [rows[k].params for k in redo], [rows[k].steps for k in redo])
            accept_tokens(cast("list[Constraint]", [rows[k].constraint for k in redo]), picked)
            for k, t in zip(redo, picked):
                tokens[k] = t
        self.stats.masked_rows += len(ahead) + len(redo)
        self.stats.resampled_rows += len(redo)
        for r, t in zip(rows, tokens):
            r.steps += 1
            self._append(r, t)

    def _mask_ahead(self, rows: list[_Running], grammar: list[int], logits: torch.Tensor) -> list[int]:
        """Fill and apply the token masks of grammar rows before their first pick; returns those rows.

        Always the rows whose top-p nucleus depends on the mask, and every row with `masks="eager"`.
        With `masks="overlap"`, also as many rows as the host fills while the device is still
        computing `logits` (time it would otherwise spend waiting), those whose pick was rejected at
        their last step first: they skip the second round their rejection would cost."""
        from lmbatch.grammar import apply_mask, fill_masks
        must = [k for k in grammar if self.masks == "eager" or rows[k].params.top_p < 1.0]
        rest = [k for k in grammar if self.masks == "overlap" and rows[k].params.top_p >= 1.0]
        busy = self._device_busy(logits) if rest else None
        if not must and busy is None:
            return []
        bitmask = self._mask_rows(len(rows))
        if must:
            fill_masks(cast("list[Constraint]", [rows[k].constraint for k in must]), bitmask, must)
        ahead = list(must)
        if busy is not None:
            rest.sort(key=lambda k: not rows[k].rejected)
            i = 0
            while i < len(rest) and busy():
                chunk = rest[i:i + AHEAD_ROWS]
                fill_masks(cast("list[Constraint]", [rows[k].constraint for k in chunk]), bitmask, chunk)
                ahead += chunk
                i += len(chunk)
        if ahead:
            apply_mask(logits, bitmask[:len(rows)], rows=ahead)
        return ahead

    def _device_busy(self, logits: torch.Tensor) -> Callable[[], bool] | None:
        """A probe: is the device still computing `logits`? None where the host cannot overlap it."""
        if logits.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return lambda: not event.query()

    def _mask_rows(self, n: int) -> torch.Tensor:
        """A CPU bitmask of at least n rows, reused across steps (pinned: it goes to the device
        without a blocking copy; it is written only after a sampling sync has waited for the last one)."""
        from lmbatch.grammar import allocate_bitmask
        if self._mask_buf is None or len(self._mask_buf) < n:
            buf = allocate_bitmask(max(n, 2 * self.max_running), self.cfg.vocab_size)
            self._mask_buf = buf.pin_memory() if self.device.type == "cuda" else buf
        return self._mask_buf

    def _append(self, r: _Running, token: int) -> None:
        """Add a sampled token (its grammar has accepted it) and see whether the request is done."""
        r.out.append(token)
        p = r.params
        if not p.ignore_eos and token in self.cfg.eos_token_ids:
            r.finish = "eos"
        elif r.constraint is not None and token in r.constraint.stops and r.constraint.is_terminated():
            r.finish = "eos"                                            # the grammar's own stop token
        elif p.stop and self.tokenizer is not None and any(s in self.tokenizer.decode(r.out) for s in p.stop):
            r.finish = "stop"
        elif len(r.out) >= p.max_new_tokens:
            r.finish = "length"
        elif r.constraint is not None and self.jump_forward:
            self._jump(r)

    def _jump(self, r: _Running) -> None:
        """Append the text the grammar forces, retokenized at the boundary, without decoding it; and
        end the output there if the grammar then admits nothing but its stop token."""
        c = cast("Constraint", r.constraint)    # _append jumps only rows with a grammar
        forced = c.jump_forward()
        if forced:          # most steps force nothing: checked before any other work, for every grammar row
            from lmbatch.grammar import retokenize_jump

            new, n = retokenize_jump(self.tokenizer, c, r.out, forced, memo=self._retok_memo)
            if new or n:
                r.fed = min(r.fed, len(r.out) - n)
                r.out = r.out[:len(r.out) - n] + new
                r.jumped += len(new)
                if len(r.out) >= r.params.max_new_tokens:
                    r.out, r.finish = r.out[:r.params.max_new_tokens], "length"
                    return
        stop = c.forced_stop()
        if stop is not None and c.accept(stop):     # the stop token would be the only pick
            r.out.append(stop)
            r.jumped += 1
            r.finish = "eos"

    def _release(self, r: _Running) -> None:
        """Insert prompt + output into the tree (so later calls extending it hit), free the rest."""
        fed = r.prompt_len + min(r.fed, len(r.out) - 1)    # the last token was never run
        if self.tree is not None:
            toks = list(self._requests[r.index].prompt) + r.out[:fed - r.prompt_len]
            present, _ = self.tree.insert(toks, r.slots[:fed])
            self.pool.free(r.slots[r.prompt_len:present])
            self.pool.free(r.slots[fed:])
            self.tree.unlock(cast(Node, r.node))   # with a tree, _match always gives a node
        else:
            self.pool.free(r.slots)
        res = cast(GenerateResult, self._results[r.index])
        res.token_ids, res.finish_reason, res.decode_tokens = r.out, r.finish, len(r.out)
        res.steps, res.jumped_tokens = r.steps, r.jumped
        if r.constraint is not None:
            res.grammar_complete = r.constraint.is_terminated() or r.constraint.is_completed()
        if self.tokenizer is not None:
            res.text = self.tokenizer.decode(r.out[:-1] if r.finish == "eos" else r.out)
            if r.finish == "stop":
                cut = min(res.text.find(s) for s in r.params.stop if s in res.text)
                res.text = res.text[:cut]
        self.stats.decode_tokens += len(r.out)
        self._request_done(r.index)
