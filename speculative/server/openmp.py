"""OpenMP threads for an engine that runs in a thread of its own (the server's).

torch's CPU kernels run their parallel regions on an OpenMP team owned by the thread that enters them:
each thread gets a team of its own (torch.get_num_threads() - 1 more threads), kept for its life.
libgomp (torch's OpenMP on Linux) lets a team's idle threads spin about 300,000 times before sleeping,
which catches the next region of a forward, but only 100 times while it manages more threads than
there are CPUs. A server's main thread loads the models (a team), and its engine thread then has a
second one: on 2 CPUs that is 4 threads, every region of the engine waits for a sleeping thread to
wake, and a forward made of hundreds of short regions slows down by half
(docs/internals.md#measured-choices).

`release_thread_team()` ends the calling thread's team (OpenMP 5's omp_pause_resource_all), so that
the engine's team is the only one. The main thread must not enter parallel regions afterwards (the
server's HTTP handlers only tokenize and queue; a torch op on a small tensor runs without one), or a
team of its own comes back.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime stays initialized


def _loaded_libgomps() -> list[str]:
    """The paths of every libgomp this process has loaded (torch's, and copies that other packages
    bring, such as sentencepiece's); none where it is not Linux."""
    if sys.platform != "linux":
        return []
    paths = (line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines())
    return sorted({path for path in paths if Path(path).name.startswith("libgomp")})


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team in every libgomp loaded (module docstring: torch's is one
    of them; in another the call changes nothing). Returns whether one of them did."""
    released = False
    for path in _loaded_libgomps():
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        released |= pause is not None and pause(_OMP_PAUSE_SOFT) == 0
    return released
