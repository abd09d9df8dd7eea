"""speculative: fast, exact speculative decoding for Hugging Face causal language models.

The public surface: `LLM`, `SamplingParams`, `SpeculativeConfig`, `RequestOutput`. Everything else
(models, KV caches, proposers, acceptance rules, the engine) is importable but not advertised.

The names are imported on first use (PEP 562), so that `import speculative.cli` and
`speculative --help` do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculative.config import SpeculativeConfig
    from speculative.engine.outputs import CompletionOutput, RequestOutput, SpeculationMetrics
    from speculative.llm import LLM
    from speculative.sampling_params import SamplingParams

_HOMES = {
    "LLM": "speculative.llm",
    "CompletionOutput": "speculative.engine.outputs",
    "RequestOutput": "speculative.engine.outputs",
    "SamplingParams": "speculative.sampling_params",
    "SpeculationMetrics": "speculative.engine.outputs",
    "SpeculativeConfig": "speculative.config",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "SpeculationMetrics",
    "SpeculativeConfig",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'speculative' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
