"""The machine a measurement ran on, as the recorded runs describe it (the demo's model cards, the
benchmark's reports, the draft recipe's training.json)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import tokenizers
import torch
import transformers


def machine() -> dict:
    """nproc, CPU model (its name, and its family and model numbers: a name such as "AMD EPYC" covers
    several generations) and library versions of this machine."""
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        fields = {
            key.strip(): value.strip()
            for key, _, value in (ln.partition(":") for ln in Path("/proc/cpuinfo").read_text().splitlines())
            if key.strip() in ("model name", "cpu family", "model")
        }
        cpu = fields.get("model name", cpu)
        if "cpu family" in fields:
            cpu += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
