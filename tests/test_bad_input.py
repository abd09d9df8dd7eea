"""Bad input gets a clear error that names the problem, raised before any work starts."""

from __future__ import annotations

import pytest
from conftest import byte_tokenizer, tiny_model

import speculative.engine.engine as engine_module
from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.compiled import CompiledCausalLM
from speculative.proposers import CrossTokenizerProposer


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the engine starts running."""

    def refuse(self, requests):
        raise AssertionError("the engine ran before the input was checked")

    monkeypatch.setattr(engine_module.Engine, "run", refuse)


def test_empty_prompt(no_work) -> None:
    llm = LLM(tiny_model("llama"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []], SamplingParams())


def test_prompt_longer_than_context(no_work) -> None:
    llm = LLM(tiny_model("llama"))  # max_position_embeddings = 256
    with pytest.raises(ValueError, match=r"prompt 0 has 300 tokens and max_tokens=16.*context of 256"):
        llm.generate([[3] * 300], SamplingParams())
    with pytest.raises(ValueError, match=r"max_tokens=100.*context of 256"):
        llm.generate([[3] * 200], SamplingParams(max_tokens=100))


def test_token_ids_outside_vocabulary(no_work) -> None:
    llm = LLM(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"token ids outside \[0, 96\)"):
        llm.generate([[3, 96]])


def test_text_prompt_without_tokenizer(no_work) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(tiny_model("llama")).generate("hello")


@pytest.mark.parametrize("k", [-1, 0, 33])
def test_bad_k(k) -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 32\]"):
        SpeculativeConfig(num_speculative_tokens=k)


def test_draft_with_another_vocabulary() -> None:
    with pytest.raises(
        ValueError, match=r"draft model's vocabulary \(100 tokens\) differs from the target's \(96\) and the "
    ):
        LLM(tiny_model("llama"), draft_model=tiny_model("llama", vocab_size=100))


def test_draft_with_another_tokenizer(tmp_path) -> None:
    """Same vocabulary size, but the draft's tokenizer maps tokens to other ids: it drafts across
    tokenizers (tests/test_cross_tokenizer.py)."""
    tokenizer, other = byte_tokenizer(), byte_tokenizer()
    tokenizer.add_tokens(["<a>"])
    other.add_tokens(["<b>"])
    model = tiny_model("llama", vocab_size=len(tokenizer))
    for name, tok in (("target", tokenizer), ("draft", other)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    llm = LLM(str(tmp_path / "target"), draft_model=str(tmp_path / "draft"))
    assert isinstance(llm.engine.proposer, CrossTokenizerProposer)


def test_method_and_draft_mismatch() -> None:
    with pytest.raises(ValueError, match=r"needs LLM\(draft_model=\.\.\.\)"):
        LLM(tiny_model("llama"), speculative_config=SpeculativeConfig(method="draft_model"))
    with pytest.raises(ValueError, match="uses no draft model"):
        LLM(
            tiny_model("llama"),
            draft_model=tiny_model("llama"),
            speculative_config=SpeculativeConfig(method="ngram"),
        )


def test_bad_draft_dtype() -> None:
    target = tiny_model()
    with pytest.raises(ValueError, match=r"draft_dtype must be 'auto', 'float32'.*got 'int8'"):
        LLM(target, draft_model=target, draft_dtype="int8")
    with pytest.raises(
        ValueError, match="draft_dtype is the draft model's dtype: give it with a draft_model"
    ):
        LLM(target, speculative_config=SpeculativeConfig("ngram"), draft_dtype="float32")


def test_bad_draft_compile() -> None:
    target = tiny_model()
    with pytest.raises(ValueError, match=r"LLM.draft_compile must be None, True or False; got 'yes'"):
        LLM(target, draft_model=target, draft_compile="yes")
    with pytest.raises(ValueError, match="and decoding without speculation has none: drop draft_compile"):
        LLM(target, draft_compile=True)
    with pytest.raises(ValueError, match=r'SpeculativeConfig\(method="ngram"\) has none'):
        LLM(target, speculative_config=SpeculativeConfig("ngram"), draft_compile=False)


def test_draft_compile_compiles_the_drafter_whatever_compile_says() -> None:
    """Wrapping only: nothing compiles until a call."""
    target, draft = tiny_model("llama"), tiny_model("llama")
    for compile, draft_compile, want in ((False, True, True), (True, False, False), (True, None, True)):
        llm = LLM(target, draft_model=draft, compile=compile, draft_compile=draft_compile)
        assert isinstance(llm.target.model, CompiledCausalLM) is compile
        assert isinstance(llm.draft.model, CompiledCausalLM) is want


def test_mismatched_params_list(no_work) -> None:
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        LLM(tiny_model("llama")).generate([[1], [2]], [SamplingParams()])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("method", "medusa", 'method must be one of "dflash", "draft_model", "eagle", .*"suffix"'),
        ("acceptance", "maybe", 'acceptance must be one of "rejection", "typical"'),
        ("posterior_threshold", 1.5, r"posterior_threshold must be in \[0, 1\]"),
        ("posterior_alpha", -1.0, "posterior_alpha must be >= 0"),
        ("prompt_lookup_min", 0, "prompt_lookup_min must be an integer >= 1"),
        ("prompt_lookup_max", 0, "prompt_lookup_max must be an integer >= prompt_lookup_min"),
    ],
)
def test_speculative_config_validation(field, value, message) -> None:
    owner = "NgramConfig" if field.startswith("prompt_lookup") else "SpeculativeConfig"
    with pytest.raises(ValueError, match=f"{owner}.{message}"):
        SpeculativeConfig.from_dict({"method": "ngram", field: value})
