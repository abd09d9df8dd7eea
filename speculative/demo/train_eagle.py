"""An EAGLE-1 head for an already trained demo target: `python -m speculative.demo.train_eagle --pair
models/demo --steps 300`; `--resume --steps N` trains the saved head N steps more.

The demo recipe (`speculative.demo.train --eagle-steps N`) trains the head after the target and the
draft; this trains it alone for the target the pair directory already holds, on the same corpus split
(train files for training, held-out files for the measurements) encoded with the pair's own
tokenizer, with the recipe's head shape, losses and schedule. The head is written to `<pair>/eagle/`
in the published EAGLE-1 layout, with `training.json` beside it (the training record and the
measured acceptance, greedy, of the head and of the pair's draft model: k=4 chains on held-out prompts
through the engine, the acceptance rate and the mean tokens per step) and `README.md`, its card.

A head can be trained in pieces: `--resume` loads `<pair>/eagle/` and trains it `--steps` steps more
(a fresh optimizer, warmup and decay: a warm restart; its windows drawn with the seed offset by the
steps so far, so that they are not the earlier pieces' again), then measures it again. training.json
keeps every piece's record (`pieces`) and their sums: steps, tokens, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative.demo import corpus
from speculative.demo.model_card import engine_acceptance, heldout_prompts
from speculative.demo.train import FULL, SMOKE, train_eagle_head

PIECE_TOTALS = ("steps", "planned_steps", "tokens", "seconds", "wall_seconds")
PIECE_FIELDS = (*PIECE_TOTALS, "stopped_early", "tokens_per_second", "final_train_loss", "final_heldout_ce")
PIECE_FIELDS += ("peak_lr", "batch", "seq_len")


def pieces_of(info: dict) -> list[dict]:
    """The pieces of a head's training record (training.json): its `pieces`, or the whole record as one
    piece where it was written before pieces were (tokens from its steps, batch and window length)."""
    if "pieces" in info:
        return info["pieces"]
    info = {**info, "tokens": info["steps"] * info["batch"] * info["seq_len"]}
    return [{name: info[name] for name in PIECE_FIELDS}]


def combined(pieces: list[dict]) -> dict:
    """The record of pieces trained one after the other: the last one's, with PIECE_TOTALS summed,
    tokens per second over all of them and `pieces`."""
    totals = {name: round(sum(p[name] for p in pieces), 1) for name in PIECE_TOTALS}
    totals["tokens_per_second"] = round(totals["tokens"] / max(totals["seconds"], 1e-9), 1)
    return {
        **pieces[-1],
        **totals,
        "stopped_early": any(p["stopped_early"] for p in pieces),
        "pieces": pieces,
    }


def write_card(info: dict, path: Path) -> None:
    """The head's card (`README.md` in `path`) from its training record `info`."""
    acceptance = info["acceptance"]
    rows = "\n".join(
        f"| {name} | {figures['acceptance_rate']:.3f} | {figures['mean_accepted_length']:.2f} |"
        for name, figures in ((name, acceptance[name]) for name in ("eagle", "draft"))
    )
    first, *more = pieces_of(info)
    resumed = "".join(f", then `--resume --steps {p['planned_steps']}`" for p in more)
    path.joinpath("README.md").write_text(
        f"""# EAGLE-1 head for the demo target

One Llama decoder layer (intermediate size {info["intermediate_size"]}) with an `fc` over [token
embedding ; the target's last hidden state], sharing the target's embedding and LM head: load it with
`LLM("models/demo/target", draft_model="models/demo/eagle",
speculative_config=SpeculativeConfig(method="eagle"))`. Trained by
`python -m speculative.demo.train_eagle --pair models/demo --steps {first["planned_steps"]}`{resumed} on the
demo corpus's training files: {info["steps"]} steps of {info["batch"]} windows of {info["seq_len"]}
tokens ({info["tokens"]} tokens), loss {info["loss"]}; final train loss {info["final_train_loss"]}, held-out
cross-entropy {info["final_heldout_ce"]}; {info["seconds"]} s of training.

Greedy acceptance, k = {acceptance["k"]} chains, {acceptance["prompts"]} held-out prompts of
{acceptance["prompt_len"]} tokens, {acceptance["new_tokens"]} new tokens each (training.json):

| drafter | acceptance rate | mean tokens per step |
|---|---|---|
{rows}
"""
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True, help="the pair's directory (target/, draft/)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--resume", action="store_true", help="train the saved head (<pair>/eagle) --steps steps more"
    )
    parser.add_argument("--smoke", action="store_true", help="the recipe's tiny windows and few files")
    parser.add_argument("--max-minutes", type=float, help="safety cap on training time (recorded if hit)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    start = time.monotonic()
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes

    tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    target = AutoModelForCausalLM.from_pretrained(args.pair / "target", dtype=torch.float32)
    target.eval().requires_grad_(False)
    train_files, heldout_files = corpus.split_files(corpus.list_files())
    if cfg["files"] is not None:
        train_files, heldout_files = train_files[: cfg["files"][0]], heldout_files[: cfg["files"][1]]
    eos = tokenizer.eos_token_id
    train_stream = corpus.token_stream(corpus.encode_files(tokenizer, corpus.read_texts(train_files)), eos)
    heldout_encoded = corpus.encode_files(tokenizer, corpus.read_texts(heldout_files))
    heldout_stream = corpus.token_stream(heldout_encoded, eos)
    heldout = corpus.even_windows(heldout_stream, cfg["eval_windows"], cfg["seq_len"])

    record_path = args.pair / "eagle" / "training.json"
    before = pieces_of(json.loads(record_path.read_text())) if args.resume else []
    seed = args.seed + sum(p["steps"] for p in before)  # new windows for a resumed head
    torch.manual_seed(seed)
    record = train_eagle_head(
        target, train_stream, heldout, cfg, args.steps, seed, deadline, args.pair, args.resume
    )
    prompts = heldout_prompts(heldout_encoded, args.prompts, cfg["prompt_len"], args.seed).tolist()
    acceptance = {
        "prompts": args.prompts,
        "prompt_len": cfg["prompt_len"],
        "new_tokens": cfg["new_tokens"],
        "k": 4,
        **engine_acceptance(
            args.pair, {"eagle": "eagle", "draft": "draft_model"}, prompts, cfg["new_tokens"]
        ),
    }
    piece = {
        **record,
        "tokens": record["steps"] * cfg["batch"] * cfg["seq_len"],
        "batch": cfg["batch"],
        "seq_len": cfg["seq_len"],
        "wall_seconds": round(time.monotonic() - start, 1),
    }
    head_config = json.loads((args.pair / "eagle" / "config.json").read_text())
    info = {
        "layout": "eagle (EAGLE-1)",
        "target": str(args.pair / "target"),
        "intermediate_size": head_config["intermediate_size"],
        "loss": "smooth L1 to the target's next feature + 0.1 x cross-entropy of the token after",
        **combined([*before, piece]),
        "acceptance": acceptance,
    }
    record_path.write_text(json.dumps(info, indent=2) + "\n")
    write_card(info, args.pair / "eagle")
    print(json.dumps(info["acceptance"], indent=2))
    return info


if __name__ == "__main__":
    main()
