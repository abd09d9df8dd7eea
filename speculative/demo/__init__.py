"""The project's own demo model pair: a small Llama target and a distilled draft.

`speculative.demo.train` is the recipe (`python -m speculative.demo.train --out models/demo`); it trains a
byte-level BPE tokenizer, the target and the draft on the Python standard library's source, a corpus every
machine has, and writes Hugging Face model directories plus a model card.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[2] / "models" / "demo"
"""Where the committed demo pair lives: models/demo/{target,draft} beside the package."""
