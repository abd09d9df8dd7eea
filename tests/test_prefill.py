"""The prefill of prompts of different lengths: a few forwards of similar lengths, each row's result
that of its prompt alone."""

from __future__ import annotations

from conftest import noisy_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.llama import NativeCausalLM
from speculative.models.prefill import MAX_PREFILL_GROUPS, PREFILL_PADDING, prefill_groups


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_prefill_groups_cover_every_row_once_with_little_padding(lengths: list[int]) -> None:
    groups = prefill_groups(lengths)
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    assert 1 <= len(groups) <= MAX_PREFILL_GROUPS
    widths = [lengths[group[0]] for group in groups]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    for group, width in zip(groups, widths):
        assert all(lengths[row] <= width for row in group)
        if group is not groups[-1]:  # the last group also takes the rest once there are MAX_PREFILL_GROUPS
            assert all(width - lengths[row] <= max(PREFILL_PADDING, width // 8) for row in group)
    assert prefill_groups([50] * 7) == [list(range(7))]


@given(st.lists(st.integers(1, 60), min_size=1, max_size=40))
def test_exact_prefill_groups_hold_rows_of_one_length_each(lengths: list[int]) -> None:
    groups = prefill_groups(lengths, exact=True)
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    descending = sorted(set(lengths), reverse=True)
    assert [{lengths[row] for row in group} for group in groups] == [{n} for n in descending]


class LoggedModel:
    """Wraps a model and records the shape of every forward's input_ids."""

    def __init__(self, model) -> None:
        self.model, self.shapes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids, cache, num_tokens=None, logits_indices=None):
        self.shapes.append(tuple(input_ids.shape))
        return self.model.forward(input_ids, cache, num_tokens, logits_indices)


def test_prompts_of_different_lengths_are_prefilled_in_groups_and_decode_as_alone() -> None:
    hf = tiny_model("llama", vocab_size=96)
    target = LoggedModel(NativeCausalLM.from_hf(hf))
    llm = LLM(
        target,
        draft_model=noisy_copy(hf, 0.05),
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    prompts = [[(7 * i + j) % 90 + 2 for j in range(n)] for i, n in enumerate((3, 90, 40, 88, 41))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=12, ignore_eos=True)
    params = [greedy, sampled, greedy, greedy, sampled]
    alone = [llm.generate([p], s)[0] for p, s in zip(prompts, params)]
    target.shapes.clear()
    together = llm.generate(prompts, params)
    # groups, longest first: 90 and 88; 41 and 40; 3. The seeded prompts' two sequences share a row.
    assert target.shapes[:3] == [(2, 90), (2, 41), (1, 3)]
    for a, b in zip(alone, together):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
