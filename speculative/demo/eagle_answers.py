"""train_eagle's `--target` recipe: an EAGLE head for any Hugging Face target, trained on the target's
own greedy answers (`python -m speculative.demo.train_eagle --target DIR --data DIR --out DIR`).

The text is train_dflash's `--target` text: the answers train_draft collects under `--data`
(train_draft.stored_answers), one in 33 held out; each answer is a row, its chat prompt then the
target's answer, cut to its last `--seq-len` tokens; rows of similar length batched, about
`--batch-tokens` padded tokens a batch. The answers are the target's greedy output, so the token after
each answer position is the target's own top token there. The head learns the target's whole
distribution at those positions (distillation, KL(target || head), from the target's lm_head over its
final hidden state, which the features hold: every position teaches the whole distribution, not only
its top token); the prompt is context only. The figures count how often its top token is the answer's.

The target's features (the hidden states of the layers the head reads) are computed once, before
training, over every row (under bfloat16 autocast where the CPU computes bfloat16 natively: half the
time of float32 on such a CPU; float32 elsewhere), kept in memory as bfloat16, and in `--features
FILE` when given, so that a second head, or a resumed one, does not pay for them again.

The head drafts `--depth` tokens deep in training as it does when drafting (train_eagle.ttt_hidden:
EAGLE-3's training-time test), pass d's loss weighted 0.8^(d - 1), over a draft vocabulary (FR-Spec:
the `--draft-vocab` tokens most frequent in the training answers, the end-of-turn tokens always among
them; the target's distribution renormalised over it; a label outside it is a miss in the figures).
The head trains on the features of every layer but the last divided by their RMS, its fc's weights
multiplied by it (input_scale: the same head, steps even across its inputs), and is saved as it
reads the target's own. AdamW, warmup and cosine decay (answers_loop). `--resume` trains the head
saved in `--out` further, on `--data` (the same answers or others), keeping its draft vocabulary.

The head is written to `--out` (an EAGLE-3 head without its lm_head, the target's rows: see
train_eagle) with `training.json` (the record, the held-out teacher-forced figures per
draft depth before and after, the greedy acceptance through the engine of k = 4 chains on held-out
prompts) and a card, README.md.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from speculative.demo.answers_loop import LoopArgs, train_on_answers
from speculative.demo.model_card import engine_acceptance
from speculative.demo.self_distill import read_answers
from speculative.demo.train import autocast
from speculative.demo.train_draft import (
    ANSWER_FILES,
    HELDOUT_EVERY,
    batches,
    collate,
    frequent_tokens,
    heldout_indices,
    stored_answers,
    training_rows,
)
from speculative.demo.train_eagle import DEPTH_DECAY, LAYOUT_NAMES, eagle_head, ttt_hidden
from speculative.machine import machine
from speculative.models.eagle import EagleHead
from speculative.models.eagle_checkpoint import load_head_weights, save_eagle_head, saved_draft_vocabulary

ANSWERS_LR = 2e-3  # default peak learning rate
FEATURE_BATCH_TOKENS = 4096  # padded tokens a batch of the target's feature pass
PIECE_FIELDS = ("steps", "tokens", "seconds", "peak_lr", "final_train_loss")  # a piece's, in "pieces"


def rows_key(rows: list) -> str:
    """A digest of the rows' tokens: a features file is reused only for the same rows."""
    digest = hashlib.sha256()
    for tokens, _ in rows:
        digest.update(tokens.to(torch.int32).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def target_features(target, rows: list, layers: tuple[int, ...], path: Path | None) -> list[Tensor]:
    """Per row of `rows` ((tokens [n], labels [n])), [n, len(layers) * hidden] bfloat16: the target's
    hidden states `layers` (Hugging Face's output_hidden_states indices, concatenated) over the row's
    tokens, computed FEATURE_BATCH_TOKENS padded tokens at a time (right padding never reaches a real
    position: the attention is causal) under train.autocast. Read from `path` where it holds the
    same rows' (rows_key) for these layers or more, else computed and written there (when given)."""
    key, width = rows_key(rows), target.config.hidden_size
    if path is not None and path.is_file():
        stored = torch.load(path, weights_only=True)
        if stored["key"] == key and set(layers) <= set(stored["layers"]):
            columns = torch.cat([torch.arange(width) + stored["layers"].index(i) * width for i in layers])
            return [f if len(layers) == len(stored["layers"]) else f[:, columns] for f in stored["features"]]
    features: list = [None] * len(rows)
    groups = batches(rows, FEATURE_BATCH_TOKENS, random.Random(0))
    for group in tqdm(groups, desc="target features", mininterval=5.0, dynamic_ncols=True):
        tokens, _, _ = collate(rows, group)
        with autocast():
            hidden = target.model(input_ids=tokens, output_hidden_states=True).hidden_states
        stacked = torch.cat([hidden[i] for i in layers], dim=-1).to(torch.bfloat16)
        for b, i in enumerate(group):
            features[i] = stacked[b, : len(rows[i][0])].clone()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "layers": list(layers), "features": features}, path)
    return features


def input_scale(features: list[Tensor], width: int) -> Tensor:
    """[feature_size]: what each feature column is divided by while the head trains, the RMS over the
    rows of its layer's stream for every layer but the last (`width` columns each); the last, the
    target's final hidden state, stays as it is (the teacher's input; its RMS is about 2 on SmolLM2).

    The streams entering early and middle layers are far larger (RMS 10-16 on SmolLM2-135M): fed as
    they are, Adam's steps, about the same size on every weight, moved fc's output along those
    columns several times as much as along the final state's. Training on scaled inputs with fc's
    weights scaled the other way (`train`) is the same head at every step, with steps even across
    its inputs."""
    squares = sum(f.float().pow(2).sum(0) for f in features) / sum(len(f) for f in features)
    blocks = squares.view(-1, width).mean(1).sqrt()
    blocks[-1] = 1.0
    return blocks.repeat_interleave(width)


def feature_batch(
    rows: list, features: list[Tensor], group: list[int], scale: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """train_draft.collate's tokens and labels [batch, longest] of the rows in `group`, and their
    features [batch, longest, feature_size] float32 divided by `scale` (input_scale; zeros where
    padded)."""
    tokens, _, labels = collate(rows, group)
    stacked = torch.zeros(*tokens.shape, features[group[0]].shape[-1])
    for b, i in enumerate(group):
        stacked[b, : len(features[i])] = features[i].float()
    return tokens, labels, stacked / scale


def real_tokens(rows: list, group: list[int]) -> int:
    """The tokens of the rows in `group`, padding not counted."""
    return sum(len(rows[i][0]) for i in group)


def answer_losses(
    head: EagleHead, tokens: Tensor, labels: Tensor, features: Tensor, depth: int, index: Tensor
) -> dict:
    """The head's losses and figures on rows tokens, labels [batch, S] (labels: the next token where it
    is the answer's, else -100) with the target's features [batch, S, feature_size] (their last
    hidden_size columns the target's final hidden state, what its lm_head reads), drafting `depth` deep
    (train_eagle.ttt_hidden from the first S - depth positions). index [vocab]: each token's row of the
    head's draft vocabulary, -1 outside it.

    Returns "loss": per pass d, the mean over the labelled positions of KL(target || head) over the
    draft vocabulary, the target's distribution of the token pass d drafts at index p being its lm_head
    over its final hidden state at p + d (the head's lm_head rows are the target's), renormalised over
    the draft vocabulary (distillation: richer than the label alone, and the label is its top token);
    pass d weighted DEPTH_DECAY ** (d - 1). And "sums": per pass the labelled positions, the
    agreements of the head's top token with the label (a label outside the draft vocabulary is a miss),
    the cross-entropy of the labels inside it, summed, and the chain counts (positions labelled at
    every depth whose passes 1 .. d all agree: a teacher-forced estimate of a greedy chain's
    acceptance)."""
    length = tokens.shape[1] - depth
    if length < 1:
        raise ValueError(f"rows of {tokens.shape[1]} tokens are too short to draft {depth} deep")
    width, rows = head.config.hidden_size, head.lm_head.weight
    loss, agree_all = tokens.new_zeros((), dtype=torch.float32), None
    labelled = torch.stack([labels[:, d : d + length] >= 0 for d in range(1, depth + 1)])  # [depth, B, L]
    every = labelled.all(0)
    sums = {name: torch.zeros(depth) for name in ("positions", "agree", "nll", "chain")}
    for d, hidden in enumerate(ttt_hidden(head, features[:, :length], tokens, depth), start=1):
        valid = labelled[d - 1]
        logits = head.head_logits(hidden[valid][None], full_vocabulary=False)[0]  # [m, draft vocab]
        log_q = F.log_softmax(logits, dim=-1)
        with torch.no_grad():
            teacher = features[:, d : d + length, -width:][valid].float()  # the target's at p + d
            log_p = F.log_softmax(F.linear(teacher, rows), dim=-1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
        loss = loss + DEPTH_DECAY ** (d - 1) * kl / valid.sum().clamp(min=1)
        wanted = index[labels[:, d : d + length].clamp(min=0)][valid]  # -1 outside the vocabulary
        inside = wanted >= 0
        hit = torch.zeros_like(valid)
        hit[valid] = log_q.detach().argmax(-1) == wanted
        agree_all = hit if agree_all is None else agree_all & hit
        sums["positions"][d - 1] = valid.sum()
        sums["agree"][d - 1] = hit.sum()
        sums["nll"][d - 1] = -log_q.detach()[inside].gather(1, wanted[inside, None]).sum()
        sums["chain"][d - 1] = (agree_all & every).sum()
    sums["whole"] = every.sum().float()
    return {"loss": loss / sum(DEPTH_DECAY**d for d in range(depth)), "sums": sums}


def summed_figures(parts: list[dict]) -> dict:
    """Per draft depth over several batches' answer_losses "sums": the agreement of the head's top token
    with the target's, the cross-entropy (over labels inside the draft vocabulary, per labelled
    position) and the chain figure; and the teacher-forced tokens a step a greedy chain of `depth`
    would keep (1 + the chain figures)."""
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    positions = total["positions"].clamp(min=1)
    chain = total["chain"] / total["whole"].clamp(min=1)
    return {
        "agreement_per_depth": [round(x, 4) for x in (total["agree"] / positions).tolist()],
        "chain_per_depth": [round(x, 4) for x in chain.tolist()],
        "ce_per_depth": [round(x, 4) for x in (total["nll"] / positions).tolist()],
        "teacher_forced_tokens_per_step": round(1 + float(chain.sum()), 3),
        "positions": int(total["positions"][0]),
    }


@torch.no_grad()
def held_out_figures(
    head, rows: list, features: list, scale: Tensor, depth: int, index: Tensor, batch_tokens: int
) -> dict:
    """summed_figures over the held-out rows (features divided by `scale`, as in training)."""
    head.eval()
    parts = []
    for group in batches(rows, batch_tokens, random.Random(0)):
        tokens, labels, stacked = feature_batch(rows, features, group, scale)
        parts.append(answer_losses(head, tokens, labels, stacked, depth, index)["sums"])
    return summed_figures(parts)


def train(args) -> dict:
    """The recipe (module docstring) with train_eagle's parsed `args` (its --max-minutes counted from
    the end of the features' pass); returns the training record."""
    start = time.monotonic()
    answers = stored_answers(args.data)
    if len(answers) < 2:
        raise SystemExit(f"{args.data} holds {len(answers)} answers ({', '.join(ANSWER_FILES)}); 2 at least")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target.eval().requires_grad_(False)
    config = target.config
    held = heldout_indices(len(answers))
    train_answers = [a for i, a in enumerate(answers) if i not in held]
    heldout_answers = [answers[i] for i in sorted(held)][: args.heldout]
    everything = torch.arange(config.vocab_size)
    rows = training_rows(train_answers, everything, args.seq_len)
    heldout = training_rows(heldout_answers, everything, args.seq_len)
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    vocabulary = None
    if args.resume:  # the saved head's own, whatever answers it goes on with
        vocabulary = saved_draft_vocabulary(args.out)
    elif args.draft_vocab < config.vocab_size:
        vocabulary = frequent_tokens(train_answers, args.draft_vocab, always).sort().values
    sizes = {
        "intermediate_size": args.intermediate or config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
    }
    head = eagle_head(target, sizes, args.layout, vocabulary)
    earlier = []  # the pieces trained before this one (--resume)
    if args.resume:
        load_head_weights(head, args.out)
        earlier = json.loads((args.out / "training.json").read_text())["pieces"]
    index = torch.full((config.vocab_size,), -1, dtype=torch.long)
    kept = everything if vocabulary is None else vocabulary
    index[kept] = torch.arange(len(kept))
    features = target_features(target, rows + heldout, head.target_layers, args.features)
    train_features, heldout_features = features[: len(rows)], features[len(rows) :]
    scale = input_scale(train_features, config.hidden_size)
    with torch.no_grad():  # the same head on features / scale (input_scale): fc's feature columns,
        head.fc.weight[:, -len(scale) :].mul_(scale)  # EAGLE-1's after the token embedding's
    feature_seconds = time.monotonic() - start
    del target
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes

    figures = partial(
        held_out_figures, head, heldout, heldout_features, scale, args.depth, index, args.batch_tokens
    )

    def step_loss(group: list[int]) -> tuple[Tensor, int, int]:
        tokens, labels, stacked = feature_batch(rows, train_features, group, scale)
        out = answer_losses(head, tokens, labels, stacked, args.depth, index)
        return out["loss"], real_tokens(rows, group), int(out["sums"]["positions"][0])

    before = figures()
    loop = LoopArgs(args.steps, args.lr, args.warmup, args.batch_tokens, args.seed, args.eval_every)
    record = train_on_answers(head, rows, loop, step_loss, deadline, figures, args.layout)
    counts = {name: len(read_answers(args.data / name)) for name in ANSWER_FILES}
    files = ", ".join(f"{name} {count}" for name, count in counts.items() if count)
    data = (
        f"{len(answers):,} greedy answers of the target to chat requests, collected by "
        f"speculative.demo.train_draft in {args.data} ({files}): "
        f"{len(train_answers):,} trained on ({sum(len(a['response']) for a in train_answers):,} answer "
        f"tokens), one in {HELDOUT_EVERY} held out (the figures below: the first {len(heldout_answers)}). "
        f"A row is an answer's chat prompt and the answer, its last {args.seq_len} tokens at most"
    )
    piece = {name: record[name] for name in PIECE_FIELDS}
    pieces = [*earlier, {**piece, "depth": args.depth, "data": data}]
    totals = {name: round(sum(p[name] for p in pieces), 1) for name in ("steps", "tokens", "seconds")}
    after = figures()
    with torch.no_grad():  # back to the target's own features
        head.fc.weight[:, -len(scale) :].div_(scale)
    save_eagle_head(head, args.out, share_lm_head=True)
    prompts = [a["prompt"][-args.seq_len :] for a in heldout_answers[: args.prompts]]
    drafters = {args.layout: (args.out, args.layout)}
    chain = engine_acceptance(args.target, drafters, prompts, args.new_tokens, num_speculative_tokens=4)
    return {
        "layout": args.layout,
        "target": str(args.target),
        "target_name": args.target_name or args.target.name,
        "out": str(args.out),
        "target_layers": list(head.target_layers),
        "intermediate_size": sizes["intermediate_size"],
        "parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
        "draft_vocabulary": None if vocabulary is None else len(vocabulary),
        "depth": args.depth,
        "loss": f"KL(target || head) over the draft vocabulary at the answer's tokens, training-time test "
        f"{args.depth} drafts deep, draft d weighted {DEPTH_DECAY}^(d-1)",
        "data": data,
        "feature_seconds": round(feature_seconds, 1),
        **record,
        "pieces": pieces,
        "total": totals,
        "batch_tokens": args.batch_tokens,
        "heldout_before": before,
        "heldout_after": after,
        "acceptance": {"prompts": len(prompts), "new_tokens": args.new_tokens, "k=4": chain[args.layout]},
        "wall_seconds": round(time.monotonic() - start, 1),
        "machine": machine(),
    }


def card(info: dict) -> str:
    """The head's model card (Markdown) from its training record `info`."""
    before, after, acc = info["heldout_before"], info["heldout_after"], info["acceptance"]

    def row(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    reads = {
        "eagle": "an `fc` over [token embedding ; the target's last hidden state]",
        "eagle3": f"an `fc` over the residual streams entering the target's layers {info['target_layers']} "
        "(low, middle, high; the last is its final norm's output)",
    }[info["layout"]]
    vocabulary = (
        "the whole vocabulary"
        if info["draft_vocabulary"] is None
        else f"a draft vocabulary of the {info['draft_vocabulary']:,} tokens most frequent in the answers "
        "(its first piece's; FR-Spec: each draft reads those rows of the target's LM head)"
    )
    stopped = " (the last stopped by --max-minutes)" if info["stopped_early"] else ""
    total, count = info["total"], len(info["pieces"])
    pieces = "" if count == 1 else f", in {count} pieces (`--resume`)"
    cpu = f"{info['machine']['cpu']}, {info['machine']['nproc']} cores"
    datas = [p["data"] for p in info["pieces"]]
    if len(set(datas)) == 1:
        data = info["data"][:1].upper() + info["data"][1:] + "."
    else:  # pieces on different answers (a resumed head keeps its first piece's draft vocabulary)
        data = "\n".join(
            f"- Piece {i} ({p['steps']} steps): {p['data']}." for i, p in enumerate(info["pieces"], 1)
        )
    chain = acc["k=4"]
    return f"""# {LAYOUT_NAMES[info["layout"]]} head for {info["target_name"]}

One Llama decoder layer (MLP {info["intermediate_size"]}) with {reads}, sharing the target's embedding
and LM head, over {vocabulary}; {info["parameters"]:,} trained parameters. Use it with
`LLM(target, draft_model=<this folder>, speculative_config=SpeculativeConfig(method="{info["layout"]}",
num_speculative_tokens=4))` or `speculative generate --model TARGET --{info["layout"]} <this folder>`.
Trained by `python -m speculative.demo.train_eagle` (the command is in training.json).

## Data

{data}

## Training

{total["steps"]:.0f} steps{stopped} of about {info["batch_tokens"]} padded tokens,
{total["tokens"]:,.0f} tokens in all, {total["seconds"] / 60:.1f} minutes{pieces} (this piece:
{info["tokens_per_second"]:.0f} tokens/s, after {info["feature_seconds"] / 60:.1f} minutes of the target's
features), on {cpu}; the loss: {info["loss"]}.
Final train loss {info["final_train_loss"]:.3f}.

Held out, teacher-forced ({after["positions"]:,} answer positions), per draft depth 1 .. {info["depth"]}:

| | before | after |
|---|---|---|
| top token is the target's | {row(before["agreement_per_depth"])} | {row(after["agreement_per_depth"])} |
| drafts 1 .. d all the target's | {row(before["chain_per_depth"])} | {row(after["chain_per_depth"])} |

## Acceptance

Through the engine ({acc["prompts"]} prompts of held-out answers, {acc["new_tokens"]} tokens each, EOS
ignored, greedy, float32), chains of k = 4: acceptance rate {chain["acceptance_rate"]:.3f},
**{chain["mean_accepted_length"]:.2f} tokens a step**.
"""


def write(info: dict) -> None:
    """training.json and README.md into the head's folder."""
    out = Path(info["out"])
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(card(info))
