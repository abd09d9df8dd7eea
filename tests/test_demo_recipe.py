"""The demo-model recipe: its smoke run writes loadable Hugging Face directories; the split is fixed."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative.demo import corpus, train


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    train.main(["--out", str(out), "--smoke"])
    return out


@pytest.mark.parametrize("name", ["target", "draft"])
def test_smoke_outputs_load_and_generate(smoke_dir, name):
    path = smoke_dir / name
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / f).exists(), f
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.dtype == torch.bfloat16
    assert tok.eos_token == tok.bos_token == tok.pad_token == corpus.EOT
    assert tok.chat_template == corpus.CHAT_TEMPLATE
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())  # as committed
    for file in ("tokenizer.json", "tokenizer_config.json"):  # the draft's: links to the target's
        assert (path / file).is_symlink() == (name == "draft")
    ids = tok("def add(a, b):\n", return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tok.eos_token_id
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tok.decode(out[0], skip_special_tokens=True), str)


def test_smoke_card_and_numbers(smoke_dir):
    info = json.loads((smoke_dir / "training.json").read_text())
    assert 0.0 <= info["acceptance"]["greedy_acceptance_rate"] <= 1.0
    assert info["target"]["steps"] == info["target"]["planned_steps"] and not info["draft"]["stopped_early"]
    card = (smoke_dir / "README.md").read_text()
    assert "Greedy acceptance rate" in card and "nproc" in card


def test_split_is_fixed_and_disjoint():
    files = corpus.list_files()
    assert files == sorted(files) and not any("site-packages" in f for f in files)
    train_files, heldout = corpus.split_files(files)
    assert set(train_files).isdisjoint(heldout) and len(train_files) + len(heldout) == len(files)
    assert 0.02 < len(heldout) / len(files) < 0.06
    assert corpus.split_files(files) == (train_files, heldout)
    # membership depends on the relative path alone, not on which other files exist
    assert [f for f in files[::7] if corpus.is_heldout(f)] == [f for f in heldout if f in set(files[::7])]
    assert corpus.is_heldout("a/b.py") == corpus.is_heldout("a/b.py")


def test_same_seed_same_smoke_losses(smoke_dir, tmp_path):
    again = train.main(["--out", str(tmp_path), "--smoke"])
    first = json.loads((smoke_dir / "training.json").read_text())
    for name in ("target", "draft"):
        assert again[name]["final_train_loss"] == first[name]["final_train_loss"]
        assert again[name]["final_heldout_ce"] == first[name]["final_heldout_ce"]


def test_committed_pair_loads_with_plain_transformers_and_writes_code() -> None:
    """The committed demo pair, through transformers alone: same tokenizer, code-like greedy text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speculative.demo import DEMO_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    assert AutoTokenizer.from_pretrained(DEMO_DIR / "draft").get_vocab() == tokenizer.get_vocab()
    for file in ("tokenizer.json", "tokenizer_config.json"):  # one copy in the pair, as the recipe writes it
        assert (DEMO_DIR / "draft" / file).resolve() == (DEMO_DIR / "target" / file).resolve()
    assert tokenizer.chat_template == corpus.CHAT_TEMPLATE  # the recipe's, which the draft's equals too
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(DEMO_DIR / name).eval()
        assert model.dtype == torch.bfloat16 and model.config.model_type == "llama"
        ids = tokenizer("class Stack:\n    def __init__(self):\n", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert "\n    " in text and any(c in text for c in "=()"), text  # indented Python statements


def test_smoke_cross_draft_drafts_for_the_smoke_target(smoke_dir):
    """The cross-tokenizer draft's recipe (train_cross_draft --smoke) on the smoke pair: its own
    tokenizer, a card, and a measured acceptance of drafts that keep the target's greedy text."""
    from speculative.demo import train_cross_draft

    info = train_cross_draft.main(["--pair", str(smoke_dir), "--smoke", "--steps", "4", "--prompts", "2"])
    out = smoke_dir / "cross-draft"
    assert (
        len(AutoTokenizer.from_pretrained(out))
        == info["vocab_size"]
        != len(AutoTokenizer.from_pretrained(smoke_dir / "target"))
    )
    assert json.loads((out / "training.json").read_text())["acceptance"] == info["acceptance"]
    assert info["acceptance"]["cross-draft"]["mean_accepted_length"] >= 1.0
    assert (out / "README.md").read_text().startswith("#")


@pytest.mark.parametrize("native", [True, False])
def test_the_recipes_train_in_bfloat16_only_where_the_cpu_computes_it(monkeypatch, native) -> None:
    """train_loop (the toy pair's, its EAGLE heads' and DFlash drafters' training) runs its losses
    under bfloat16 autocast only where the CPU computes bfloat16 natively: elsewhere a bfloat16 matmul
    runs in generic code, an EAGLE head's step 14 times as long on an AVX2-only CPU."""
    monkeypatch.setattr(train, "cpu_computes_natively", lambda dtype: native)
    model, seen = torch.nn.Linear(4, 1), []

    def loss_fn(m, windows):
        seen.append(torch.is_autocast_enabled("cpu"))
        return m(windows[:, :4].float()).square().mean()

    cfg = {"warmup": 1, "batch": 2, "seq_len": 4, "eval_every": 100}
    stream, heldout = torch.arange(64), torch.arange(10).reshape(2, 5)
    train.train_loop("t", model, loss_fn, stream, heldout, cfg, 3, 1e-3, 0, None, ce=loss_fn)
    assert seen == [native] * len(seen) and len(seen) == 4  # 3 steps and the final held-out figure
