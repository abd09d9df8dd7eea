"""A draft model's draft vocabulary (FR-Spec): its lm_head keeps some rows, the output stays exact."""

from __future__ import annotations

import json

import pytest
import test_distribution as dist
import torch
from conftest import byte_tokenizer, noisy_copy, tiny_model
from scipy.stats import chi2

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.draft_vocabulary import VOCABULARY_FILE, read_draft_vocabulary
from speculative.models.llama import NativeCausalLM


def test_restricted_logits_are_the_rows_kept_and_minus_infinity_elsewhere() -> None:
    model = tiny_model("llama", vocab_size=96)
    native = NativeCausalLM.from_hf(model)
    ids = torch.tensor([[3, 5, 7, 9]])
    full = native.forward(ids, native.new_cache(1, 8))
    kept = torch.tensor([5, 0, 17, 95, 40])
    native.restrict_vocabulary(kept)
    cut = native.forward(ids, native.new_cache(1, 8))
    assert native.lm_head.weight.shape == (5, model.config.hidden_size)
    torch.testing.assert_close(cut[..., kept], full[..., kept])
    outside = torch.ones(96, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(cut[..., outside]).all()
    assert native.draft_vocabulary.tolist() == kept.tolist()
    assert native.state_dict()["d2t"].tolist() == (kept - torch.arange(5)).tolist()


@pytest.mark.parametrize("bad", [[], [1, 1], [-1], [96], [[1, 2]]])
def test_a_bad_draft_vocabulary_is_refused(bad) -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama", vocab_size=96))
    with pytest.raises(ValueError, match="distinct token ids in \\[0, 96\\)"):
        native.restrict_vocabulary(torch.tensor(bad, dtype=torch.long))


def save_pair(tmp_path, vocabulary: list[int] | None, vocab_size: int = 257, noise: float = 0.02):
    """A tiny target and its noisy-copy draft saved as folders (byte tokenizer), the draft with
    VOCABULARY_FILE when `vocabulary` is given; (target model, target path, draft path)."""
    tokenizer = byte_tokenizer() if vocab_size == 257 else None
    eos = 256 if vocab_size == 257 else 1
    target = tiny_model("llama", vocab_size=vocab_size, eos_token_id=eos, bos_token_id=eos)
    paths = []
    for name, model in (("target", target), ("draft", noisy_copy(target, noise))):
        model.save_pretrained(tmp_path / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_path / name)
        paths.append(str(tmp_path / name))
    if vocabulary is not None:
        (tmp_path / "draft" / VOCABULARY_FILE).write_text(json.dumps({"token_ids": vocabulary}))
    return target, *paths


def test_a_draft_folder_with_a_vocabulary_drafts_only_its_tokens_and_stays_exact(tmp_path) -> None:
    """Greedy output equals the target's alone, the draft's lm_head holds the vocabulary's rows, and
    no proposal leaves the vocabulary."""
    vocabulary = list(range(0, 257, 2))  # every other byte token and EOS
    _, target, draft = save_pair(tmp_path, vocabulary)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["def add(a, b):", "hello world"]
    plain = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, draft_model=draft, dtype="float32")
    assert llm.draft.model.lm_head.out_features == len(vocabulary)
    proposed = []
    propose = llm.engine.proposer.propose

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        proposed.extend(proposal.token_ids.flatten().tolist())
        return proposal

    llm.engine.proposer.propose = recording
    speculative = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]
    assert proposed and set(proposed) <= set(vocabulary)
    assert sum(o.metrics.num_accepted for o in speculative) > 0


def test_sampled_output_follows_the_target_with_a_draft_vocabulary(tmp_path) -> None:
    """Chi-square over every 3-token continuation (test_distribution.py's helpers) with a draft that
    may propose only half the vocabulary, at temperature 0.8 and top-k 6."""
    target, target_path, draft = save_pair(tmp_path, [0, 2, 3, 5], vocab_size=dist.VOCAB, noise=0.3)
    llm = LLM(
        target_path,
        draft_model=draft,
        speculative_config=SpeculativeConfig(num_speculative_tokens=2),
        dtype="float32",
        seed=11,
    )
    assert llm.draft.model.lm_head.out_features == 4
    prompt = [2, 3, 2, 5]
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=dist.LENGTH, ignore_eos=True)
    samples = dist.sample(llm, [prompt] * dist.SAMPLES, [params] * dist.SAMPLES)
    stat, dof = dist.chi_square(samples, dist.exact_probs(target, prompt, 0.8, 6))
    assert chi2.sf(stat, dof) > 1e-3


def test_a_malformed_vocabulary_file_names_itself(tmp_path) -> None:
    (tmp_path / VOCABULARY_FILE).write_text(json.dumps({"token_ids": "all"}))
    with pytest.raises(ValueError, match=VOCABULARY_FILE):
        read_draft_vocabulary(tmp_path)
    assert read_draft_vocabulary(tmp_path / "nothing") is None
