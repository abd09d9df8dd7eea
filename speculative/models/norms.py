"""RMSNorm, as Hugging Face's Llama-family models compute it (in float32, in their order of operations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 like HF's LlamaRMSNorm. Its parameter is
    `weight` [size] and its epsilon `variance_epsilon`, as HF names them."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.variance_epsilon)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # x [..., size], weight [size] or [..., size]
    """weight * x / sqrt(mean(x^2) + eps), computed in float32, in HF's order of operations."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
