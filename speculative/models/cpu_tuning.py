"""How the native models use a CPU, in one place: the threads a small forward runs on, and the row
counts PackedLinear's oneDNN calls meet. `tune` is the one entry point, called by whoever runs an
engine, once, before its first forward.

Threads: forwards of at most SMALL_CALL_ROWS query tokens (batch * q) run on
NativeCausalLM.small_call_threads threads (small_call_threads(), read when the model is made; None:
torch's setting throughout).
oneDNN's row counts: oneDNN makes a kernel for each shape it is called with and keeps it in a
process-wide cache; an engine that meets ever new batch and prompt sizes (a server's) has PackedLinear
round its calls' rows to few counts (packed.round_onednn_rows, packed.onednn_row_counts: the kernels
its engine thread makes ahead), which costs offline runs throughput (docs/internals.md#measured-choices),
so they keep the rows as given.
"""

from __future__ import annotations

import os

from speculative.models.packed import round_onednn_rows

# Forwards of at most this many query tokens (batch * q) run on NativeCausalLM.small_call_threads
# threads (on CPU), see small_call_threads().
SMALL_CALL_ROWS = 64


def small_call_threads() -> int | None:
    """The threads a small forward (at most SMALL_CALL_ROWS tokens) runs on: 1 when OpenMP's threads
    sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE), None (torch's setting) otherwise.

    Asleep, a thread is woken for each of a forward's ~100 matmuls, which costs more than it gives
    (docs/internals.md#measured-choices).
    """
    return 1 if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE" else None


def tune(*, serving: bool) -> None:
    """This process's CPU settings for the engine about to run: `serving` (a long-running engine that
    meets ever new batch and prompt sizes, a server's) has PackedLinear's oneDNN calls meet few row
    counts (packed.round_onednn_rows; process-wide, as oneDNN's cache of kernels is); otherwise they
    are made with the rows given, faster for an offline run's bounded set of shapes."""
    round_onednn_rows(serving)
