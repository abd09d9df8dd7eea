"""The project's C++ CPU kernels: one extension built from the .cpp files beside this module.

int8_activations.cpp (`quantization="w8a8"` and `"w4a8"`, models/int8_activations.py) and few_rows.cpp
(float32 matmuls of a few rows, models/few_rows.py) share linear_kernels.h and are built together, with
torch.utils.cpp_extension, the first time a process needs them: the first time on a machine it builds
them (16 s on 2 cores of an AMD EPYC Zen 3, saying so on stderr), later processes load them from
torch's extensions cache (~/.cache/torch_extensions) in about 0.1 s, unless the sources, the flags or
torch changed. Building needs a C++ compiler and ninja, both there wherever torch.compile works. Their
ops' schemas and fake implementations are defined by the Python module of each (the "speculative"
namespace of models/packed.py's prepacked_linear); loading the extension registers their CPU kernels.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

_NAME = "speculative_cpu_kernels"
_SOURCES = [Path(__file__).with_name(name) for name in ("int8_activations.cpp", "few_rows.cpp")]
_lock = threading.Lock()
_loaded = False


# Bytes ahead of the weights in use that the kernels prefetch (linear_kernels.h's `prefetch`: the w8a8 /
# w4a8 kernels and the float32 few-row one), by CPU vendor: where it was measured to pay; AMD CPUs build
# without it (docs/internals.md#measured-choices).
PREFETCH_BYTES = {"GenuineIntel": 8192}


def _vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.partition(":")[2].strip() for ln in lines if ln.startswith("vendor_id")), "")


def prefetches() -> bool:
    """Whether the kernels built on this CPU prefetch their weights (PREFETCH_BYTES has its vendor)."""
    return _vendor() in PREFETCH_BYTES


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # "AVX2" or "AVX512": the CPU has AVX2
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if prefetches():
        flags.append(f"-DSPECULATIVE_PREFETCH={PREFETCH_BYTES[_vendor()]}")
    return flags


def _built(cpp_extension) -> bool:
    """Whether a build of the extension is there to load (else loading builds it first)."""
    try:  # torch's own rule for the build folder (TORCH_EXTENSIONS_DIR, else its cache)
        folder = Path(cpp_extension._get_build_directory(_NAME, verbose=False))
    except (AttributeError, OSError):
        return True  # nothing to say
    return (folder / f"{_NAME}.so").is_file()


def load(purpose: str) -> None:
    """Build (the first time on this machine) and load the kernels. RuntimeError naming what is missing
    where they cannot be built (no C++ compiler, no ninja), and `purpose`, what asked for them."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        if not _built(cpp_extension):
            print(f"speculative: building the C++ CPU kernels for {purpose} (once)", file=sys.stderr)
        try:
            cpp_extension.load(
                name=_NAME,
                sources=[str(source) for source in _SOURCES],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        except (RuntimeError, OSError, ImportError) as error:
            raise RuntimeError(
                f"{purpose} builds a C++ kernel on first use and could not: it needs a C++ compiler (g++) "
                f"and ninja (`pip install ninja`). The build said: {error}"
            ) from error
        _loaded = True
