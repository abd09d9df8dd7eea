"""The server's Python memory stays flat over hundreds of requests (CI's short soak; `speculative
bench-serve --soak` is the long one, with the process's RSS): the bytes tracemalloc sees allocated after
a warm-up grow by less than a leak of LEAK bytes a request would add (measured: about 12 KB over 160
requests), and a server that does leak that much fails the same check."""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import API_KEY

LEAK = 1024  # bytes a request
WARM_UP, MEASURED = 96, 160  # requests (the first ones fill one-time caches: about 60 KB)


def _requests(served, count: int, numbers) -> None:
    """`count` requests of assorted kinds from 8 clients: streamed or not, logprobs, stop strings, n=2."""
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def one(i: int) -> None:
        body = {"prompt": f"def f{i % 7}(", "max_tokens": 6, "temperature": 0.8 * (i % 2), "seed": i}
        body |= [{}, {"stream": True}, {"logprobs": 2}, {"stop": ["):"]}, {"n": 2, "temperature": 1.0}][i % 5]
        with httpx.Client(timeout=60) as client:
            response = client.post(served.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, itertools.islice(numbers, count)))


def _growth(served, leak_per_request: int = 0) -> int:
    """Bytes still allocated (tracemalloc) after MEASURED requests beyond what a warm-up left."""
    numbers = itertools.count()
    _requests(served, WARM_UP, numbers)
    kept = []
    if leak_per_request:  # a deliberately leaking server: every finished request leaves bytes behind
        retire = served.scheduler._retire

        def leaking_retire(request):
            kept.append(bytearray(leak_per_request))
            return retire(request)

        served.scheduler._retire = leaking_retire
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        _requests(served, MEASURED, numbers)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        served.scheduler.__dict__.pop("_retire", None)


def test_python_memory_stays_flat_over_hundreds_of_requests(served) -> None:
    growth = _growth(served)
    assert growth < LEAK * MEASURED, f"{growth} bytes more after {MEASURED} requests"


@pytest.mark.parametrize("leak", [LEAK])
def test_a_leak_of_a_kib_a_request_fails_the_check(served, leak: int) -> None:
    assert _growth(served, leak) >= LEAK * MEASURED
