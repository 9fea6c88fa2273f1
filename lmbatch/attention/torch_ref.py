"""The reference attention backend in plain PyTorch (CPU, and float32 on CUDA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmbatch.attention.base import AttentionBackend


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


class TorchBackend(AttentionBackend):
    """Reference backend in plain PyTorch: one attention per sequence, KV gathered from the pool.

    On CPU each sequence splits into its cached prefix (every new token sees all of it: no mask, so
    the query heads of a KV group fold into rows and no KV is repeated) and its causal new part, and
    the two are merged by their log-sum-exp, as cascade attention does.
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # Store every new token's KV first: a sequence may read KV that another sequence of the
        # same batch writes (a shared prefix inserted into the tree earlier in this batch).
        self.store(layer, k, v)
        b = self.batch
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
