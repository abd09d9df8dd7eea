"""Speculative methods, registered by name (registry.py): each one's options as a small config that
validates itself, and how it builds its proposer (speculative/proposers/). Importing this package
registers the built-in methods and imports nothing heavy (no torch): the CLI makes its flags from it.

A new drafter is its proposer (speculative/proposers/) and one file here holding its MethodConfig,
imported below; `speculative generate/serve/bench` and SpeculativeConfig then take its name.
"""

from speculative.methods.dflash import DFlashConfig
from speculative.methods.draft_model import DraftModelConfig
from speculative.methods.eagle import EagleConfig
from speculative.methods.ngram import NgramConfig
from speculative.methods.registry import METHODS, BuildContext, Built, MethodConfig, method_config, register
from speculative.methods.self_draft import SelfDraftConfig
from speculative.methods.suffix import SuffixConfig

__all__ = [
    "METHODS",
    "BuildContext",
    "Built",
    "DFlashConfig",
    "DraftModelConfig",
    "EagleConfig",
    "MethodConfig",
    "NgramConfig",
    "SelfDraftConfig",
    "SuffixConfig",
    "method_config",
    "register",
]
