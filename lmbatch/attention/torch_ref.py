"""The reference attention backend in plain PyTorch (CPU, and float32 on CUDA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmbatch.attention.base import AttentionBackend, ForwardBatch


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, heads, n, D] x [1, heads, L, D] -> (out, logsumexp) via PyTorch's CPU flash kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                          scale=scale)[:2]
    return out, lse


QUERY_ROWS = 8      # deterministic attention: queries in blocks of this many (padded), keys in blocks of
KEY_ROWS = 256      # this many from the sequence's first key: every product and sum has one shape


def attend_fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0,
                 window: int | None = None) -> torch.Tensor:
    """Causal attention of a sequence's last n queries ([n, H, D]) over its L keys ([L, KVH, D]), computed
    so that each query's output depends on its own keys alone: key blocks of KEY_ROWS from the first key,
    an online softmax merged block after block, every matmul of one fixed shape (QUERY_ROWS queries with
    their heads by KEY_ROWS keys). A block a query cannot see adds exactly nothing, so neither the batch
    nor where the sequence was cut into batches changes a bit of it."""
    acc, _, denom = _online_fixed(q, k, v, scale, softcap, window)
    return _unblock(acc / denom, q)


def attend_fixed_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                       sinks: torch.Tensor) -> torch.Tensor:
    """`attend_fixed` with attention sinks (gpt-oss): each head's learned logit joins the softmax's
    denominator only."""
    acc, m, denom = _online_fixed(q, k, v, scale, 0.0, window)
    KVH = k.shape[1]
    G, chunks = q.shape[1] // KVH, acc.shape[0] // KVH
    sink = sinks.float().view(KVH, 1, 1, G).expand(KVH, chunks, QUERY_ROWS, G).reshape(acc.shape[0], -1, 1)
    top = torch.maximum(m, sink)
    keep = torch.exp(m - top)
    return _unblock(acc * keep / (denom * keep + torch.exp(sink - top)), q)


def _unblock(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[KVH * chunks, QUERY_ROWS * G, D] (a KV head's queries of a block, its G heads side by side) -> [n, H, D]."""
    n, H, D = q.shape
    chunks = -(-n // QUERY_ROWS)
    KVH = out.shape[0] // chunks
    out = out.view(KVH, chunks, QUERY_ROWS, H // KVH, D).permute(1, 2, 0, 3, 4).reshape(chunks * QUERY_ROWS, H, D)
    return out[:n].to(q.dtype)


def _online_fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attend_fixed`'s online softmax: (weighted values, running max, sum of weights), each in the blocked
    layout `_unblock` undoes."""
    n, H, D = q.shape
    L, KVH = k.shape[0], k.shape[1]
    G, Q = H // KVH, QUERY_ROWS
    chunks = -(-n // Q)
    qp = q.new_zeros(chunks * Q, H, D)
    qp[:n] = q
    # [KVH * chunks, Q * G, D]: a KV head's queries of one block, its G heads side by side
    qb = qp.float().view(chunks, Q, KVH, G, D).permute(2, 0, 1, 3, 4).reshape(KVH * chunks, Q * G, D)
    qpos = (L - n + torch.arange(chunks * Q, device=q.device)).view(chunks, Q, 1).expand(chunks, Q, G)
    qpos = qpos.reshape(1, chunks, Q * G, 1).expand(KVH, chunks, Q * G, 1).reshape(KVH * chunks, Q * G, 1)
    m = torch.full((KVH * chunks, Q * G, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(KVH * chunks, Q * G, v.shape[2], device=q.device)
    for start in range(0, L, KEY_ROWS):
        kb, vb = k.new_zeros(KEY_ROWS, KVH, D), v.new_zeros(KEY_ROWS, KVH, v.shape[2])
        got = min(KEY_ROWS, L - start)
        kb[:got], vb[:got] = k[start:start + got], v[start:start + got]
        kt = kb.float().permute(1, 2, 0).repeat_interleave(chunks, dim=0)          # [KVH * chunks, D, KEY_ROWS]
        s = torch.bmm(qb, kt) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if start + KEY_ROWS > L - n or window is not None:     # else every query sees the whole block
            kpos = start + torch.arange(KEY_ROWS, device=q.device)
            seen = (kpos <= qpos) & (kpos < L)
            if window is not None:
                seen &= kpos > qpos - window
            s = s.masked_fill(~seen, float("-inf"))
        new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = new.masked_fill(new == float("-inf"), 0.0)
        p = torch.exp(s - safe)
        alpha = torch.exp(m - safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, vb.float().permute(1, 0, 2).repeat_interleave(chunks, dim=0))
        m = new
    return acc, m, denom


MIN_SHARED = 16     # decode: fewer first keys than this that rows share are read as each row's own
MAX_SHARED = 8      # decode: at most this many groups of rows read their shared first keys once


@dataclass
class DecodeRows:
    """A decode batch (one new token a sequence) laid out for batched attention, once per batch: each row's
    keys padded to the longest (`all_keys`, padded with the row's last key: the pool's unwritten slots may hold
    anything, and a masked score times a NaN value is NaN), and the same split where groups of rows share their
    first keys (the prompt their samples or branches share, at the same slots): `shared` (each group's rows and
    the slots of the keys they share, read once for all of them), then each row's own keys (`keys`, `valid`)."""
    lens: torch.Tensor              # [B] keys of each row
    all_keys: torch.Tensor          # [B, L] slots
    all_valid: torch.Tensor         # [B, L]
    shared: list[tuple[torch.Tensor, torch.Tensor]]
    keys: torch.Tensor              # [B, S] slots of each row's keys after its group's shared ones
    valid: torch.Tensor             # [B, S]


def _padded(b: ForwardBatch, skip: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys from `skip` on, as slots padded with its last key to the longest, and which are real."""
    dev = b.kv_indices.device
    own = lens - skip
    ar = torch.arange(int(own.max()), device=dev)
    starts = torch.tensor(b.kv_indptr[:-1], device=dev) + skip
    flat = starts[:, None] + torch.minimum(ar[None], (own - 1)[:, None])
    return b.kv_indices[flat], ar[None] < own[:, None]


def decode_rows(b: ForwardBatch) -> DecodeRows | None:
    """The batch as `DecodeRows` if every sequence has one new token, else None. Rows are grouped by their first
    key's slot; a group of two or more rows shares the keys all of its rows hold at the same positions (at least
    MIN_SHARED; the MAX_SHARED groups that save the most reads)."""
    B = len(b.qo_indptr) - 1
    if B < 1 or b.qo_indptr != list(range(B + 1)):
        return None
    dev = b.kv_indices.device
    lens = torch.tensor(b.kv_indptr[1:], device=dev) - torch.tensor(b.kv_indptr[:-1], device=dev)
    none = torch.zeros_like(lens)
    keys, valid = _padded(b, none, lens)
    _, group, count = torch.unique(keys[:, 0], return_inverse=True, return_counts=True)
    leader = torch.empty_like(count).scatter_(0, group, torch.arange(B, device=dev))
    same = (keys == keys[leader[group]]) & valid & valid[leader[group]]
    # the first keys each row shares with its group's leader, its last key (its new token's) always its own: a row
    # may read another's new token, written earlier in the batch (a prompt that is a prefix of another's)
    common = torch.minimum(same.int().cumprod(1).sum(1), lens - 1)
    shared_len = torch.full_like(count, int(lens.max())).scatter_reduce(0, group, common, "amin")
    shared_len = torch.where((count >= 2) & (shared_len >= MIN_SHARED), shared_len, 0)
    saved = (count - 1) * shared_len
    chosen = [g for g in saved.argsort(descending=True)[:MAX_SHARED].tolist() if int(saved[g]) > 0]
    if not chosen:
        return DecodeRows(lens, keys, valid, [], keys, valid)
    kept = torch.zeros_like(shared_len)
    kept[chosen] = shared_len[chosen]
    skip = kept[group]
    shared = [(torch.nonzero(group == g).flatten(), keys[int(leader[g]), :int(kept[g])]) for g in chosen]
    own, own_valid = _padded(b, skip, lens)
    return DecodeRows(lens, keys, valid, shared, own, own_valid)


class TorchBackend(AttentionBackend):
    """Reference backend in plain PyTorch: one attention per sequence, KV gathered from the pool.

    On CPU each sequence splits into its cached prefix (every new token sees all of it: no mask, so
    the query heads of a KV group fold into rows and no KV is repeated) and its causal new part, and
    the two are merged by their log-sum-exp, as cascade attention does.

    A decode batch (one new token a sequence; not in deterministic mode, whose `attend_fixed` keeps its own
    bits) runs as batched ops, no loop over rows: the first keys a group of rows shares are read once for all
    of them, each row's own keys padded and masked (`DecodeRows`), the parts merged by their log-sum-exp.
    """

    decode: DecodeRows | None = None

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self.decode = None if self.deterministic else decode_rows(batch)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # Store every new token's KV first: a sequence may read KV that another sequence of the
        # same batch writes (a shared prefix inserted into the tree earlier in this batch).
        self.store(layer, k, v)
        b = self.batch
        if self.decode is not None and sinks is None:     # sinks: the per-row path below has them
            return self._attend_decode(layer, q, self.decode, window)
        out = torch.empty_like(q)
        for i in range(len(b.qo_indptr) - 1):
            q0, q1 = b.qo_indptr[i], b.qo_indptr[i + 1]
            slots = b.kv_indices[b.kv_indptr[i]:b.kv_indptr[i + 1]]
            keys, values = self.pool.k[layer, slots], self.pool.v[layer, slots]
            if sinks is not None and self.deterministic:
                out[q0:q1] = attend_fixed_sinks(q[q0:q1], keys, values, self.scale, window, sinks)
            elif sinks is not None:
                out[q0:q1] = self._attend_sinks(q[q0:q1], keys, values, window, sinks)
            elif self.deterministic:
                out[q0:q1] = attend_fixed(q[q0:q1], keys, values, self.scale, self.softcap, window)
            elif q.device.type == "cpu" and not self.softcap and (window is None or len(slots) <= window):
                out[q0:q1] = self._attend_cpu(q[q0:q1], keys, values)
            else:
                out[q0:q1] = self._attend_masked(q[q0:q1], keys, values, window)
        return out

    def _attend_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       window: int | None = None) -> torch.Tensor:
        n, L = q.shape[0], k.shape[0]
        keys, queries = torch.arange(L, device=q.device)[None, :], torch.arange(L - n, L, device=q.device)[:, None]
        mask = keys <= queries
        if window is not None:      # as transformers' sliding window: key > query - window
            mask &= keys > queries - window
        if self.softcap:            # scores soft-capped before the mask, softmax in float32 (as transformers)
            G = q.shape[1] // k.shape[1]
            kt, vt = k.repeat_interleave(G, dim=1).transpose(0, 1), v.repeat_interleave(G, dim=1).transpose(0, 1)
            s = torch.tanh(q.transpose(0, 1) @ kt.transpose(1, 2) * self.scale / self.softcap) * self.softcap
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
            return (p @ vt).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)

    def _attend_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                      sinks: torch.Tensor) -> torch.Tensor:
        """Attention sinks (gpt-oss), as transformers computes them: each head's learned logit is one more
        column of the softmax (in float32 here), dropped before the values are weighted."""
        n, L = q.shape[0], k.shape[0]
        keys, queries = torch.arange(L, device=q.device)[None, :], torch.arange(L - n, L, device=q.device)[:, None]
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window
        G = q.shape[1] // k.shape[1]
        kt, vt = k.repeat_interleave(G, dim=1).transpose(0, 1), v.repeat_interleave(G, dim=1).transpose(0, 1)
        s = (q.transpose(0, 1) @ kt.transpose(1, 2) * self.scale).masked_fill(~mask, float("-inf"))
        s = torch.cat([s, sinks.to(s.dtype).view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        p = torch.softmax(s.float(), dim=-1)[..., :-1].to(q.dtype)
        return (p @ vt).transpose(0, 1)

    def _attend_cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, H, D = q.shape
        L, KVH = k.shape[0], k.shape[1]
        G, P = H // KVH, L - n
        if n == 1 or P > 0:  # the part every new token sees in full
            seen = L if n == 1 else P
            qf = q.view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(1, KVH, G * n, D)
            kf, vf = k[:seen].permute(1, 0, 2)[None], v[:seen].permute(1, 0, 2)[None]
            o1, lse1 = _flash_cpu(qf.contiguous(), kf.contiguous(), vf.contiguous(), False, self.scale)
            o1 = o1.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
            if n == 1:
                return o1
            lse1 = lse1.view(KVH, G, n).permute(2, 0, 1).reshape(n, H)
        kt = k[P:].repeat_interleave(G, dim=1).transpose(0, 1)[None]
        vt = v[P:].repeat_interleave(G, dim=1).transpose(0, 1)[None]
        o2, lse2 = _flash_cpu(q.transpose(0, 1)[None].contiguous(), kt.contiguous(), vt.contiguous(), True,
                              self.scale)
        o2, lse2 = o2[0].transpose(0, 1), lse2[0].transpose(0, 1)
        if P == 0:
            return o2
        w1 = torch.sigmoid(lse1 - lse2)[..., None]   # exp(lse1) / (exp(lse1) + exp(lse2))
        return (w1 * o1.float() + (1 - w1) * o2.float()).to(q.dtype)

    def _attend_decode(self, layer: int, q: torch.Tensor, d: DecodeRows, window: int | None) -> torch.Tensor:
        """Every row's one query over its keys, batched (`DecodeRows`); a window that hides keys of some row
        reads every row's keys padded (no shared part: not every row sees it)."""
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        if window is not None and int(d.lens.max()) > window:
            pos = torch.arange(d.all_keys.shape[1], device=q.device)[None]
            seen = d.all_valid & (pos > (d.lens - 1 - window)[:, None])
            return self._rows(q, kp[d.all_keys], vp[d.all_keys], seen)[0].to(q.dtype)
        out, lse = self._rows(q, kp[d.keys], vp[d.keys], d.valid)
        for rows, slots in d.shared:
            o1, lse1 = self._shared(q[rows], kp[slots], vp[slots])
            w1 = torch.sigmoid(lse1 - lse[rows])[..., None]     # exp(lse1) / (exp(lse1) + exp(lse2))
            out[rows] = w1 * o1 + (1 - w1) * out[rows]
        return out.to(q.dtype)

    def _scores(self, s: torch.Tensor) -> torch.Tensor:
        s = s * self.scale
        return self.softcap * torch.tanh(s / self.softcap) if self.softcap else s

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One query a row ([B, H, D]) over its padded keys ([B, S, KVH, D]) where `seen` ([B, S]): the output
        and log-sum-exp in float32 ([B, H, D], [B, H])."""
        B, H, D = q.shape
        KVH = k.shape[2]
        qf = q.float().view(B, KVH, H // KVH, D)
        s = self._scores(torch.matmul(qf, k.float().permute(0, 2, 3, 1)))            # [B, KVH, G, S]
        s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        o = torch.matmul(torch.exp(s - lse), v.float().permute(0, 2, 1, 3))           # [B, KVH, G, D]
        return o.reshape(B, H, D), lse.reshape(B, H)

    def _shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows' queries ([n, H, D]) over keys they all see ([P, KVH, D]), each KV head's keys read once for
        the queries of all its heads and rows: output and log-sum-exp in float32."""
        n, H, D = q.shape
        KVH = k.shape[1]
        G = H // KVH
        qf = q.float().view(n, KVH, G, D).permute(1, 0, 2, 3).reshape(KVH, n * G, D)
        s = self._scores(torch.bmm(qf, k.float().permute(1, 2, 0)))                   # [KVH, n * G, P]
        lse = torch.logsumexp(s, -1, keepdim=True)
        o = torch.bmm(torch.exp(s - lse), v.float().permute(1, 0, 2))                  # [KVH, n * G, D]
        return (o.view(KVH, n, G, D).permute(1, 0, 2, 3).reshape(n, H, D),
                lse.view(KVH, n, G).permute(1, 0, 2).reshape(n, H))
