"""A demo draft with a tokenizer of its own, for the demo target: `python -m
speculative.demo.train_cross_draft --pair models/demo --steps 1200`.

Trains, on the demo corpus's training files (the split of `speculative.demo.corpus`), a byte-level BPE of
`--vocab-size` tokens (4096: half the target's, so the two tokenize the same text differently) and a
1-layer Llama (SIZES: hidden 256; `--smoke`, the recipe's smoke draft) on that corpus encoded with it:
next-token cross-entropy (the vocabularies differ, so no distillation from the target's distribution),
the recipe's schedule and `train_loop`. Nothing of it depends on the target: only its acceptance is
measured against it. It is written to `<pair>/cross-draft/` (a Hugging Face directory: config,
tokenizer, bf16 safetensors) with `training.json` (the training record and the greedy acceptance
measured through the engine: k = 4 chains on held-out prompts, of this draft drafting across
tokenizers and of the pair's same-vocabulary draft) and `README.md`, its card.

`--measure` trains nothing: it measures the saved draft's acceptance again, against the pair's target as
it is now (after the target was retrained, say), and rewrites `training.json`'s `acceptance` and the
card.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from speculative.demo import corpus
from speculative.demo.model_card import engine_acceptance, file_prompts
from speculative.demo.train import FULL, SMOKE, ce_loss, count_params, llama, save, train_loop
from speculative.machine import machine

VOCAB_SIZE = 4096
SMOKE_VOCAB_SIZE = 320  # the smoke target's is 384
# Its shape: that of the demo draft it was first trained beside (hidden 256), kept when the demo pair
# shrank (its training does not depend on the target).
SIZES = {
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def write_card(info: dict, path: Path) -> None:
    """The draft's card (`README.md` in `path`) from its training record `info`."""
    a = info["acceptance"]
    cap = f" --max-minutes {info['max_minutes']}" if info["max_minutes"] is not None else ""
    stop = f" (the --max-minutes {info['max_minutes']} cap stopped it)" if info["stopped_early"] else ""
    rows = "\n".join(
        f"| {name} | {a[name]['acceptance_rate']:.3f} | {a[name]['mean_accepted_length']:.2f} |"
        for name in ("cross-draft", "draft")
    )
    again = (
        ", measured again against the target as it is now (`--measure`)"
        if info.get("acceptance_measured_again")
        else ""
    )
    path.joinpath("README.md").write_text(
        f"""# A draft with its own tokenizer, for the demo target

A {info["num_hidden_layers"]}-layer Llama ({info["params"] / 1e6:.2f}M parameters, hidden
{info["hidden_size"]}) with its own byte-level BPE of {info["vocab_size"]} tokens (the target's has 8192):
it drafts for `models/demo/target` across tokenizers (`CrossTokenizerProposer`), chosen on its own by
`LLM("models/demo/target", draft_model="models/demo/cross-draft")`. Trained by
`python -m speculative.demo.train_cross_draft --pair models/demo --steps {info["planned_steps"]}{cap}` on the
demo corpus's training files encoded with its tokenizer ({info["train_tokens"]:,} tokens):
{info["steps"]} steps{stop} of {info["batch"]} windows of {info["seq_len"]} tokens, loss {info["loss"]}; final
train loss {info["final_train_loss"]}, held-out cross-entropy {info["final_heldout_ce"]} (per token of its
own vocabulary); {info["seconds"]} s of training on {info["machine"]["cpu"]}
({info["machine"]["nproc"]} CPUs, shared).

Greedy acceptance, k = {a["k"]} chains, {a["prompts"]} held-out prompts of {a["prompt_len"]} target
tokens, {a["new_tokens"]} new tokens each (training.json){again}; the rate counts target tokens:

| drafter | acceptance rate | mean tokens per step |
|---|---|---|
{rows}
"""
    )


def measure_acceptance(pair: Path, heldout_texts: list[str], cfg: dict, count: int, seed: int) -> dict:
    """training.json's `acceptance`: the saved cross-draft's and the pair's draft's, greedy, k = 4 chains
    through the engine, on `count` held-out prompts of the target's tokens."""
    target_tokenizer = corpus.PreTrainedTokenizerFast.from_pretrained(pair / "target")
    heldout_target = corpus.encode_files(target_tokenizer, heldout_texts)
    prompts = file_prompts(heldout_target, count, cfg["prompt_len"], seed).tolist()
    return {
        "prompts": count,
        "prompt_len": cfg["prompt_len"],
        "new_tokens": cfg["new_tokens"],
        "k": 4,
        **engine_acceptance(
            pair / "target",
            {"cross-draft": (pair / "cross-draft", "draft_model"), "draft": (pair / "draft", "draft_model")},
            prompts,
            cfg["new_tokens"],
            num_speculative_tokens=4,
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True, help="the pair's directory (target/, draft/)")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument(
        "--vocab-size", type=int, help=f"its BPE's size ({VOCAB_SIZE}; --smoke: {SMOKE_VOCAB_SIZE})"
    )
    parser.add_argument("--max-minutes", type=float, help="safety cap on training time (recorded if hit)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="the recipe's tiny sizes on a few files, in seconds"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="train nothing: measure the saved draft's acceptance against the pair's target again",
    )
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    start = time.monotonic()
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
    out = args.pair / "cross-draft"

    train_files, heldout_files = corpus.split_files(corpus.list_files())
    if cfg["files"] is not None:
        train_files, heldout_files = train_files[: cfg["files"][0]], heldout_files[: cfg["files"][1]]
    heldout_texts = corpus.read_texts(heldout_files)
    if args.measure:
        info = json.loads((out / "training.json").read_text())
        info["acceptance"] = measure_acceptance(args.pair, heldout_texts, cfg, args.prompts, args.seed)
        info["acceptance_measured_again"] = True
        (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        write_card(info, out)
        print(json.dumps(info["acceptance"], indent=2))
        return info

    train_texts = corpus.read_texts(train_files)
    vocab_size = args.vocab_size or (SMOKE_VOCAB_SIZE if args.smoke else VOCAB_SIZE)
    tokenizer = corpus.train_tokenizer(train_texts, vocab_size)
    tokenizer.model_max_length = cfg["seq_len"]
    eos = tokenizer.eos_token_id
    train_stream = corpus.token_stream(corpus.encode_files(tokenizer, train_texts), eos)
    heldout_stream = corpus.token_stream(corpus.encode_files(tokenizer, heldout_texts), eos)
    heldout = corpus.even_windows(heldout_stream, cfg["eval_windows"], cfg["seq_len"])

    torch.manual_seed(args.seed)
    sizes = cfg["draft"] if args.smoke else SIZES
    draft = llama(sizes, len(tokenizer), cfg["seq_len"], eos)
    record = train_loop(
        "cross-draft",
        draft,
        ce_loss,
        train_stream,
        heldout,
        cfg,
        args.steps,
        cfg["draft_lr"],
        args.seed + 3,
        deadline,
    )
    save(draft, tokenizer, out)

    info = {
        "target": str(args.pair / "target"),
        **sizes,
        "vocab_size": len(tokenizer),
        "params": count_params(draft),
        "loss": "next-token cross-entropy on the corpus in its own tokens",
        "train_tokens": len(train_stream),
        "batch": cfg["batch"],
        "seq_len": cfg["seq_len"],
        "max_minutes": args.max_minutes,
        **record,
        "acceptance": measure_acceptance(args.pair, heldout_texts, cfg, args.prompts, args.seed),
        "machine": machine(),
    }
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    write_card(info, out)
    print(json.dumps(info["acceptance"], indent=2))
    return info


if __name__ == "__main__":
    main()
