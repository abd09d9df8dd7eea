"""Acceptance rules by name (SpeculativeConfig.acceptance): name -> a factory of the rule from the
config. A new rule is its module in speculative/acceptance/ plus one `register_rule` call here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speculative.acceptance.base import AcceptanceRule

RULES: dict[str, Callable[[Any], AcceptanceRule]] = {}
"""name -> factory(config) of the rule; `config` is the SpeculativeConfig (its posterior_* options)."""


def register_rule(name: str, factory: Callable[[Any], AcceptanceRule]) -> None:
    """Register an acceptance rule (a name taken twice is a ValueError)."""
    if name in RULES:
        raise ValueError(f"acceptance rule {name!r} is registered twice")
    RULES[name] = factory


def acceptance_rule(config: Any) -> AcceptanceRule:
    """The rule `config.acceptance` names (SpeculativeConfig checked the name)."""
    return RULES[config.acceptance](config)


def _rejection(config: Any) -> AcceptanceRule:
    """Lossless: the output follows the target's distribution exactly."""
    from speculative.acceptance.rejection import RejectionSampler

    return RejectionSampler()


def _typical(config: Any) -> AcceptanceRule:
    """Medusa's typical acceptance, with the config's posterior_threshold and posterior_alpha."""
    from speculative.acceptance.typical import TypicalAcceptanceSampler

    return TypicalAcceptanceSampler(config.posterior_threshold, config.posterior_alpha)


register_rule("rejection", _rejection)
register_rule("typical", _typical)
