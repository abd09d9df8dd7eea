"""Logits processing and sampling with per-request generators."""

from speculative.sampling.strategy import SampleStrategy

__all__ = ["SampleStrategy"]
