"""`speculative serve --draft-compile`: the server answers at once, the draft eager while its graphs
compile in the background (/health says `compiling`), and once they have, its requests, at batch 1
and larger, with every k adaptive k chooses, compile nothing, with the same answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from speculative import cli
from speculative.models.compiled import CompiledCausalLM, graphs_compiled
from speculative.server import app

from .conftest import running

pytestmark = pytest.mark.slow  # compiles the toy draft's graphs: about a minute on 2 cores


def test_the_drafts_graphs_compile_in_the_background_and_then_serve_every_request(model_dirs) -> None:
    flags = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"], "--draft-compile"]
    before = graphs_compiled()
    served = app.serve_app(*cli.serve_args([*flags, "--adaptive", "-k", "3"]))
    llm = served.state.scheduler.llm
    assert isinstance(llm.draft.model, CompiledCausalLM)
    assert not isinstance(llm.target.model, CompiledCausalLM)
    compiling = served.state.compiling
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(10):"]
    with running(served) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(prompt: str) -> str:
            return (
                client.completions.create(
                    model=model_dirs["target"], prompt=prompt, max_tokens=40, temperature=0
                )
                .choices[0]
                .text
            )

        health = httpx.get(f"{url}/health").json()
        assert health == {"status": "ok", "compiling": True} or not compiling.is_alive()
        eager = complete(prompts[0])  # most likely while the draft compiles
        compiling.join(timeout=600)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        compiled = graphs_compiled()
        assert compiled > before
        assert complete(prompts[0]) == eager  # alone: batch 1
        with ThreadPoolExecutor(len(prompts)) as pool:  # together: batches of 2 to 4 rows
            assert all(pool.map(complete, prompts))
    assert graphs_compiled() == compiled
