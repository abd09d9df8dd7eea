"""speculative: fast, exact speculative decoding for Hugging Face causal language models.

The public surface: `LLM`, `SamplingParams`, `SpeculativeConfig`, `RequestOutput`. Everything else
(models, KV caches, proposers, acceptance rules, the engine) is importable but not advertised.
"""

from speculative.config import SpeculativeConfig
from speculative.engine.outputs import CompletionOutput, RequestOutput, SpeculationMetrics
from speculative.llm import LLM
from speculative.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "SpeculationMetrics",
    "SpeculativeConfig",
]
