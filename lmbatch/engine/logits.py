"""Logit capture: which positions need logits, and what is kept of them.

Before a run, every position some request scores or samples from becomes a numbered key: a position
of the plan's tree (a node and a depth), so requests that share it share its logits. A key has the
tokens whose logprobs are wanted there, or keeps its whole row (a generation samples from it). A
prefill batch computes logits only at keys nobody has captured yet, whichever request happens to
compute them; after its forward pass they are reduced on the device (the wanted tokens' logprobs, the
argmax, the rows to sample from) and copied to the host while the next batch is built.

A run scores up to a million positions (HellaSwag: 40k requests of ~25 scored tokens), so the keys,
their state and what was captured are numpy arrays, handled a batch or a request at a time, never
a position at a time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence, cast

import numpy as np
import torch

from lmbatch.attention.base import to_device
from lmbatch.engine.state import RunState, score_positions
from lmbatch.requests import ScoreRequest, ScoreResult

NOT_ISSUED, PENDING, CAPTURED = 0, 1, 2


@dataclass
class _InFlight:
    """Logits of a launched batch, reduced on the device and on their way to the host."""
    keys: np.ndarray                # the key of each logits row
    pairs: np.ndarray               # the (key, token) pair of each logprob value
    values: torch.Tensor            # logprob of each pair
    argmax: torch.Tensor            # of each row
    rows: dict[int, torch.Tensor]   # key -> its whole logits row (to sample from)
    event: torch.cuda.Event | None


@dataclass
class _Demands:
    """Every demanded position of a run, numbered: key k is position `pos[k]` of plan node `node_of[k]`;
    its wanted tokens are pair_tgt[pair_ptr[k]:pair_ptr[k + 1]]; `whole[k]`: its row is kept."""
    pos: np.ndarray
    pair_ptr: np.ndarray
    pair_tgt: np.ndarray
    whole: np.ndarray
    node_pos: dict[int, np.ndarray]     # id(plan node) -> its keys' positions, ascending
    node_key: dict[int, np.ndarray]     # id(plan node) -> those keys
    req_ptr: np.ndarray                 # request i's positions, ascending: req_*[req_ptr[i]:req_ptr[i + 1]]
    req_key: np.ndarray
    req_tgt: np.ndarray
    req_pair: np.ndarray
    prompt_key: dict[int, int]          # generation request -> the key of its prompt's last position


def _demands(state: RunState, first: int = 0) -> _Demands:
    """Number the demanded positions and wanted tokens of the run's requests from `first` on (see
    `_Demands`; request indices in it count from `first`, those of `prompt_key` are the run's)."""
    nodes: dict[int, int] = {}
    # a segment: the positions of one request in one node of its path
    seg_node, seg_lo, seg_len, seg_req, targets = [], [], [], [], []
    requests = state.requests[first:]
    for i, r in enumerate(requests, first):
        if isinstance(r, ScoreRequest):
            positions = score_positions(r)
            lo, hi, tokens = positions.start, positions.stop, r.continuation
        else:
            lo = len(r.prompt) - 1
            hi, tokens = lo + 1, [-1]                                   # -1: the whole row
        for plan_node in state.paths[i]:
            a, b = max(lo, plan_node.start), min(hi, plan_node.end)
            if a < b:
                seg_node.append(nodes.setdefault(id(plan_node), len(nodes)))
                seg_lo.append(a)
                seg_len.append(b - a)
                seg_req.append(i - first)
                targets.append(tokens[a - lo:b - lo])
    lens = np.asarray(seg_len, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    node = np.repeat(np.asarray(seg_node, dtype=np.int64), lens)
    req = np.repeat(np.asarray(seg_req, dtype=np.int64), lens)
    pos = np.repeat(np.asarray(seg_lo, dtype=np.int64) - starts, lens) + np.arange(int(lens.sum()))
    tgt = np.fromiter(itertools.chain.from_iterable(targets), dtype=np.int64, count=int(lens.sum()))
    node_ids = [0] * len(nodes)
    for node_id, n in nodes.items():
        node_ids[n] = node_id
    width = int(pos.max()) + 1 if len(pos) else 1
    uniq, key = np.unique(node * width + pos, return_inverse=True)
    vocab = int(tgt.max()) + 2 if len(tgt) else 1
    pairs, pair = np.unique(key * vocab + (tgt + 1), return_inverse=True)
    pair_key, pair_tgt = pairs // vocab, pairs % vocab - 1
    pair_ptr = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(np.bincount(pair_key, minlength=len(uniq)), out=pair_ptr[1:])
    whole = np.zeros(len(uniq), dtype=bool)
    whole[pair_key[pair_tgt < 0]] = True
    key_node, key_pos = uniq // width, uniq % width
    bounds = np.searchsorted(key_node, np.arange(len(nodes) + 1))
    req_ptr = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(np.bincount(req, minlength=len(requests)), out=req_ptr[1:])
    gens = [i for i, r in enumerate(requests) if not isinstance(r, ScoreRequest)]
    return _Demands(key_pos, pair_ptr, pair_tgt, whole,
                    {node_ids[n]: key_pos[bounds[n]:bounds[n + 1]] for n in range(len(nodes))},
                    {node_ids[n]: np.arange(bounds[n], bounds[n + 1]) for n in range(len(nodes))},
                    req_ptr, key, tgt, pair, {first + i: int(key[req_ptr[i]]) for i in gens})


class _Growing:
    """An array appended to in place (its room doubled when it runs out), read as what `append` returns."""

    def __init__(self, a: np.ndarray):
        self.buf, self.n = a, len(a)

    def append(self, x: np.ndarray) -> np.ndarray:
        """`x` appended; the whole array now (a view that the next growth replaces)."""
        need = self.n + len(x)
        if need > len(self.buf):
            buf = np.empty(max(need, 2 * len(self.buf)), dtype=self.buf.dtype)
            buf[:self.n] = self.buf[:self.n]
            self.buf = buf
        self.buf[self.n:need] = x
        self.n = need
        return self.buf[:need]


# the arrays of `_Demands` and of `LogitCapture` that grow as requests join a running stream
_KEYED = ("status", "unlaunched", "argmax")


class LogitCapture:
    def __init__(self, state: RunState):
        self.state = state
        self.d = _demands(state)
        k = len(self.d.pos)
        self.status = np.zeros(k, dtype=np.int8)        # NOT_ISSUED, PENDING or CAPTURED
        self.unlaunched = np.zeros(k, dtype=bool)       # issued to the prefill batch being built
        self.argmax = np.zeros(k, dtype=np.int64)
        self.logprob = np.zeros(len(self.d.pair_tgt), dtype=np.float64)
        self.rows: dict[int, torch.Tensor] = {}
        self._inflight: list[_InFlight] = []
        self._own: dict[int, np.ndarray] = {}
        self._growing: dict[str, _Growing] | None = None     # made when requests first join (`extend`)

    def extend(self, first: int) -> None:
        """The run's requests from `first` on joined it (`RunState.extend`): number their demands after
        the run's (their plan is their own, so they share no key with the requests before them)."""
        new, d = _demands(self.state, first), self.d
        keys, pairs, positions = len(d.pos), len(d.pair_tgt), len(d.req_key)
        if self._growing is None:
            fields = ("pos", "pair_ptr", "pair_tgt", "whole", "req_ptr", "req_key", "req_tgt", "req_pair")
            self._growing = {f: _Growing(getattr(d, f)) for f in fields}
            self._growing.update({f: _Growing(getattr(self, f)) for f in (*_KEYED, "logprob")})
        g = self._growing
        d.pos = g["pos"].append(new.pos)
        d.pair_ptr = g["pair_ptr"].append(new.pair_ptr[1:] + pairs)
        d.pair_tgt = g["pair_tgt"].append(new.pair_tgt)
        d.whole = g["whole"].append(new.whole)
        d.node_pos.update(new.node_pos)
        d.node_key.update({node: k + keys for node, k in new.node_key.items()})
        d.req_ptr = g["req_ptr"].append(new.req_ptr[1:] + positions)
        d.req_key = g["req_key"].append(new.req_key + keys)
        d.req_tgt = g["req_tgt"].append(new.req_tgt)
        d.req_pair = g["req_pair"].append(new.req_pair + pairs)
        d.prompt_key.update({i: k + keys for i, k in new.prompt_key.items()})
        for f in _KEYED:
            setattr(self, f, g[f].append(np.zeros(len(new.pos), dtype=g[f].buf.dtype)))
        self.logprob = g["logprob"].append(np.zeros(len(new.pair_tgt), dtype=np.float64))

    def prompt_key(self, i: int) -> int:
        """The key generation request i's first token is sampled from: its prompt's last position."""
        return self.d.prompt_key[i]

    # ---- what a batch computes ---------------------------------------------------------------
    def wanted(self, i: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, keys) in [start, end) of request i's path that nobody has issued yet."""
        positions, keys = [], []
        for node in self.state.paths[i]:
            if node.end <= start or node.start >= end or id(node) not in self.d.node_pos:
                continue
            npos = self.d.node_pos[id(node)]
            lo, hi = np.searchsorted(npos, (start, end))
            kk = self.d.node_key[id(node)][lo:hi]
            free = self.status[kk] == NOT_ISSUED
            positions.append(npos[lo:hi][free])
            keys.append(kk[free])
        if not keys:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return (positions[0], keys[0]) if len(keys) == 1 else (np.concatenate(positions), np.concatenate(keys))

    def issue(self, keys: np.ndarray) -> None:
        """These positions' logits are computed by the prefill batch being built."""
        self.status[keys] = PENDING
        self.unlaunched[keys] = True

    def first_missing(self, j: int, end: int) -> int:
        """Lowest position below `end` where executed request j needs logits that are neither captured
        nor on their way (only after an earlier call left them in the cache); `end` if none."""
        keys = self._own_keys(j)
        missing = keys[(self.d.pos[keys] < end) & (self.status[keys] == NOT_ISSUED)]
        return int(self.d.pos[missing[0]]) if len(missing) else end

    def _own_keys(self, j: int) -> np.ndarray:
        """The keys executed request j (and the requests merged into it) need, by position."""
        if j not in self._own:
            d, members = self.d, self.state.stats.members[j]
            if len(members) == 1:       # a request's own keys are by position already
                self._own[j] = d.req_key[d.req_ptr[j]:d.req_ptr[j + 1]]
            else:
                keys = np.unique(np.concatenate([d.req_key[d.req_ptr[m]:d.req_ptr[m + 1]] for m in members]))
                self._own[j] = keys[np.argsort(d.pos[keys], kind="stable")]
        return self._own[j]

    # ---- after a forward pass ------------------------------------------------------------------
    def launch(self, keys: np.ndarray, logits: torch.Tensor) -> None:
        """Reduce a prefill batch's logits (a row per key) to what was asked for on the device, and start
        one copy of them to the host. The earlier batch's in-flight logits are recorded first: one batch
        stays in flight while the host builds the next."""
        self.drain()
        self.unlaunched[keys] = False
        if len(keys):
            self._inflight.append(self._reduce(keys, logits))

    def _reduce(self, keys: np.ndarray, logits: torch.Tensor) -> _InFlight:
        d = self.d
        starts, counts = d.pair_ptr[keys], d.pair_ptr[keys + 1] - d.pair_ptr[keys]
        pairs = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        scored = d.pair_tgt[pairs] >= 0
        pairs = pairs[scored]
        rows = np.repeat(np.arange(len(keys)), counts)[scored]
        logprobs = torch.log_softmax(logits, dim=-1)
        rows_idx = to_device(torch.from_numpy(rows), logits.device)
        toks_idx = to_device(torch.from_numpy(d.pair_tgt[pairs]), logits.device)
        reduced = torch.cat([logprobs[rows_idx, toks_idx], logits.argmax(dim=-1).float()])
        kept = {int(k): logits[r] for r, k in enumerate(keys.tolist()) if d.whole[k]}
        event = None
        if logits.device.type == "cuda":
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            reduced = host
        n = len(pairs)
        return _InFlight(keys, pairs, reduced[:n], reduced[n:], kept, event)

    def drain(self, wait: bool = True) -> None:
        """Record the logits of every batch still in flight (`wait` False: of those the device has finished;
        batches finish in launch order)."""
        done = 0
        for f in self._inflight:
            if f.event is not None:
                if not wait and not f.event.query():
                    break
                f.event.synchronize()
            self.logprob[f.pairs] = f.values.numpy()
            self.argmax[f.keys] = f.argmax.numpy().astype(np.int64)
            self.status[f.keys] = CAPTURED
            self.rows.update(f.rows)
            done += 1
        del self._inflight[:done]

    def scored(self, i: int) -> bool:
        """Whether every logit score request i needs is recorded (its score may be summed)."""
        d = self.d
        return bool((self.status[d.req_key[d.req_ptr[i]:d.req_ptr[i + 1]]] == CAPTURED).all())

    def row(self, key: int) -> torch.Tensor:
        """The captured logits row of a position some request samples from."""
        return self.rows[key]

    def finish_scores(self, indices: Sequence[int] | None = None) -> None:
        """Sum each score request's continuation logprobs and check it is greedy (of those in `indices`,
        else of all; every batch they were issued to has been drained)."""
        s, d = self.state, self.d
        picked = []
        for i in range(len(s.requests)) if indices is None else indices:
            if not isinstance(s.requests[i], ScoreRequest):
                continue
            if d.req_ptr[i + 1] == d.req_ptr[i]:        # an empty continuation: nothing to score
                res = cast(ScoreResult, s.results[i])
                res.logprob, res.num_tokens, res.is_greedy = 0.0, 0, True
            else:
                picked.append(i)
        if not picked:
            return
        lo, hi = d.req_ptr[picked], d.req_ptr[np.asarray(picked) + 1]
        counts = hi - lo
        at = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        heads = np.cumsum(counts) - counts
        sums = np.add.reduceat(self.logprob[d.req_pair[at]], heads)
        greedy = np.logical_and.reduceat(self.argmax[d.req_key[at]] == d.req_tgt[at], heads)
        for i, total, g, n in zip(picked, sums.tolist(), greedy.tolist(), counts.tolist()):
            res = cast(ScoreResult, s.results[i])
            res.logprob, res.num_tokens, res.is_greedy = total, n, g
