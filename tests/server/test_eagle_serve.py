"""`speculative serve --eagle`: the app of the CLI's flags drafts with the EAGLE head, and the official
openai client gets the target's own greedy text."""

from __future__ import annotations

import httpx
import openai
from conftest import save_eagle_head_for
from prometheus_client.parser import text_string_to_metric_families

from speculative import LLM, SamplingParams, cli
from speculative.proposers import EagleTreeProposer
from speculative.server.app import serve_app

from .conftest import running, tiny_pair

PROMPT = "def add(a, b):"


def test_serve_with_an_eagle_head_writes_the_targets_text(tmp_path) -> None:
    target, _, tokenizer = tiny_pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    head = save_eagle_head_for(target, tmp_path / "eagle")
    flags = ["serve", "--model", str(tmp_path / "target"), "--eagle", head, "--tree", "dynamic", "-k", "3"]
    flags += ["--served-model-name", "tiny"]
    app = serve_app(*cli.serve_args(flags[1:]))
    assert isinstance(app.state.scheduler.llm.engine.proposer, EagleTreeProposer)
    with running(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    alone = LLM(str(tmp_path / "target")).generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    assert answer.choices[0].text == alone[0].outputs[0].text
    drafted = [
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "speculative:spec_decode_num_draft_tokens_total"
    ]
    assert drafted and drafted[0] > 0
