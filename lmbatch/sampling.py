"""Next-token choice from a logits row: greedy, or temperature + top-p with a per-request generator."""
from __future__ import annotations

import torch

from lmbatch.requests import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row. Each request samples with its own generator, so results do not depend on
    which other requests share its batch."""
    out = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, p, g, best in zip(logits, params, generators, greedy):
        if p.temperature <= 0:
            out.append(best)
            continue
        probs = torch.softmax(row.float().cpu() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p   # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out
