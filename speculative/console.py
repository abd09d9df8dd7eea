"""What the commands say on stderr, and what they keep others from saying: progress lines before the
waits (loading, warm-up, compiling), and transformers without its bars and warnings."""

from __future__ import annotations

import os
import sys


def progress(line: str) -> None:
    """One line on stderr ("speculative: ..."), never on stdout, which carries the commands' output."""
    print(f"speculative: {line}", file=sys.stderr, flush=True)


def quiet_transformers() -> None:
    """No weight-loading bars or warnings from transformers in the commands' output: by its environment
    variables, read when it is imported (not before a command needs it), or directly where it is."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
