"""A demo draft with a tokenizer of its own, for the demo target: `python -m
speculative.demo.train_cross_draft --pair models/demo --steps 1200`.

Trains, on the demo corpus's training files (the split of `speculative.demo.corpus`), a byte-level BPE of
`--vocab-size` tokens (4096: half the target's, so the two tokenize the same text differently) and a
1-layer Llama of the demo draft's shape on that corpus encoded with it: next-token cross-entropy (the
vocabularies differ, so no distillation from the target's distribution), the recipe's schedule and
`train_loop`. It is written to `<pair>/cross-draft/` (a Hugging Face directory: config, tokenizer, bf16
safetensors) with `training.json` (the training record and the greedy acceptance measured through the
engine: k = 4 chains on held-out prompts, of this draft drafting across tokenizers and of the pair's
same-vocabulary draft) and `README.md`, its card.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from speculative.demo import corpus
from speculative.demo.model_card import engine_acceptance, file_prompts, machine
from speculative.demo.train import FULL, SMOKE, ce_loss, count_params, llama, save, train_loop

VOCAB_SIZE = 4096
SMOKE_VOCAB_SIZE = 320  # the smoke target's is 384


def write_card(info: dict, path: Path) -> None:
    """The draft's card (`README.md` in `path`) from its training record `info`."""
    a = info["acceptance"]
    cap = f" --max-minutes {info['max_minutes']}" if info["max_minutes"] is not None else ""
    stop = f" (the --max-minutes {info['max_minutes']} cap stopped it)" if info["stopped_early"] else ""
    rows = "\n".join(
        f"| {name} | {a[name]['acceptance_rate']:.3f} | {a[name]['mean_accepted_length']:.2f} |"
        for name in ("cross-draft", "draft")
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
tokens, {a["new_tokens"]} new tokens each (training.json); the rate counts target tokens:

| drafter | acceptance rate | mean tokens per step |
|---|---|---|
{rows}
"""
    )


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
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    start = time.monotonic()
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
    out = args.pair / "cross-draft"

    train_files, heldout_files = corpus.split_files(corpus.list_files())
    if cfg["files"] is not None:
        train_files, heldout_files = train_files[: cfg["files"][0]], heldout_files[: cfg["files"][1]]
    train_texts = corpus.read_texts(train_files)
    vocab_size = args.vocab_size or (SMOKE_VOCAB_SIZE if args.smoke else VOCAB_SIZE)
    tokenizer = corpus.train_tokenizer(train_texts, vocab_size)
    tokenizer.model_max_length = cfg["seq_len"]
    eos = tokenizer.eos_token_id
    train_stream = corpus.token_stream(corpus.encode_files(tokenizer, train_texts), eos)
    heldout_texts = corpus.read_texts(heldout_files)
    heldout_stream = corpus.token_stream(corpus.encode_files(tokenizer, heldout_texts), eos)
    heldout = corpus.even_windows(heldout_stream, cfg["eval_windows"], cfg["seq_len"])

    torch.manual_seed(args.seed)
    draft = llama(cfg["draft"], len(tokenizer), cfg["seq_len"], eos)
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

    target_tokenizer = corpus.PreTrainedTokenizerFast.from_pretrained(args.pair / "target")
    heldout_target = corpus.encode_files(target_tokenizer, heldout_texts)
    prompts = file_prompts(heldout_target, args.prompts, cfg["prompt_len"], args.seed).tolist()
    info = {
        "target": str(args.pair / "target"),
        **cfg["draft"],
        "vocab_size": len(tokenizer),
        "params": count_params(draft),
        "loss": "next-token cross-entropy on the corpus in its own tokens",
        "train_tokens": len(train_stream),
        "batch": cfg["batch"],
        "seq_len": cfg["seq_len"],
        "max_minutes": args.max_minutes,
        **record,
        "acceptance": {
            "prompts": args.prompts,
            "prompt_len": cfg["prompt_len"],
            "new_tokens": cfg["new_tokens"],
            "k": 4,
            **engine_acceptance(
                args.pair,
                {"cross-draft": "draft_model", "draft": "draft_model"},
                prompts,
                cfg["new_tokens"],
                num_speculative_tokens=4,
            ),
        },
        "machine": machine(),
    }
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    write_card(info, out)
    print(json.dumps(info["acceptance"], indent=2))
    return info


if __name__ == "__main__":
    main()
