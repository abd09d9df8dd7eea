"""A tensor-parallel rank spawned by distributed/ranks.py:
`python -m speculative.rank_worker FD RANK SIZE PORT THREADS DEVICE`.

FD is its end of the socket pair to rank 0, PORT rank 0's TCPStore (127.0.0.1), DEVICE "cpu" or "cuda".
It says "started" once its imports are done, joins the default group, then serves rank 0's messages
(kind, handle, payload) until "exit" or until rank 0 is gone:
  build   build LLM(**payload) as LLM `handle`; answer ("built", handle, None or the traceback)
  drop    forget LLM `handle`
  other   make that engine call on LLM `handle` (mirror.Follower); on an error, print its traceback,
          say what it was ("error", handle, a line) and exit with status 1: the ranks may no longer
          agree on the batch

It builds LLMs, so it sits above speculative.llm, beside the commands, and outside speculative.distributed,
which llm.py uses (group, mirror, draft_length): ranks.py names it (RANK_PROGRAM) without importing it.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from speculative.distributed.backend import TIMEOUT, backend
from speculative.distributed.mirror import Follower
from speculative.distributed.ranks import receive, send
from speculative.llm import LLM


def main(argv: list[str]) -> int:
    fd, rank, size, port, threads = (int(a) for a in argv[:5])
    device_type = argv[5]
    connection = Connection(fd)
    torch.set_num_threads(threads)
    send(connection, ("started", None, None))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(backend(device_type), store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    followers: dict[int, Follower] = {}
    while True:
        try:
            kind, handle, payload = receive(connection)
        except (EOFError, OSError):  # rank 0 is gone
            return 0
        if kind == "exit":
            return 0
        if kind == "drop":
            followers.pop(handle, None)
            continue
        try:
            if kind == "build":
                followers[handle] = Follower(LLM(**payload))
            else:
                followers[handle].replay(kind, payload)
        except BaseException as error:
            if kind == "build":
                send(connection, ("built", handle, traceback.format_exc()))
                continue
            traceback.print_exc()
            try:
                send(connection, ("error", handle, f"its {kind} raised {type(error).__name__}: {error}"))
            except OSError:
                pass
            return 1
        if kind == "build":
            send(connection, ("built", handle, None))


if __name__ == "__main__":
    code = main(sys.argv[1:])  # then exit at once: the interpreter's teardown of torch is slow
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
