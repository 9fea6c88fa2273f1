"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step of B sequences (one new token each) is launch-bound: dozens of small kernels per layer.
Each bucket's whole forward is captured once over static input buffers and replayed; attention
inside the graph is our Triton decode kernel (a KV head's query heads together; split over key ranges
where rows are few), or in large buckets the cascade kernel (rows' shared radix-tree levels read once
per block of rows), which read their metadata (kv_indptr, kv_indices, level tables) from device buffers
refreshed before each replay. A step of a cascade bucket whose rows share no level replays that
bucket's plain-decode graph instead (captured when first needed): the empty level machinery cost 0.3 ms
a step (1.5B, 256 rows, H200). A batch is padded up to its bucket: padding rows read and write one
scratch KV slot that the pool never hands out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from lmbatch.attention.base import AttentionBackend, ForwardBatch, no_sinks, to_device
from lmbatch.engine.cascade import LevelPlan, plan_levels, replan
from lmbatch.engine.radix_cache import Node
from lmbatch.engine.slot_arena import SlotArena, gather, row_deltas

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from lmbatch.attention.kv_pool import KVPool
    from lmbatch.kernels.cascade_attention import CascadeLevels
    from lmbatch.model.network import Transformer

# steps of 8 rows up to 32, of 4 up to 64, then of 16, 32, 64: a step's rows grow past its requests by
# the tokens that jump-forward appended (32 requests: ~41 rows), and a large model's step costs about
# what its padded rows cost (8B shape, H200: 5.97 ms at 40 rows, 6.25 ms at 48)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
           448, 512, 640, 768, 896, 1024)


class _GraphAttention(AttentionBackend):
    """Triton decode attention over static device buffers (no host work inside the graph): the cascade
    kernel where the graphs keep shared levels (a layer without a sliding window), else plain decode."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None, softcap: float,
                 tables: tuple[torch.Tensor, torch.Tensor, CascadeLevels | None]) -> None:
        super().__init__(pool, num_heads, head_dim, scale, softcap)
        self.kv, self.kv_indices, self.levels = tables
        self.qo: torch.Tensor | None = None     # deterministic mode: each row's query offsets (0, 1, .., rows)
        self.cascade_from = 1                   # buckets of fewer rows attend with plain decode

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        from lmbatch.kernels.cascade_attention import cascade_attention
        from lmbatch.kernels.decode_attention import decode_attention

        self.store(layer, k, v)
        if self.qo is not None:         # deterministic: a query's keys in the same blocks whatever the batch
            from lmbatch.kernels.extend_attention import extend_attention

            return extend_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices,
                                    self.qo[:q.shape[0] + 1], self.kv, 1, self.scale, window, self.softcap, True,
                                    sinks)
        if self.levels is not None and window is None and q.shape[0] >= self.cascade_from:
            no_sinks("cascade", sinks)          # ModelRunner keeps a model with sinks off the cascade kernel
            return cascade_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.kv, self.scale,
                                     self.softcap, self.levels)
        return decode_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.kv, self.scale,
                                window, self.softcap, sinks=sinks)


class DecodeGraphs:
    def __init__(self, model: Transformer, pool: KVPool, scratch_slot: int, max_batch: int,
                 ahead: int | None = None) -> None:
        """Buffers for steps of up to `max_batch` rows; the graphs of buckets up to `ahead` (default: all)
        captured by `capture_all` and compiled ahead by `variants`' helpers, the larger ones once a run asks
        for them (`capture_all(upto)`: a stream of wide rows, engine/stream.py)."""
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        dev = pool.k.device
        self.buckets = [b for b in BUCKETS if b <= max(max_batch, 1)]
        n = self.buckets[-1]
        self.ahead = min(ahead, n) if ahead is not None else n
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_slots = torch.full((n,), scratch_slot, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # at least a slot per row of the largest bucket: a capture's rows read one index each
        self.kv_indices = torch.full((max(pool.num_slots, n),), scratch_slot, dtype=torch.int32, device=dev)
        self.iota = torch.arange(len(self.kv_indices), dtype=torch.int64, device=dev)
        self.arena = SlotArena(scratch_slot, dev)      # rows' slot lists, sent once (engine/slot_arena.py)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # every graph input must outlive capture
        # (bucket, attends with the level tables) -> the graph and its logits
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_handle: _POOL_HANDLE | None = None
        # a step's inputs are written into pinned host memory and copied from there without waiting:
        # two buffers in turn, each written again only once its last copy is done (its event)
        self._staged: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.levels: CascadeLevels | None = None    # cascade attention's tables (`use_cascade`)
        self.cascade_from = 1                       # the smallest bucket that attends with them
        self.deterministic = False      # attend with the extend kernel (ModelRunner sets it before any capture)
        self.qo = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._plan: tuple[list[Node | None], LevelPlan | None] = ([], None)

    def use_cascade(self, every_step: bool) -> None:
        """Attend with the cascade kernel (before any capture), where a block of rows holds 2 or more rows'
        query heads (a KV head has at most 32 of them): its shared-level tables. `every_step`: in every
        bucket's graph (`--attention cascade`); else in buckets whose rows fill the GPU on their own
        (decode_attention.WHOLE_FROM programs), where it was measured faster than plain decode whether
        rows share keys or not (BENCHMARKS.md, issue 55's step table); smaller steps run plain decode."""
        from lmbatch.kernels.cascade_attention import CascadeLevels, rows_per_block
        from lmbatch.kernels.decode_attention import WHOLE_FROM

        cfg = self.model.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        if rows_per_block(group) >= 2:
            self.levels = CascadeLevels(len(self.rows), group, self.pool.k.device)
            self.cascade_from = 1 if every_step else -(-WHOLE_FROM // cfg.num_kv_heads)

    def _level_plan(self, ends: list[Node | None] | None) -> LevelPlan | None:
        """The step's shared levels: the last step's where its rows' prompts end in the same nodes, made from
        them where few rows are new (cascade.replan), else planned anew."""
        if self.levels is None or not ends or next(b for b in self.buckets if b >= len(ends)) < self.cascade_from:
            return None     # no levels, or a bucket that attends with plain decode
        from lmbatch.kernels.cascade_attention import LEVELS

        last, plan = self._plan
        if len(last) != len(ends) or any(a is not b for a, b in zip(last, ends)):
            per_block, max_blocks = self.levels.per_block, self.levels.max_blocks
            plan = (plan is not None and replan(ends, plan, per_block, max_blocks)) or \
                plan_levels(ends, per_block, LEVELS, max_blocks)
            self._plan = (list(ends), plan)
        return plan

    def _staging(self, size: int) -> torch.Tensor:
        """`size` int64 of pinned host memory for this step's inputs (a fresh array each step cost its
        page faults and a second copy into pinned memory: 5 ms a step at 512 rows of ~1,000 slots)."""
        self._turn = k = 1 - self._turn
        done = self._copied[k]
        if done is not None:
            done.synchronize()
        buf = self._staged[k]
        if buf is None or len(buf) < size:
            buf = self._staged[k] = torch.empty(size + size // 2, dtype=torch.int64).pin_memory()
        return buf[:size]

    def capture_all(self, upto: int | None = None) -> None:
        """Capture every bucket up to `ahead` now (`upto` raises it for good: a capture after the buffers
        grow takes those too), largest first (the others reuse its memory), so that no step pays for a
        capture."""
        self.ahead = max(self.ahead, min(upto, self.buckets[-1])) if upto is not None else self.ahead
        for b in reversed(self.buckets):
            key = (b, self._cascades(b))
            if b <= self.ahead and key not in self.graphs:
                self._capture(*key)

    def _cascades(self, b: int) -> bool:
        """Whether bucket b's graph attends with the level tables where its rows share levels."""
        return self.levels is not None and b >= self.cascade_from

    def variants(self) -> list[tuple[int, bool]]:
        """Every graph a run may replay, largest bucket first: each bucket's, and a cascade bucket's
        plain-decode graph (for steps whose rows share no level)."""
        return [(b, c) for b in reversed(self.buckets) if b <= self.ahead
                for c in ((True, False) if self._cascades(b) else (False,))]

    def warm(self, b: int, cascade: bool) -> None:
        """Run graph (b, cascade)'s forward once, uncaptured: its kernels compiled (engine/precompile.py)."""
        self.model(*self._inputs(b, cascade), float_logits=False)

    def _inputs(self, b: int, cascade: bool) -> tuple[ForwardBatch, _GraphAttention]:
        """Graph (b, cascade)'s batch over the static buffers, set to harmless inputs, and its attention."""
        cfg = self.model.cfg
        attn = _GraphAttention(self.pool, cfg.num_heads, cfg.head_dim, cfg.attn_scale, cfg.attn_softcap,
                               (self.kv_indptr[:b + 1], self.kv_indices, self.levels if cascade else None))
        attn.qo = self.qo if self.deterministic else None
        attn.cascade_from = self.cascade_from
        batch = ForwardBatch(self.ids[:b], self.pos[:b], self.out_slots[:b], [], [], self.kv_indices, self.rows[:b])
        # the capture's forwards store their rows' KV: into the scratch slot, not the slots of the step
        # that last filled these buffers (a capture mid-run, of a bucket first needed then or after the
        # pool grew, overwrote those tokens' cached KV with what a one-key context gives)
        self.out_slots[:b] = self.scratch
        self.ids[:b], self.pos[:b] = 0, 0
        self.kv_indptr[:b + 1] = torch.arange(b + 1, dtype=torch.int32, device=self.ids.device)
        if cascade and self.levels is not None:     # each replay loads its step's tables again
            self.levels.clear()
        return batch, attn

    def _capture(self, b: int, cascade: bool) -> None:
        batch, attn = self._inputs(b, cascade)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton JIT and allocator, outside the capture
                self.model(batch, attn, float_logits=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_handle):
            # the LM head's logits as they come (bf16: a step's sampler reads them, no float32 copy)
            logits = self.model(batch, attn, float_logits=False)
        self.pool_handle = graph.pool()
        self.graphs[b, cascade] = (graph, logits)

    def run(self, tokens: list[int], positions: list[int], seqs: list, rows: list[int] | None = None,
            pending: tuple[np.ndarray, torch.Tensor] | None = None, ends: list[Node | None] | None = None
            ) -> torch.Tensor:
        """One decode step: token t of row i sits at positions[i]; seqs[i] (a 1-D int array, unchanged while
        rows pass it) holds its KV slots from the sequence's start, of which those up to and including that
        position are read (an array passed at an earlier step is not sent to the device again: slot_arena.py).
        Rows may be consecutive tokens of one sequence (each stores its KV before any attends). `pending` =
        (src, device tokens): row i's token is tokens[src[i]] where src[i] >= 0 (sampled by the last step,
        never seen by the host). `ends`: the tree node where row i's prompt ends (its first keys are that
        node's path), for the shared levels of cascade attention. Returns the logits [len(rows), vocab] of the
        rows asked for (default: all), in the model's dtype where it soft-caps none (Transformer.forward's
        float_logits): a view of the graph's output when those are all its rows of one replay (valid until the
        next: graphs share their memory), else a copy. Past the largest bucket captured ahead (`ahead`), rows
        run in order in several replays."""
        cap = max(b for b in self.buckets if b <= self.ahead)      # the largest graph a step may replay
        if rows is None and len(tokens) <= cap:     # every row's logits, of one replay: a view
            return self._replay(tokens, positions, seqs, pending, self._level_plan(ends))
        rows = list(range(len(tokens))) if rows is None else rows
        parts = []
        for lo in range(0, len(tokens), cap):
            hi = lo + cap
            feed = (pending[0][lo:hi], pending[1]) if pending is not None else None
            logits = self._replay(tokens[lo:hi], positions[lo:hi], seqs[lo:hi], feed,
                                  self._level_plan(ends[lo:hi] if ends is not None else None))
            mine = [r - lo for r in rows if lo <= r < hi]
            if mine == list(range(len(logits))) and len(tokens) <= cap:
                parts.append(logits)        # the only replay: nothing overwrites it before the caller reads it
            elif mine:
                parts.append(logits[to_device(torch.tensor(mine), logits.device)])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _replay(self, tokens: list[int], positions: list[int], seqs: list,
                pending: tuple[np.ndarray, torch.Tensor] | None, plan: LevelPlan | None) -> torch.Tensor:
        n = len(tokens)
        b = next(x for x in self.buckets if x >= n)
        key = (b, self._cascades(b) and plan is not None)
        if key not in self.graphs:
            self._capture(*key)
        lens = np.ones(b, dtype=np.int64)      # padding rows: one key, the scratch slot
        lens[:n] = positions
        lens[:n] += 1       # a row's keys: its slots up to and including its position's
        total = int(lens.sum())
        if total > len(self.kv_indices):  # shared prefixes counted per sequence: grow, recapture
            self.kv_indices = torch.full((2 * total,), self.scratch, dtype=torch.int32, device=self.ids.device)
            self.iota = torch.arange(len(self.kv_indices), dtype=torch.int64, device=self.ids.device)
            self.graphs.clear()
            self.pool_handle = None     # the graphs' memory pool went with them: capturing into it asserts
            self.capture_all()
            return self._replay(tokens, positions, seqs, pending, plan)
        placed = self.arena.place(seqs)
        assert (placed.sizes >= lens[:n]).all(), "a row's slots end before its position"
        fresh = sum(len(s) for s in placed.fresh)
        levels = level_size(b, plan, self.levels.per_block) if self.levels is not None and key[1] else 0
        # host: one int64 array [ids | positions | deltas | lens | kv_indptr | src | fresh slots | levels], one copy
        staged = self._staging(4 * b + b + 1 + b + fresh + levels)
        host = staged.numpy()
        ids, pos, delta, ln, indptr, src, new, lv = np.split(host, np.cumsum([b, b, b, b, b + 1, b, fresh]))
        ids[:n], ids[n:] = tokens, 0
        pos[:n], pos[n:] = positions, 0
        src[:n], src[n:] = (pending[0] if pending is not None else -1), -1
        ln[:] = lens
        indptr[0] = 0
        np.cumsum(lens, out=indptr[1:])
        delta[:] = row_deltas(placed.offsets, indptr)
        if fresh:
            np.concatenate(placed.fresh, out=new, casting="unsafe")
        if levels:
            stage_levels(lv, b, plan, indptr)
        dev = staged.to(self.ids.device, non_blocking=True)
        copied = self._copied[self._turn] = torch.cuda.Event()
        copied.record()
        at = np.cumsum([b, b, b, b, b + 1, b, fresh])
        self.arena.write(placed, dev[at[5]:at[6]])
        self.ids[:b], self.pos[:b] = dev[:b], dev[b:2 * b]
        self.kv_indptr[:b + 1] = dev[at[3]:at[4]]
        gather(self.arena.buffer, dev[at[1]:at[2]], dev[at[2]:at[3]], total, self.iota, self.kv_indices)
        self.out_slots[:b] = self.kv_indices[dev[at[3] + 1:at[4]] - 1]     # each row's last key: its new token's
        if pending is not None:         # the last step's tokens, where they are
            s = dev[at[4]:at[5]]
            self.ids[:b] = torch.where(s >= 0, pending[1][s.clamp(min=0)], self.ids[:b])
        if levels:
            load_levels(cast("CascadeLevels", self.levels), dev[at[6]:], b, plan)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]


def level_size(b: int, plan: LevelPlan | None, per_block: int) -> int:
    """int64s a step's level tables take in the staged inputs: [skip b | levels b | blocks 1 | table | rows]."""
    return 2 * b + 1 + (plan.num_blocks * (4 + per_block) if plan is not None else 0)


def stage_levels(host: np.ndarray, b: int, plan: LevelPlan | None, indptr: np.ndarray) -> None:
    """A step's level tables into `host` (level_size int64s), for a bucket of b rows whose keys start at
    indptr; no plan: no levels (every row's keys its own)."""
    host[:2 * b + 1] = 0
    if plan is not None:
        n, nb = len(plan.skip), plan.num_blocks
        host[:n], host[b:b + n], host[2 * b] = plan.skip, plan.levels, nb
        host[2 * b + 1:2 * b + 1 + 4 * nb] = plan.table(indptr).reshape(-1)
        host[2 * b + 1 + 4 * nb:] = plan.rows.reshape(-1)


def load_levels(levels: CascadeLevels, staged: torch.Tensor, b: int, plan: LevelPlan | None) -> None:
    """The staged tables (on the device) into the graphs' level buffers."""
    nb = 0 if plan is None else plan.num_blocks
    levels.skip[:b], levels.levels[:b], levels.n_blocks[:] = staged[:b], staged[b:2 * b], staged[2 * b:2 * b + 1]
    if nb:
        levels.blocks[:nb] = staged[2 * b + 1:2 * b + 1 + 4 * nb].view(nb, 4)
        levels.block_rows[:nb] = staged[2 * b + 1 + 4 * nb:].view(nb, levels.per_block)
