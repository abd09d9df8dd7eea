"""`speculative serve` without --model: the demo model's draft chooses k per step (adaptive k) unless the
flags say otherwise, since at its fixed k it runs slower than plain decoding under load. The demo model
itself is not fetched here: its pair stands in for it (the toy pair's folders)."""

from __future__ import annotations

import pytest

from speculative import cli
from speculative.demo import DEMO_DIR, smollm2
from speculative.server import app


@pytest.fixture
def demo_stand_in(monkeypatch) -> None:
    monkeypatch.delenv(smollm2.DEMO_ENV)
    pair = smollm2.DemoPair(DEMO_DIR / "target", DEMO_DIR / "draft", DEMO_DIR / "model.gguf")
    monkeypatch.setattr(smollm2, "demo_pair", lambda: pair)


CASES = [
    ([], True),
    (["--no-adaptive"], False),
    (["--adaptive", "-k", "2"], True),
    (["--tree", "static"], False),
]


@pytest.mark.parametrize("flags,adaptive", CASES)
def test_the_demo_servers_draft_chooses_k_unless_told_otherwise(demo_stand_in, flags, adaptive) -> None:
    llm = app.serve_app(*cli.serve_args(flags)).state.scheduler.llm
    assert llm.speculative_config.adaptive is adaptive
    assert llm.engine.draft_length.adaptive is adaptive


def test_a_server_of_a_given_model_keeps_its_k(model_dirs) -> None:
    flags = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"]]
    llm = app.serve_app(*cli.serve_args(flags)).state.scheduler.llm
    assert llm.speculative_config.adaptive is False
