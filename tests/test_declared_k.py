"""A draft model's own k and prompt lookup: `num_assistant_tokens` and `prompt_lookup_min` in its folder's
generation_config.json, taken where the user gives none (LLM without speculative_config or with a dict
lacking it, the commands without -k / --prompt-lookup-min)."""

from __future__ import annotations

import json
import shutil

import pytest

from speculative import LLM, SpeculativeConfig
from speculative.config import with_draft_defaults
from speculative.engine_args import EngineArgs


def _declaring(draft: str, tmp_path, k: object, **more: object) -> str:
    """A copy of the draft folder `draft` whose generation config declares k (num_assistant_tokens) and
    `more`."""
    out = tmp_path / "draft"
    shutil.copytree(draft, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | {"num_assistant_tokens": k} | more))
    return str(out)


def test_a_draft_folder_declares_its_k_where_none_is_given(model_dirs, tmp_path) -> None:
    draft = _declaring(model_dirs["draft"], tmp_path, 2)
    assert with_draft_defaults({"method": "draft_model"}, draft)["num_speculative_tokens"] == 2
    assert with_draft_defaults({}, draft)["num_speculative_tokens"] == 2
    assert with_draft_defaults({"num_speculative_tokens": 3}, draft)["num_speculative_tokens"] == 3
    assert "num_speculative_tokens" not in with_draft_defaults({"method": "ngram"}, draft)
    # a folder whose file declares nothing, a name that is no folder, a model object: the default
    assert with_draft_defaults({}, model_dirs["draft"]) == {}
    assert with_draft_defaults({}, "some-org/some-draft") == {}
    assert with_draft_defaults({}, object()) == {}


@pytest.mark.parametrize("k", [0, 33, 2.5, "2"])
def test_a_declared_k_out_of_range_is_an_error_naming_the_file(model_dirs, tmp_path, k) -> None:
    draft = _declaring(model_dirs["draft"], tmp_path, k)
    with pytest.raises(
        ValueError, match=r"generation_config.json.num_assistant_tokens must be an integer in \[1, 32\]"
    ):
        with_draft_defaults({}, draft)


def test_llm_and_the_commands_take_the_declared_k_unless_told_otherwise(model_dirs, tmp_path) -> None:
    draft = _declaring(model_dirs["draft"], tmp_path, 2)
    target = model_dirs["target"]
    assert LLM(target, draft_model=draft).speculative_config.num_speculative_tokens == 2
    flat = LLM(target, draft_model=draft, speculative_config={"method": "draft_model"})
    assert flat.speculative_config.num_speculative_tokens == 2
    given = LLM(target, draft_model=draft, speculative_config={"num_speculative_tokens": 3})
    assert given.speculative_config.num_speculative_tokens == 3
    explicit = LLM(target, draft_model=draft, speculative_config=SpeculativeConfig())
    assert explicit.speculative_config.num_speculative_tokens == 4  # a config object is taken as it is
    assert EngineArgs(model=target, draft_model=draft).speculative_config().num_speculative_tokens == 2
    told = EngineArgs(model=target, draft_model=draft, num_speculative_tokens=3)
    assert told.speculative_config().num_speculative_tokens == 3
    plain = EngineArgs(model=target, draft_model=model_dirs["draft"])
    assert plain.speculative_config().num_speculative_tokens == 4


def test_a_draft_folder_declares_its_prompt_lookup_for_chains(model_dirs, tmp_path) -> None:
    draft = _declaring(model_dirs["draft"], tmp_path, 2, prompt_lookup_min=2)
    assert with_draft_defaults({}, draft) == {"num_speculative_tokens": 2, "prompt_lookup_min": 2}
    assert with_draft_defaults({"prompt_lookup_min": 0}, draft)["prompt_lookup_min"] == 0
    assert "prompt_lookup_min" not in with_draft_defaults({"tree": "dynamic"}, draft)
    target = model_dirs["target"]
    assert LLM(target, draft_model=draft).speculative_config.options.prompt_lookup_min == 2
    off = EngineArgs(model=target, draft_model=draft, options={"prompt_lookup_min": 0})
    assert off.speculative_config().options.prompt_lookup_min == 0
    bad = _declaring(model_dirs["draft"], tmp_path / "bad", 2, prompt_lookup_min=-1)
    with pytest.raises(ValueError, match=r"generation_config.json.prompt_lookup_min must be 0 \(off\)"):
        with_draft_defaults({}, bad)


def test_a_longer_declared_lookup_chain_leaves_the_draft_its_own_k(model_dirs, tmp_path) -> None:
    """`prompt_lookup_num_tokens` above `num_assistant_tokens`, with the lookup on: the lookup's chain
    is num_speculative_tokens, the draft's its declared k; with the lookup off, or k given, k alone."""
    draft = _declaring(model_dirs["draft"], tmp_path, 1, prompt_lookup_min=2, prompt_lookup_num_tokens=4)
    both = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "num_assistant_tokens": 1}
    assert with_draft_defaults({}, draft) == both
    assert with_draft_defaults({"prompt_lookup_min": 0}, draft)["num_speculative_tokens"] == 1
    assert "num_assistant_tokens" not in with_draft_defaults({"num_speculative_tokens": 3}, draft)
    for own, k in ((2, 4), (6, 6), (0, 4)):  # the draft's own chain given, k not: k the longer chain
        assert with_draft_defaults({"num_assistant_tokens": own}, draft) == both | {
            "num_assistant_tokens": own,
            "num_speculative_tokens": k,
        }
    config = LLM(model_dirs["target"], draft_model=draft).speculative_config
    assert (
        config.num_speculative_tokens,
        config.options.prompt_lookup_min,
        config.options.num_assistant_tokens,
    ) == (
        4,
        2,
        1,
    )
    bad = _declaring(
        model_dirs["draft"], tmp_path / "bad", 1, prompt_lookup_min=2, prompt_lookup_num_tokens=0
    )
    with pytest.raises(
        ValueError, match=r"generation_config.json.prompt_lookup_num_tokens must be an integer"
    ):
        with_draft_defaults({}, bad)
