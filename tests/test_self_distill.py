"""Requests a target writes itself (speculative.demo.self_distill.sampled_requests), on a tiny target
whose next token is set by its current one: after the user turn's opening it writes REQUEST and ends
the turn."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import byte_tokenizer, tiny_model

from speculative import LLM
from speculative.demo.self_distill import read_answers, sampled_requests, user_turn_opening

# The turn ends with the tokenizer's one special token, as ChatML's <|im_end|> does.
TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)
REQUEST = "Explain rockets?"  # every character once: each one's successor is the next


def writer(tmp_path, text: str, ends: bool = True) -> LLM:
    """An LLM whose target, after a newline, writes `text` (distinct characters) and then
    <|endoftext|>, or `text` again and again where not `ends`: its layers add nothing to the residual
    stream, so its logits read the current token's (one-hot) embedding."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    ids = tokenizer("\n" + text, add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.eos_token_id if ends else ids[1])
    model = tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for slot, (token, following) in enumerate(itertools.pairwise(ids)):
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = 10.0
    model.save_pretrained(tmp_path / "writer")
    tokenizer.save_pretrained(tmp_path / "writer")
    return LLM(str(tmp_path / "writer"), dtype="float32")


def test_the_opening_of_a_user_turn_and_its_end() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    opening, end = user_turn_opening(tokenizer)
    assert tokenizer.decode(opening) == "<|endoftext|>user\n" and end == tokenizer.eos_token_id
    tokenizer.chat_template = TEMPLATE.replace("<|endoftext|>\n{% endfor", "\n{% endfor")
    with pytest.raises(ValueError, match="special token"):
        user_turn_opening(tokenizer)


def test_a_target_writes_its_own_request_once_and_a_rerun_resumes(tmp_path) -> None:
    llm = writer(tmp_path, REQUEST)
    path = tmp_path / "requests.jsonl"
    assert sampled_requests(llm, 1, path, batch=2) == [REQUEST]
    assert read_answers(path) == [{"request": REQUEST, "sample": 0}]
    assert sampled_requests(llm, 1, path, batch=2) == [REQUEST]  # read back, nothing sampled
    with pytest.raises(RuntimeError, match="1 usable requests of 2"):  # the same text is kept once
        sampled_requests(llm, 2, path, batch=2)
    assert json.loads(path.read_text().splitlines()[-1])["request"] == REQUEST


def test_a_sample_that_never_ends_its_turn_is_not_kept(tmp_path) -> None:
    llm = writer(tmp_path, REQUEST, ends=False)
    with pytest.raises(RuntimeError, match="0 usable requests of 1"):
        sampled_requests(llm, 1, tmp_path / "requests.jsonl", batch=2, max_tokens=20)
