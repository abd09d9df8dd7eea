"""`speculative serve --draft-compile`: the draft model's graphs compile before the server listens, so
that its requests, at batch 1 and larger, with every k adaptive k chooses, compile nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from speculative import cli
from speculative.models.compiled import CompiledCausalLM, graphs_compiled
from speculative.server import app

from .conftest import running

pytestmark = pytest.mark.slow  # compiles the toy draft's graphs: about a minute on 2 cores


def test_the_drafts_graphs_compile_before_the_server_listens(model_dirs) -> None:
    flags = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"], "--draft-compile"]
    before = graphs_compiled()
    served = app.serve_app(*cli.serve_args([*flags, "--adaptive", "-k", "3"]))
    llm = served.state.scheduler.llm
    assert isinstance(llm.draft.model, CompiledCausalLM)
    assert not isinstance(llm.target.model, CompiledCausalLM)
    compiled = graphs_compiled()
    assert compiled > before
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

        complete(prompts[0])  # alone: batch 1
        with ThreadPoolExecutor(len(prompts)) as pool:  # together: batches of 2 to 4 rows
            assert all(pool.map(complete, prompts))
    assert graphs_compiled() == compiled
