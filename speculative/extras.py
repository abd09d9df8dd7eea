"""The optional features' modules: a missing one is an error that names the extra installing it.

The core install is the engine alone; `pip install 'speculative[EXTRA]'` adds a feature's modules:
server (`speculative serve`), bench (`speculative bench`), guided (guided decoding), transformers-tp
(tensor parallelism of models on transformers' forward, which transformers splits only with
accelerate installed), replicas (`speculative serve --replicas N`, Ray Serve); `all` is all but replicas.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

EXTRAS = {
    "server": ("fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "prometheus_client"),
    "bench": ("matplotlib", "rich"),
    "guided": ("llguidance",),
    "transformers-tp": ("accelerate",),
    "replicas": ("ray",),
    "gguf": ("gguf", "accelerate"),
}
"""Each extra's top-level modules (the packages pyproject.toml's extra installs, by import name)."""


@contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Run imports of `feature` that need `extra`: a ModuleNotFoundError for one of the extra's modules
    (EXTRAS) becomes ModuleNotFoundError("<feature> needs the <extra> extra: pip install
    'speculative[<extra>]' (no module named '<module>')"), the same `name`; any other passes unchanged.
    Nested uses name the outermost feature."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}; got {extra!r}")
    try:
        yield
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXTRAS[extra]:
            raise
        raise ModuleNotFoundError(
            f"{feature} needs the {extra} extra: pip install 'speculative[{extra}]' "
            f"(no module named {error.name!r})",
            name=error.name,
        ) from error
