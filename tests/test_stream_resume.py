"""Streaming and pause / resume: SampleState, GenerationConfig, LLM.stream / LLM.resume."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import byte_tokenizer, noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.config import GenerationConfig
from speculative.engine.state import SampleState

PROMPTS = ["def f(x):", "import os\n", "class A:", "# note"]


def make_llm(seed: int = 0) -> LLM:
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    return LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        tokenizer=tokenizer,
        seed=seed,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True),
}
CONFIG = GenerationConfig(streaming_chunks=2)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_resume_equals_uninterrupted_run(batch, mode) -> None:
    prompts, params = PROMPTS[:batch], PARAMS[mode]
    full = list(make_llm().stream(prompts, params, config=CONFIG))
    final = full[-1]
    assert final.finished and all(len(s) - p == 40 for s, p in zip(final.sequences, final.prompt_lengths))
    for chunks in (1, 2, 5):
        state = SampleState.from_json(full[chunks - 1].to_json())
        assert not state.finished
        resumed = list(make_llm(seed=123).resume(state, CONFIG))  # another engine seed: state rules
        assert resumed[-1].sequences == final.sequences
        assert resumed[-1].text == final.text


def test_resume_in_a_new_process(tmp_path) -> None:
    llm = make_llm()
    states = list(llm.stream(PROMPTS, PARAMS["seeded"], config=CONFIG))
    path = tmp_path / "state.json"
    path.write_text(states[1].to_json())
    script = textwrap.dedent(f"""
        import sys, json
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_stream_resume import make_llm, CONFIG
        from speculative.engine.state import SampleState
        state = SampleState.from_json(open({str(path)!r}).read())
        print(json.dumps(list(make_llm(seed=9).resume(state, CONFIG))[-1].sequences))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import json

    assert json.loads(result.stdout.strip().splitlines()[-1]) == states[-1].sequences


def test_chunks_concatenate_to_the_final_text_without_split_characters() -> None:
    tokenizer = byte_tokenizer()
    multi_byte = [
        tokenizer.convert_tokens_to_ids(t)
        for t in tokenizer.convert_ids_to_tokens(tokenizer("éa€")["input_ids"])
    ]  # the bytes of é (2) and € (3), and "a"
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=60, ignore_eos=True, allowed_token_ids=multi_byte
    )
    states = list(make_llm().stream(["x", "y"], params, config=GenerationConfig(streaming_chunks=1)))
    final = states[-1].text
    assert any(ch in "é€" for ch in final[0] + final[1])
    for row in range(2):
        assert "".join(s.new_text[row] for s in states) == final[row]
        for s in states:
            assert final[row].startswith(s.text[row])


def test_states_carry_progress_and_figures() -> None:
    states = list(
        make_llm().stream(PROMPTS[:2], PARAMS["greedy"], config=GenerationConfig(streaming_chunks=3))
    )
    assert len(states) >= 3
    generated = [s.generated_tokens for s in states]
    assert generated == sorted(generated) and generated[-1] == 80
    last = states[-1]
    assert last.padded().shape == (2, last.padded_length) and last.time_spent_computing > 0
    assert last.metrics[0]["num_steps"] > 0 and last.prng_key["default"]
    assert last.replace(generated_tokens=0).generated_tokens == 0


def test_generation_config() -> None:
    config = GenerationConfig(
        max_new_tokens=7,
        num_return_sequences=2,
        eos_token_id=[5, 6],
        bos_token_id=256,
        sampling_params=SamplingParams(temperature=0.9, top_k=4),
    )
    assert GenerationConfig.from_json(config.to_json()) == config
    assert config.replace(streaming_chunks=3).streaming_chunks == 3
    params = config.request_params()
    assert params.max_tokens == 7 and params.n == 2 and params.top_k == 4
    last = list(make_llm().stream(["ab"], config=config))[-1]
    assert len(last.sequences) == 2 and all(s[0] == 256 for s in last.sequences)
    for seq, plen in zip(last.sequences, last.prompt_lengths):
        out = seq[plen:]
        assert len(out) == 7 or out[-1] in (5, 6)
    for bad, message in [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(streaming_chunks=-1), "streaming_chunks must be an integer >= 1"),
        (dict(eos_token_id=[]), "eos_token_id must be None, an integer >= 0 or a non-empty list"),
        (dict(sampling_params={}), "sampling_params must be a SamplingParams or None"),
    ]:
        with pytest.raises(ValueError, match="GenerationConfig." + message):
            GenerationConfig(**bad)
