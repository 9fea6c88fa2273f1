"""Which experts a token is routed to and with what weights (network.py's MoE): functions of the router's
logits, float32 throughout, as transformers computes them, and DeepSeek's sigmoid router that holds its weights."""
from __future__ import annotations

import torch
from torch import nn

from lmbatch.model.config import ModelConfig
from lmbatch.model.layers import maybe_fixed_linear


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen3-MoE's: the k largest of the router's softmax (renormalized to sum to one where
    the config says). Returns (weights [T, k] float32, experts [T, k])."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_sigmoid_top_k(logits: torch.Tensor, correction: torch.Tensor, k: int, groups: tuple[int, int],
                          renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's and GLM-4.5's: sigmoid scores plus a per-expert correction bias choose the experts, among
    those of the best `groups[1]` of `groups[0]` equal groups (a group's merit: its two best biased scores);
    the chosen experts' unbiased scores weight them, renormalized where the config says (plus 1e-20), times
    `scale` (routed_scaling_factor). Returns (weights [T, k] float32, experts [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + correction.float()
    T, E = choice.shape
    n, best = groups
    if n > 1:
        merit = choice.view(T, n, E // n).topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.zeros_like(merit).scatter_(1, merit.topk(best, dim=-1, sorted=False)[1], 1.0)
        choice = choice.masked_fill(kept.repeat_interleave(E // n, dim=1) == 0, float("-inf"))
    experts = choice.topk(k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class SigmoidRouter(nn.Module):
    """DeepSeek-V3's and GLM-4.5's router (routing.grouped_sigmoid_top_k): float32 weights and correction
    bias, as transformers keeps them whatever the model's dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H = cfg.num_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.top_k, self.renorm, self.scale = cfg.experts_per_token, cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.groups, self.top_groups = cfg.n_group, cfg.topk_group
        self.fixed = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = maybe_fixed_linear(x.float(), self.weight, self.fixed)
        return grouped_sigmoid_top_k(logits, self.e_score_correction_bias, self.top_k, (self.groups, self.top_groups),
                                     self.renorm, self.scale)
