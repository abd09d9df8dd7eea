"""The draft recipe for any target (speculative.demo.train_draft), end to end on a tiny chat target."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHATML, byte_tokenizer, tiny_model
from transformers import AutoModelForCausalLM

from speculative import LLM, SamplingParams
from speculative.demo import train_draft
from speculative.demo.instructions import written_requests
from speculative.demo.self_distill import read_answers
from speculative.models.draft_vocabulary import read_draft_vocabulary


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny tied chat target (byte tokenizer, ChatML template) and the recipe's draft for it."""
    root = tmp_path_factory.mktemp("recipe")
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML
    eos = tokenizer.eos_token_id
    target = tiny_model(
        "llama", vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos
    )
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    argv = [
        "--target", str(root / "target"), "--out", str(root / "draft"), "--package", str(root / "package"),
        "--chats", "6", "--followed", "6", "--sampled", "0", "--written", "3", "--written-followed", "1",
        "--answer-tokens", "12", "--answer-batch", "4",
        "--hidden", "32", "--layers", "1", "--intermediate", "64", "--draft-vocab", "40", "--steps", "4",
        "--warmup", "1", "--eval-every", "2", "--batch-tokens", "512",
    ]  # fmt: skip
    info = train_draft.main(argv)
    return root, target, info


def test_the_recipe_writes_a_draft_that_speculates_exactly(trained) -> None:
    root, target, info = trained
    answers = read_answers(root / "draft" / "data" / "first.jsonl")
    assert len(answers) == 6 and len(read_answers(root / "draft" / "data" / "second.jsonl")) == 12
    written = read_answers(root / "draft" / "data" / "written.jsonl")
    tokenizer = LLM(str(root / "target"), dtype="float32").tokenizer
    for answer, chat in zip(written, written_requests(3), strict=True):  # the bundled requests, in order
        assert chat[0]["content"] in tokenizer.decode(answer["prompt"])
    seconds = read_answers(root / "draft" / "data" / "written-second.jsonl")
    asked = written_requests(1)[0][0]["content"][-30:]  # the conversation goes on (cut on the left)
    assert len(seconds) == 2 and asked in tokenizer.decode(seconds[0]["prompt"])
    assert info["answers"] == 23 and info["training"]["steps"] == 4
    assert train_draft.stored_answers(root / "draft" / "data")[18:] == written + seconds
    vocabulary = read_draft_vocabulary(root / "draft")
    assert len(vocabulary) == 40 and int(target.config.eos_token_id) == int(vocabulary[0])
    draft = AutoModelForCausalLM.from_pretrained(root / "draft")
    assert draft.config.hidden_size == 32 and draft.config.vocab_size == target.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    plain = LLM(str(root / "target"), dtype="float32").generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(str(root / "target"), draft_model=str(root / "draft"), dtype="float32")
    assert llm.draft.model.lm_head.out_features == 40
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == plain
    card = (root / "draft" / "README.md").read_text()
    assert "tokens a step" in card and "No data set was downloaded" in card
    assert "3 of the requests written one by one" in card
    assert json.loads((root / "draft" / "training.json").read_text())["engine"]["k"] == 4


def test_a_packaged_draft_assembles_into_the_same_draft(trained, tmp_path) -> None:
    """The committed form (no embedding) rebuilt from the target's embedding gives the same weights."""
    root, _, _ = trained
    assert (root / "package" / train_draft.PACKAGE_FILE).is_file()
    assert not any(
        "embed" in k
        for k in _tensors(root / "package" / train_draft.PACKAGE_FILE)
        if k != "embedding_projection"
    )
    out = train_draft.assemble_draft(root / "package", root / "target", tmp_path / "assembled")
    assembled = AutoModelForCausalLM.from_pretrained(out).state_dict()
    original = AutoModelForCausalLM.from_pretrained(root / "draft").state_dict()
    assert assembled.keys() == original.keys()
    for name, tensor in original.items():  # the package keeps bf16 layers: the rounding apart, equal
        torch.testing.assert_close(assembled[name], tensor, atol=1e-2, rtol=1e-2)
    assert read_draft_vocabulary(out).tolist() == read_draft_vocabulary(root / "draft").tolist()


def test_an_assembled_draft_keeps_the_k_its_package_declares(trained, tmp_path) -> None:
    """The package's generation config (num_assistant_tokens: the draft's k) reaches the assembled
    folder, where LLM takes it as the draft's k."""
    root, _, _ = trained
    package = tmp_path / "package"
    package.mkdir()
    for path in (root / "package").iterdir():
        (package / path.name).write_bytes(path.read_bytes())
    declared = json.loads((package / "generation_config.json").read_text()) | {"num_assistant_tokens": 2}
    (package / "generation_config.json").write_text(json.dumps(declared))
    out = train_draft.assemble_draft(package, root / "target", tmp_path / "assembled")
    assert json.loads((out / "generation_config.json").read_text())["num_assistant_tokens"] == 2
    llm = LLM(str(root / "target"), draft_model=str(out), dtype="float32")
    assert llm.speculative_config.num_speculative_tokens == 2


def _tensors(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_draft_config_takes_the_targets_head_size_and_kv_ratio() -> None:
    target = tiny_model("llama", hidden_size=64).config  # 4 heads of 16, 2 KV heads
    config = train_draft.draft_config(target, hidden=48, layers=2, intermediate=96)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (3, 1, 16)
    with pytest.raises(ValueError, match="--hidden must be a multiple of the target's head size 16"):
        train_draft.draft_config(target, hidden=40, layers=1, intermediate=64)


def test_a_packaged_draft_goes_on_training(trained, tmp_path) -> None:
    """--resume starts from the package's weights and vocabulary (its answers reused: --data)."""
    root, _, _ = trained
    argv = [
        "--target", str(root / "target"), "--out", str(tmp_path / "more"), "--resume", str(root / "package"),
        "--data", str(root / "draft" / "data"), "--chats", "6", "--followed", "6", "--sampled", "0",
        "--steps", "2", "--warmup", "1", "--eval-every", "5", "--batch-tokens", "512",
    ]  # fmt: skip
    info = train_draft.main(argv)
    assert info["training"]["steps"] == 2
    assert read_draft_vocabulary(tmp_path / "more").tolist() == read_draft_vocabulary(root / "draft").tolist()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "more").config.hidden_size == 32


def test_the_teacher_gives_the_targets_top_distribution_over_the_draft_vocabulary(trained) -> None:
    root, target, _ = trained
    answers = train_draft.stored_answers(root / "draft" / "data")[:3]
    vocabulary = read_draft_vocabulary(root / "draft")
    rows = train_draft.training_rows(answers, vocabulary, 64)
    soft = train_draft.teacher_targets(target, rows, vocabulary, 5, 512)
    for (tokens, labels), (indices, probs) in zip(rows, soft):
        with torch.no_grad():
            logits = target(tokens[None]).logits[0, labels >= 0][:, vocabulary].float()
        expected = logits.softmax(-1)
        assert indices.shape == probs.shape == (int((labels >= 0).sum()), 5)
        kept = expected.gather(1, indices.long())  # the target's most likely draft tokens, renormalized
        torch.testing.assert_close(probs.float(), kept / kept.sum(-1, keepdim=True), atol=3e-2, rtol=0)
        assert (kept.min(-1).values >= expected.topk(5).values[:, -1] - 3e-2).all()


def test_a_batchs_teacher_targets_line_up_with_its_labelled_positions(trained) -> None:
    """batch_targets concatenates the rows' targets in the order logits[labels >= 0] takes them."""
    root, _, _ = trained
    answers = train_draft.stored_answers(root / "draft" / "data")
    vocabulary = read_draft_vocabulary(root / "draft")
    rows = train_draft.training_rows(answers, vocabulary, 64)
    one_hot = [(labels[labels >= 0][:, None].to(torch.int16), torch.ones(int((labels >= 0).sum()), 1).half())
               for _, labels in rows]  # fmt: skip
    group = [5, 0, 11, 3]  # rows of different lengths, not in order
    _, _, labels = train_draft.collate(rows, group)
    indices, probs = train_draft.batch_targets(one_hot, group)
    assert indices[:, 0].long().tolist() == labels[labels >= 0].tolist()
    logits = torch.randn(len(indices), len(vocabulary))
    hard = torch.nn.functional.cross_entropy(logits, labels[labels >= 0])
    torch.testing.assert_close(train_draft.soft_loss(logits, (indices, probs)), hard)


def test_the_recipe_learns_the_targets_distribution_with_soft_top(trained, tmp_path) -> None:
    root, _, _ = trained
    argv = [
        "--target", str(root / "target"), "--out", str(tmp_path / "soft"), "--resume", str(root / "package"),
        "--data", str(root / "draft" / "data"), "--chats", "6", "--followed", "6", "--sampled", "0",
        "--soft-top", "8", "--steps", "2", "--warmup", "1", "--eval-every", "5", "--batch-tokens", "512",
    ]  # fmt: skip
    info = train_draft.main(argv)
    assert info["training"]["steps"] == 2 and info["args"]["soft_top"] == 8
    assert "its 8 most likely tokens (--soft-top)" in (tmp_path / "soft" / "README.md").read_text()
