"""Logit capture: which positions need logits, and what is kept of them.

Before a run, every position some request scores or samples from becomes a demand on the plan node
holding it (the tokens whose logprobs are wanted, or FULL_ROW to sample). A prefill batch computes
logits only at demanded positions nobody has captured yet, whichever request happens to compute
them; after its forward pass they are reduced on the device (logprobs of the demanded tokens, the
argmax, the rows to sample from) and copied to the host while the next batch is being built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import torch

from lmbatch.attention import to_device
from lmbatch.engine.state import FULL_ROW, Captured, Key, RunState, score_positions
from lmbatch.requests import ScoreRequest, ScoreResult


@dataclass
class _InFlight:
    """Logits of a launched batch, reduced on the device and on their way to the host."""
    keys: list[Key]
    pairs: list[tuple[int, int]]    # (row, target token) for each value
    values: torch.Tensor            # logprob of each pair
    argmax: torch.Tensor
    rows: dict[int, torch.Tensor]   # full logits rows, for sampling
    event: torch.cuda.Event | None


class LogitCapture:
    def __init__(self, state: RunState):
        self.state = state
        self.captured: dict[Key, Captured] = {}
        self.pending: set[Key] = set()      # issued to a batch, not captured yet
        self.unlaunched: set[Key] = set()   # of those, in the prefill batch being built
        self._inflight: list[_InFlight] = []
        self._positions: dict[int, list[int]] = {}
        self._register_demands()

    def _register_demands(self) -> None:
        s = self.state
        for i, r in enumerate(s.requests):
            if isinstance(r, ScoreRequest):
                positions = score_positions(r)
                for node, p, t in zip(s.nodes_at(i, positions), positions, r.continuation):
                    wanted = node.demands.get(p)
                    if wanted is None:
                        node.demands[p] = {t}
                    else:
                        wanted.add(t)
            else:
                node, p = s.prompt_key(i)
                node.demands.setdefault(p, set()).add(FULL_ROW)

    # ---- what a batch computes ---------------------------------------------------------------
    def wanted(self, i: int, start: int, end: int) -> list[tuple[int, Key]]:
        """Demanded positions in [start, end) of request i's path that nobody has captured yet."""
        out = []
        for node in self.state.paths[i]:
            if node.end <= start or node.start >= end:
                continue
            for p in node.demands:
                key = (node, p)
                if start <= p < end and key not in self.captured and key not in self.pending:
                    out.append((p, key))
        return out

    def issue(self, keys: list[Key]) -> None:
        """These positions' logits are computed by the prefill batch being built."""
        self.pending.update(keys)
        self.unlaunched.update(keys)

    def first_missing(self, j: int, end: int) -> int:
        """Lowest position below `end` where executed request j needs logits that are neither captured
        nor on their way (only after an earlier call left them in the cache); `end` if none."""
        positions = [p for p in self._own_positions(j) if p < end]
        for node, p in zip(self.state.nodes_at(j, positions), positions):
            key = (node, p)
            if key not in self.captured and key not in self.pending:
                return p
        return end

    def _own_positions(self, j: int) -> list[int]:
        """Positions where executed request j (and the requests merged into it) need logits."""
        if j not in self._positions:
            out: set[int] = set()
            for i in self.state.stats.members[j]:
                r = self.state.requests[i]
                out.update(score_positions(r) if isinstance(r, ScoreRequest) else [len(r.prompt) - 1])
            self._positions[j] = sorted(out)
        return self._positions[j]

    # ---- after a forward pass ------------------------------------------------------------------
    def launch(self, keys: list[Key], logits: torch.Tensor) -> None:
        """Reduce a prefill batch's logits (one row per key) to what was asked for on the device, and
        start one copy of them to the host. The batch's earlier in-flight logits are recorded first:
        one batch stays in flight while the host builds the next."""
        self.drain()
        self.unlaunched.clear()
        if keys:
            self._inflight.append(self._reduce(keys, logits))

    def _reduce(self, keys: list[Key], logits: torch.Tensor) -> _InFlight:
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

    def drain(self) -> None:
        """Record the logits of every batch still in flight."""
        for f in self._inflight:
            if f.event is not None:
                f.event.synchronize()
            values, argmax = f.values.tolist(), f.argmax.tolist()
            for r, key in enumerate(f.keys):
                self.captured[key] = Captured(int(argmax[r]), {}, f.rows.get(r))
                self.pending.discard(key)
            for (r, t), v in zip(f.pairs, values):
                self.captured[f.keys[r]].logprobs[t] = v
        self._inflight = []

    def row(self, key: Key) -> torch.Tensor:
        """The captured logits row of a position some request samples from (it demanded FULL_ROW)."""
        return cast(torch.Tensor, self.captured[key].row)

    def finish_scores(self, indices: Sequence[int] | None = None) -> None:
        """Sum each score request's continuation logprobs (of those in `indices`, else of all; every
        batch they were issued to has been drained)."""
        s = self.state
        for i in range(len(s.requests)) if indices is None else indices:
            req = s.requests[i]
            if not isinstance(req, ScoreRequest):
                continue
            res = cast(ScoreResult, s.results[i])
            greedy, total = True, 0.0
            positions = score_positions(req)
            for node, p, t in zip(s.nodes_at(i, positions), positions, req.continuation):
                cap = self.captured[(node, p)]
                total += cap.logprobs[t]
                greedy &= cap.argmax == t
            res.logprob, res.num_tokens, res.is_greedy = total, len(req.continuation), greedy
