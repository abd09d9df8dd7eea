"""The project's own demo model pair: a small Llama target and a distilled draft.

`speculative.demo.train` is the recipe (`python -m speculative.demo.train --out models/demo`); it trains a
byte-level BPE tokenizer, the target and the draft on the Python standard library's source, a corpus every
machine has, and writes Hugging Face model directories plus a model card.

The pair (52 MB) is committed in the checkout's `models/demo/`, not shipped with the package.
"""

import os
from pathlib import Path

DEMO_DIR_ENV = "SPECULATIVE_DEMO_DIR"


def _demo_dir() -> Path:
    """$SPECULATIVE_DEMO_DIR when set; else the checkout's models/demo when the package sits in a
    checkout (beside pyproject.toml); else models/demo under the working directory."""
    if os.environ.get(DEMO_DIR_ENV):
        return Path(os.environ[DEMO_DIR_ENV]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "models" / "demo"
    return Path.cwd() / "models" / "demo"


DEMO_DIR = _demo_dir()
"""Where the demo pair is looked for, {target,draft} inside it (fixed when the package is imported)."""
