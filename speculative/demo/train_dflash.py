"""A DFlash block drafter for a target: `python -m speculative.demo.train_dflash --pair models/demo
--steps 600 --block 8` (the bundled demo pair, on its corpus), or for any Hugging Face target on its own
answers, `python -m speculative.demo.train_dflash --target DIR --data DIR --out DIR` (models/dflash.py
says what the drafter is).

The recipe (after DFlash, arXiv:2602.06036, and its training code): the target's forward over a row of
text gives its features (the outputs of the drafter's target layers) and its next-token distributions.
In each row random anchor positions a (distinct, `--anchors` at most) each open a block: the token at
a, then block - 1 masks at a + 1 .. a + block - 1. All blocks of a row are drafted in one forward,
each seeing the target's features of the positions before its anchor (what the drafter's cache holds
when it drafts after the context a + 1 tokens long) and its own block, bidirectionally, and no other
block (DFlash's block-sparse training mask). The loss at block position i (1 .. block - 1) is
KL(target || drafter) of the token at a + i, the target's distribution being its own prediction given
the text up to a + i - 1 (distillation, as train_eagle.py's: the drafter learns what the target would
say), weighted exp(-(i - 1) / gamma): DFlash's decay, since a later draft counts only if the ones
before it were accepted (`--gamma`, default block / 2). The drafter runs in float32; AdamW, warmup and
cosine decay.

The text:
  --pair: windows of the demo corpus's training files (the pair's held-out files for the
      measurements), encoded with the pair's tokenizer; every position of a window may be drafted.
      `--generated N` mixes in the target's own greedy text as train_eagle.py does (half the windows).
      train.py's train_loop, at the draft's learning rate unless `--lr`, under its autocast (bf16 where
      the CPU computes it natively).
  --target: the target's own greedy answers to chat requests, the JSONL files train_draft collects
      under its `--data` (train_draft.stored_answers: the files of its ANSWER_FILES, each line
      {"prompt": the chat template's token ids, "response": the target's tokens}; requests.jsonl beside
      them holds only the requests). One answer in 33 is held out (train_draft.heldout_indices), for the
      measurements. Each answer is one row, its prompt then its response, cut to its last `--seq-len`
      tokens (train_draft.training_rows over the whole vocabulary: its labels mark the positions whose
      next token is the target's answer); rows of similar length are batched, about `--batch-tokens`
      padded tokens a batch (train_draft.batches, collate), right-padded by block - 1 more. The loss is
      on the target's answer only: anchors are positions whose next token is the answer's, and a
      block's positions past the answer's end count for nothing. The prompt is context (its features)
      and never a label: the drafter only ever drafts the target's answers, while the user's words and
      the chat template are text the target did not write, whose distributions the drafter would spend
      its capacity on for nothing. The target never runs while the drafter trains: its features (the
      drafter's layers and its final hidden state, the teacher's) are computed once over every row, as
      train_eagle's --target recipe computes them (eagle_answers.target_features: bfloat16 autocast
      where the CPU computes bfloat16 natively, kept as bfloat16), and kept in `--features FILE` when
      given, which serves any drafter reading the same layers or fewer (an EAGLE head's too). The KL is
      over a draft vocabulary (FR-Spec, as train_eagle's: the `--draft-vocab` tokens most frequent in
      the training answers, the end-of-turn tokens among them, default 16,384; the target's
      distribution renormalised over it; a token outside it is a miss in the figures), and the saved
      drafter has an lm_head of its own, the target's rows there, so that drafting reads D rows of the
      lm_head, not the whole vocabulary's, and its drafts never leave them. The learning rate (`--lr`,
      default 1e-3) warms up over `--warmup` steps (default 80) and decays along a cosine to a tenth as
      the run progresses (the larger of its fractions of `--steps` and of `--max-minutes`, counted from
      the end of the features' pass).

Memory, for a large vocabulary (SmolLM2's 49152): the target runs without its lm_head, which reads only
its final hidden states at the drafted positions; the drafter's block forward ends at its final norm
(its lm_head is the identity while training); `chunked_kl` then takes the target's lm_head (its draft
vocabulary's rows) over both, a chunk of rows at a time (CHUNK_ELEMENTS logits), and computes each
row's KL with its gradient there, keeping only the gradient [rows, hidden]. No [batch, length,
vocabulary] or [drafted rows, vocabulary] tensor is ever whole.

The drafter: `--layers` Qwen3-style decoder layers of the target's width (the target's heads; the
demo recipe's draft's intermediate size for a pair, the target's for --target, unless
`--intermediate`), reading the target layers DFlash's default spreads over its depth
(`default_target_layers`, one per draft layer) unless `--target-layers`, a learned mask embedding, and
the target's embedding and lm_head, frozen and not saved (--target: the lm_head's draft vocabulary
rows are saved with it). It is written to `--out` (default `<pair>/dflash`; required with
--target) with `training.json` (the training record, the held-out figures per block position before and
after, and the greedy acceptance through the engine of k = 4 and k = block - 1 chains on held-out
prompts) and a card, README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen3Config

from speculative.demo import corpus
from speculative.demo.answers_loop import LoopArgs, StepLoss, train_on_answers
from speculative.demo.eagle_answers import feature_batch, real_tokens, target_features
from speculative.demo.model_card import engine_acceptance, file_prompts
from speculative.demo.self_distill import read_answers
from speculative.demo.train import FULL, SMOKE, train_loop
from speculative.demo.train_draft import (
    ANSWER_FILES,
    HELDOUT_EVERY,
    batches,
    frequent_tokens,
    heldout_indices,
    stored_answers,
    training_rows,
)
from speculative.machine import machine
from speculative.models.dflash import DFlashDrafter, default_target_layers
from speculative.models.dflash_checkpoint import save_dflash

DEFAULT_ANCHORS = 16  # blocks per training window
ANSWERS_LR = 1e-3  # --target's default peak learning rate (a drafter of the target's width)
CHUNK_ELEMENTS = 1 << 23  # logits chunked_kl holds at once per tensor (32 MB of float32)
DRAFT_VOCAB = 16384  # --target's default draft vocabulary, as train_eagle's


def dflash_drafter(
    target: LlamaForCausalLM,
    sizes: dict,
    block: int,
    layers: int = 2,
    target_layers: tuple[int, ...] | None = None,
) -> DFlashDrafter:
    """A fresh float32 drafter for `target`, to train: `layers` Qwen3-style layers of the target's width
    with `sizes`' intermediate_size, the target's attention and KV heads and RoPE, reading
    `target_layers` (default DFlash's, one per draft layer), a learned mask embedding, block size
    `block`; the target's embedding shared, frozen. Its lm_head is the identity: block_logits returns
    the final (normed) hidden states, to which the loss applies the target's lm_head in chunks
    (chunked_kl). A saved drafter loads with the target's lm_head (load_dflash)."""
    t = target.config
    heads, kv_heads = t.num_attention_heads, t.num_key_value_heads
    config = Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=t.hidden_size // heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(t.rope_parameters),
        tie_word_embeddings=False,
    )
    ids = target_layers or default_target_layers(t.num_hidden_layers, layers)
    if any(not 0 <= j < t.num_hidden_layers for j in ids):
        raise ValueError(f"target layers must be in [0, {t.num_hidden_layers}); got {list(ids)}")
    drafter = DFlashDrafter(config, tuple(ids), block).float()
    embedding = target.get_input_embeddings().weight.detach()
    drafter.share(lambda tokens: F.embedding(tokens, embedding.to(drafter.dtype)), lambda hidden: hidden)
    return drafter


def sample_anchors(batch: int, length: int, block: int, count: int, gen: torch.Generator) -> Tensor:
    """[batch, n] int64: per window, n = min(count, length - block) distinct anchors in [1, length - block],
    sorted: every block's labels lie inside a window of `length` tokens and its context is never empty."""
    choices = length - block  # anchors 1 .. length - block
    if choices < 1:
        raise ValueError(f"windows of {length} tokens hold no block of {block} after a first token")
    n = min(count, choices)
    picks = torch.stack([torch.randperm(choices, generator=gen)[:n] for _ in range(batch)])
    return picks.sort(dim=1).values + 1


def answer_anchors(labels: Tensor, block: int, count: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Anchors in rows of prompt + answer: labels [batch, S] (collate's: >= 0 at a position whose next
    token is the target's answer, -100 elsewhere and in the padding) -> anchors [batch, n] int64, sorted,
    and valid [batch, n, block - 1] bool, which drafted positions count. A row's anchors are up to
    `count` distinct positions a in [1, S - block] whose next token is the answer's, drawn at random;
    n is the most any row has, and a row with fewer fills its other anchors with other positions, whose
    blocks count for nothing. Block position i of anchor a counts where the token at a + i is the
    answer's (labels[a + i - 1] >= 0). ValueError where no row has an answer token to draft."""
    batch, length = labels.shape
    answer = labels >= 0
    room = torch.zeros(length, dtype=torch.bool, device=labels.device)
    room[1 : max(1, length - block + 1)] = True  # anchors 1 .. S - block: the block fits
    eligible = answer & room
    n = min(count, int(eligible.sum(1).max()))
    if n == 0:
        raise ValueError(f"no answer token to draft in rows of {length} tokens (block {block})")
    scores = torch.rand(batch, length, generator=gen).to(labels.device)
    scores = torch.where(eligible, scores, torch.where(room, -1.0, -2.0))  # fillers: still with room
    chosen = scores.topk(n, dim=1).indices.sort(dim=1).values
    counted = answer.gather(
        1, (chosen[:, :, None] + torch.arange(block - 1, device=labels.device)).view(batch, -1)
    )
    valid = counted.view(batch, n, block - 1) & eligible.gather(1, chosen)[:, :, None]
    return chosen, valid


def position_weights(block: int, gamma: float) -> Tensor:
    """[block - 1]: block position i's loss weight exp(-(i - 1) / gamma), i = 1 .. block - 1."""
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


class _ChunkedKL(torch.autograd.Function):
    """chunked_kl's forward and its gradient, computed together a chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden: Tensor, teacher: Tensor, head: Tensor, tokens: Tensor, rows: int):
        with torch.autocast(hidden.device.type, enabled=False):
            head = head.float()
            m = hidden.shape[0]
            kl, nll = hidden.new_empty(m, dtype=torch.float32), hidden.new_empty(m, dtype=torch.float32)
            same = torch.empty(m, dtype=torch.bool, device=hidden.device)
            grad = torch.empty(hidden.shape, device=hidden.device) if ctx.needs_input_grad[0] else None
            for s in range(0, m, rows):
                log_q = F.log_softmax(F.linear(hidden[s : s + rows].float(), head), dim=-1)
                log_p = F.log_softmax(F.linear(teacher[s : s + rows].float(), head), dim=-1)
                p = log_p.exp()
                kl[s : s + rows] = (p * (log_p - log_q)).sum(-1)
                nll[s : s + rows] = -log_q.gather(1, tokens[s : s + rows, None])[:, 0]
                same[s : s + rows] = log_q.argmax(-1) == log_p.argmax(-1)
                if grad is not None:  # d KL / d logits_q = q - p
                    grad[s : s + rows] = (log_q.exp_() - p) @ head
        ctx.save_for_backward(grad)
        ctx.dtype = hidden.dtype
        ctx.mark_non_differentiable(nll, same)
        return kl, nll, same

    @staticmethod
    def backward(ctx, grad_kl: Tensor, *_):
        (grad,) = ctx.saved_tensors
        return (grad * grad_kl[:, None]).to(ctx.dtype), None, None, None, None


def chunked_kl(
    hidden: Tensor, teacher: Tensor, head: Tensor, tokens: Tensor, chunk_elements: int = CHUNK_ELEMENTS
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of hidden [m, H] (the drafter's final hidden states, differentiable) and teacher [m, H]
    (the target's, at the same drafted positions): KL(p || q) [m], p = softmax(teacher @ head.T) and
    q = softmax(hidden @ head.T) (head [V, H], the target's lm_head), with its gradient with respect to
    hidden; the cross-entropy of tokens [m] under q [m]; and whether q's top token is p's [m] bool.
    The [rows, V] logits exist only chunk_elements at a time, and only the gradient [m, H] is kept
    for the backward."""
    rows = max(1, chunk_elements // head.shape[0])
    return _ChunkedKL.apply(hidden, teacher, head, tokens, rows)


@torch.no_grad()
def target_states(drafter: DFlashDrafter, target, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """The target's forward over tokens [batch, S] without its lm_head (under the caller's autocast, if
    any): the drafter's features [batch, S, F] float32 and the final hidden states [batch, S, H], the
    lm_head's input (the target's prediction of each next token)."""
    out = target.base_model(input_ids=tokens, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in drafter.hidden_layers], dim=-1).float()
    return features, out.last_hidden_state


def block_losses(
    drafter: DFlashDrafter,
    features: Tensor,
    final: Tensor,
    tokens: Tensor,
    anchors: Tensor,
    valid: Tensor,
    gamma: float,
    head: Tensor,
    index: Tensor | None = None,
) -> dict[str, Tensor]:
    """The drafter's losses on rows tokens [batch, S] with the target's features [batch, S, F] and final
    hidden states [batch, S, H] (target_states), blocks at anchors [batch, n] (each in [1, S - block]),
    valid [batch, n, block - 1] bool saying which drafted positions count (module docstring). head
    [D, H]: the rows of the target's lm_head the KL is over, the whole vocabulary's (index None) or a
    draft vocabulary's, index [vocab] then giving each token's row (-1 outside it): both distributions
    are over those rows, the target's renormalised there.

    Returns "loss", the position-weighted mean KL(target || drafter) over the counted positions; "ce",
    the mean cross-entropy of the rows' own tokens there (those inside the draft vocabulary); per block
    position [block - 1]: "kl", the mean KL, and "agree", how often the drafter's top token is the
    target's (a token outside the draft vocabulary is a miss); "sums", the sums and counts behind them
    (and "chain": of the blocks whose positions all count, those whose drafts 1 .. i all agree) for
    figures over several batches. The drafter and the KL run in float32."""
    block = drafter.block_size
    batch, length = tokens.shape
    n = anchors.shape[1]
    drafted = (anchors[:, :, None] + torch.arange(1, block, device=tokens.device)).view(batch, -1)
    if int(drafted.max()) >= length or int(anchors.min()) < 1:
        raise ValueError(f"anchors must lie in [1, {length - block}] for rows of {length} tokens")
    teacher = final.gather(1, (drafted - 1)[..., None].expand(-1, -1, final.shape[-1]))
    wanted = tokens.gather(1, drafted).view(-1)
    if index is not None:
        wanted = index[wanted]
    inside = (wanted >= 0).view(batch, n, block - 1)
    with torch.autocast(tokens.device.type, enabled=False):
        hidden = drafter.block_logits(
            features.float(), tokens.gather(1, anchors), anchors
        )  # [batch, n, block - 1, H]
        flat = (x.reshape(batch * n * (block - 1), -1) for x in (hidden, teacher))
        kl, nll, same = (x.view(batch, n, block - 1) for x in chunked_kl(*flat, head, wanted.clamp(min=0)))
    same = same & inside
    weights = position_weights(block, gamma).to(kl.device) * valid
    loss = (torch.where(valid, kl, 0.0) * weights).sum() / weights.sum().clamp(min=1e-12)
    positions = valid.sum(dim=(0, 1))
    scored = valid & inside  # the cross-entropy's positions
    whole = valid.all(-1)  # [batch, n]: blocks whose every drafted position counts
    sums = {
        "kl": torch.where(valid, kl.detach(), 0.0).sum(dim=(0, 1)),
        "agree": (same & valid).sum(dim=(0, 1)).float(),
        "positions": positions.float(),
        "nll": nll[scored].sum(),
        "scored": scored.sum().float(),
        "chain": (same.int().cumprod(-1).bool() & whole[..., None]).sum(dim=(0, 1)).float(),
        "blocks": whole.sum().float(),
    }
    return {
        "loss": loss,
        "ce": nll[scored].mean() if bool(scored.any()) else nll.new_zeros(()),
        "kl": sums["kl"] / positions.clamp(min=1),
        "agree": sums["agree"] / positions.clamp(min=1),
        "sums": sums,
    }


def dflash_losses(
    drafter: DFlashDrafter,
    target: LlamaForCausalLM,
    windows: Tensor,
    anchors: int,
    gamma: float,
    gen: torch.Generator,
) -> dict[str, Tensor]:
    """block_losses on [batch, length] token windows, `anchors` random blocks per window, every drafted
    position counting (the --pair recipe's)."""
    batch, length = windows.shape
    block = drafter.block_size
    chosen = sample_anchors(batch, length, block, anchors, gen).to(windows.device)  # [batch, n]
    valid = torch.ones(*chosen.shape, block - 1, dtype=torch.bool, device=windows.device)
    features, final = target_states(drafter, target, windows)
    head = target.get_output_embeddings().weight
    return block_losses(drafter, features, final, windows, chosen, valid, gamma, head)


def summed_figures(parts: list[dict]) -> dict:
    """Per block position over several batches' block_losses "sums": the mean KL, the agreement with the
    target's top token, and the chain figure (of whole blocks, the fraction whose drafts 1 .. i all
    agree: a teacher-forced estimate of the chance a greedy chain's first i drafts are accepted; on the
    target's own greedy answers the target's top token is the text's); the drafted positions."""
    total = {k: sum(p["sums"][k] for p in parts) for k in parts[0]["sums"]}
    positions = total["positions"].clamp(min=1)
    chain = total["chain"] / total["blocks"].clamp(min=1)
    return {
        "kl_per_position": [round(x, 4) for x in (total["kl"] / positions).tolist()],
        "agreement_per_position": [round(x, 4) for x in (total["agree"] / positions).tolist()],
        "chain_per_position": [round(x, 4) for x in chain.tolist()],
        "teacher_forced_tokens_per_step": round(1 + float(chain.sum()), 3),
        "ce": round(float(total["nll"] / total["scored"].clamp(min=1)), 4),
        "positions": int(total["positions"].sum()),
    }


def held_out_figures(drafter, target, windows: Tensor, anchors: int, gamma: float, batch: int) -> dict:
    """summed_figures over the held-out windows (fixed anchors)."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        parts = [
            dflash_losses(drafter, target, windows[i : i + batch, :-1], anchors, gamma, gen)
            for i in range(0, len(windows), batch)
        ]
    return summed_figures(parts)


def train_dflash(target, stream, heldout, cfg, steps, seed, deadline, drafter, anchors, gamma) -> dict:
    """Train `drafter` `steps` steps of dflash_losses' loss on `stream` (train_loop's other arguments);
    returns train_loop's record (its held-out figure: the cross-entropy of the drafted tokens)."""
    gen = torch.Generator().manual_seed(seed + 3)

    def loss(model, windows: Tensor) -> Tensor:
        return dflash_losses(model, target, windows[:, :-1], anchors, gamma, gen)["loss"]

    def ce(model, windows: Tensor) -> Tensor:
        fixed = torch.Generator().manual_seed(1234)
        return dflash_losses(model, target, windows[:, :-1], anchors, gamma, fixed)["ce"]

    return train_loop(
        "dflash", drafter, loss, stream, heldout, cfg, steps, cfg["draft_lr"], seed + 2, deadline, ce=ce
    )


# ---- --target: the target's own answers ----------------------------------------------------------


@dataclass
class Answers:
    """The --target recipe's rows with what its loss needs of the target, computed once (the target
    never runs while the drafter trains): rows, each (tokens [n], labels [n]) as train_draft.training_rows
    makes them over the whole vocabulary; features, per row [n, F + H] bfloat16, the drafter's features
    then the target's final hidden state (eagle_answers.target_features); head [D, H], the rows of the
    target's lm_head the KL is over; index [vocab], each token's row there (-1 outside), None where
    head is the whole lm_head."""

    rows: list
    features: list[Tensor]
    head: Tensor
    index: Tensor | None

    def batch(self, group: list[int], block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """tokens and labels [batch, S] (collate's) of the rows in `group`, the drafter's features [batch,
        S, F] and the final hidden states [batch, S, H], all right-padded by block - 1 more positions
        (token 0, label -100, zeros): room for a block at a row's last answer token."""
        tokens, labels, stacked = feature_batch(self.rows, self.features, group, torch.ones(()))
        pad, width = block - 1, self.head.shape[1]
        tokens, labels = F.pad(tokens, (0, pad)), F.pad(labels, (0, pad), value=-100)
        stacked = F.pad(stacked, (0, 0, 0, pad))
        return tokens, labels, stacked[..., :-width], stacked[..., -width:]


def answer_losses(drafter, data: Answers, group: list[int], anchors: int, gamma: float, gen) -> dict:
    """block_losses on the rows in `group`, anchors drawn by answer_anchors with `gen`."""
    tokens, labels, features, final = data.batch(group, drafter.block_size)
    chosen, valid = answer_anchors(labels, drafter.block_size, anchors, gen)
    return block_losses(drafter, features, final, tokens, chosen, valid, gamma, data.head, data.index)


def answer_figures(drafter, data: Answers, batch_tokens: int, anchors: int, gamma: float) -> dict:
    """summed_figures over the held-out answers' rows (fixed batches and anchors)."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        parts = [
            {"sums": answer_losses(drafter, data, group, anchors, gamma, gen)["sums"]}
            for group in batches(data.rows, batch_tokens, random.Random(0))
        ]
    return summed_figures(parts)


def answer_step_loss(drafter, data: Answers, args, gamma: float) -> StepLoss:
    """answers_loop's step loss of `drafter`: block_losses' on a batch of the answers' rows, random
    anchors."""
    gen = torch.Generator().manual_seed(args.seed + 3)

    def step_loss(group: list[int]) -> tuple[Tensor, int, int]:
        out = answer_losses(drafter, data, group, args.anchors, gamma, gen)
        return out["loss"], real_tokens(data.rows, group), int(out["sums"]["positions"].sum())

    return step_loss


def with_own_head(drafter: DFlashDrafter, head: Tensor, vocabulary: Tensor) -> DFlashDrafter:
    """A copy of the trained `drafter` with an lm_head of its own over the draft vocabulary [D] (sorted
    token ids): head [D, H], the target's rows there, and d2t, as the engine and vLLM read them."""
    own = DFlashDrafter(
        drafter.config,
        drafter.target_layer_ids,
        drafter.block_size,
        drafter.mask_token_id,
        learned_mask=hasattr(drafter, "mask_embedding"),
        draft_vocab_size=len(vocabulary),
    ).float()
    d2t = vocabulary - torch.arange(len(vocabulary))
    own.load_state_dict({**drafter.state_dict(), "lm_head.weight": head.float(), "d2t": d2t})
    return own


def chain_acceptance(target: Path, drafter: Path, prompts: list, new_tokens: int, ks: list[int]) -> dict:
    """Per k in `ks` ("k=4": ...), model_card.engine_acceptance of the saved drafter in chains of k."""
    figures = {}
    for k in ks:
        drafters = {"dflash": (drafter, "dflash")}
        figures[f"k={k}"] = engine_acceptance(target, drafters, prompts, new_tokens, num_speculative_tokens=k)
    return {name: value["dflash"] for name, value in figures.items()}


def card(info: dict) -> str:
    """The drafter's model card (Markdown) from its training record `info`."""
    before, after, acc = info["heldout_before"], info["heldout_after"], info["acceptance"]
    block = info["block_size"]

    def row(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    engine = "\n".join(
        f"- k = {k[2:]}: acceptance rate {a['acceptance_rate']:.3f}, **{a['mean_accepted_length']:.2f} "
        "tokens a step**"
        for k, a in acc.items()
        if k.startswith("k=")
    )
    stopped = " (stopped by --max-minutes)" if info["stopped_early"] else ""
    layers = f"{info['layers']} Qwen3-style layer{'s' if info['layers'] > 1 else ''}"
    data = info["data"][:1].upper() + info["data"][1:]
    cpu, minutes = f"{info['machine']['cpu']}, {info['machine']['nproc']} cores", info["seconds"] / 60
    vocab = info.get("draft_vocabulary")
    head = (
        "the embedding and lm_head being the target's (shared, not saved)"
        if vocab is None
        else f"the embedding being the target's (shared, not saved) and its lm_head the target's rows of "
        f"a draft vocabulary of the {vocab:,} tokens most frequent in the answers (saved with it)"
    )
    kl, top, chain = (
        f"{row(before[name])} | {row(after[name])}"
        for name in ("kl_per_position", "agreement_per_position", "chain_per_position")
    )
    return f"""# A DFlash block drafter for {info["target_name"]}

A block drafter (DFlash, arXiv:2602.06036): {layers} of the target's width
(MLP {info["intermediate_size"]}), block size {block} (up to {block - 1} drafts in one forward), reading the
outputs of the target's layers {info["target_layer_ids"]}; {info["parameters"]:,} parameters of its own,
{head}. Trained by
`python -m speculative.demo.train_dflash` (the command is in training.json). Use it with
`LLM(target, draft_model=<this folder>, speculative_config=SpeculativeConfig(method="dflash",
num_speculative_tokens=k))`, k at most {block - 1}.

## Data

{data}.

## Training

{info["steps"]} steps{stopped} of {info["batch_description"]}, {info["tokens"]:,} tokens in all,
{minutes:.1f} minutes ({info["tokens_per_second"]:.0f} tokens/s on {cpu}); the loss: {info["loss"]}.
Final train loss {info["final_train_loss"]:.3f}.

Held out, teacher-forced ({after["positions"]:,} drafted positions), per block position 1 .. {block - 1}:

| | before | after |
|---|---|---|
| KL(target \\|\\| drafter) | {kl} |
| top token is the target's | {top} |
| drafts 1 .. i all the target's | {chain} |

## Acceptance

Through the engine ({acc["prompts"]} {acc["source"]}, {acc["new_tokens"]} tokens each, EOS ignored, greedy,
float32):

{engine}
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pair", type=Path, help="a demo pair's directory (target/), on the demo corpus")
    source.add_argument("--target", type=Path, help="a target's Hugging Face folder, on its answers (--data)")
    parser.add_argument("--data", type=Path, help="--target: the folder of the answers train_draft collected")
    parser.add_argument("--out", type=Path, help="the drafter's directory (default: <pair>/dflash)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--block", type=int, default=8, help="block size: drafts up to block - 1 tokens")
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument(
        "--target-layers",
        type=int,
        nargs="+",
        help="the target layers read (DFlash's ids: layer j's output; default one per draft layer, spread)",
    )
    parser.add_argument(
        "--intermediate", type=int, help="draft MLP size (default: pair's draft's / target's)"
    )
    parser.add_argument("--anchors", type=int, default=DEFAULT_ANCHORS, help="blocks per training window")
    parser.add_argument("--gamma", type=float, help="loss decay over block positions (default: block / 2)")
    parser.add_argument(
        "--seq-len", type=int, help="tokens a window (default: the recipe's / 2; --target: a row's, 768)"
    )
    parser.add_argument(
        "--lr",
        type=float,
        help="peak learning rate (default: --pair 3e-3, the recipe's draft's; --target 1e-3)",
    )
    parser.add_argument("--warmup", type=int, help="warmup steps (default: the recipe's, 80)")
    parser.add_argument(
        "--generated",
        type=int,
        default=0,
        help="--pair: training prompts the target continues: half the windows",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="--pair: the recipe's tiny windows and few files"
    )
    parser.add_argument("--batch-tokens", type=int, default=4096, help="--target: padded tokens a batch")
    parser.add_argument("--heldout", type=int, default=64, help="--target: held-out answers measured")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=DRAFT_VOCAB,
        help="--target: the drafter's lm_head keeps the N tokens most frequent in the answers",
    )
    parser.add_argument("--features", type=Path, help="--target: keep (or reuse) the target's features here")
    parser.add_argument("--eval-every", type=int, default=0, help="--target: held-out figures every N steps")
    parser.add_argument("--max-minutes", type=float, help="safety cap on training time (recorded if hit)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance")
    parser.add_argument("--new-tokens", type=int, help="tokens a prompt for the acceptance (default 64)")
    parser.add_argument("--target-name", help="the target's name in the card (default: its folder's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "layers", "anchors", "batch_tokens", "heldout", "prompts", "draft_vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.block < 2:
        parser.error(f"--block must be at least 2; got {args.block}")
    if args.gamma is not None and args.gamma <= 0:
        parser.error(f"--gamma must be > 0; got {args.gamma}")
    if args.target is not None:
        missing = [name for name in ("data", "out") if getattr(args, name) is None]
        if missing:
            parser.error("--target needs " + " and ".join(f"--{m}" for m in missing))
        if args.smoke or args.generated:
            parser.error("--smoke and --generated are --pair's")
    elif args.data is not None or args.features is not None:
        parser.error("--data and --features are --target's (a pair trains on the demo corpus)")
    gamma = args.gamma or args.block / 2
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["warmup"] = args.warmup or cfg["warmup"]
    cfg["draft_lr"] = args.lr or cfg["draft_lr"]
    start = time.monotonic()
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
    torch.manual_seed(args.seed)
    if args.target is not None:
        info = _on_answers(args, cfg, gamma)
    else:
        info = _on_pair(parser, args, cfg, gamma, deadline)
    info["wall_seconds"] = round(time.monotonic() - start, 1)
    info["command"] = "python -m speculative.demo.train_dflash " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    info["machine"] = machine()
    out = Path(info["out"])
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(card(info))
    print(json.dumps({k: info[k] for k in ("heldout_before", "heldout_after", "acceptance")}, indent=2))
    return info


def _drafter_info(drafter: DFlashDrafter, args, gamma: float, where: str) -> dict:
    return {
        "block_size": args.block,
        "layers": args.layers,
        "target_layer_ids": list(drafter.target_layer_ids),
        "intermediate_size": drafter.config.intermediate_size,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "loss": f"KL(target || drafter) at block positions 1 .. {args.block - 1}{where}, weighted "
        f"exp(-(i - 1) / {gamma:g}); {args.anchors} blocks a row at most",
    }


def _on_pair(parser, args, cfg: dict, gamma: float, deadline) -> dict:
    """The --pair recipe: the demo corpus's windows, train.py's train_loop."""
    cfg["seq_len"] = args.seq_len or cfg["seq_len"] // 2
    if cfg["seq_len"] <= args.block:
        parser.error(f"--seq-len ({cfg['seq_len']}) must exceed --block ({args.block})")
    target_dir = args.pair / "target"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target.eval().requires_grad_(False)
    train_files, heldout_files = corpus.split_files(corpus.list_files())
    if cfg["files"] is not None:
        train_files, heldout_files = train_files[: cfg["files"][0]], heldout_files[: cfg["files"][1]]
    eos = tokenizer.eos_token_id
    train_encoded = corpus.encode_files(tokenizer, corpus.read_texts(train_files))
    train_stream = corpus.token_stream(train_encoded, eos)
    heldout_encoded = corpus.encode_files(tokenizer, corpus.read_texts(heldout_files))
    heldout_stream = corpus.token_stream(heldout_encoded, eos)
    heldout = corpus.even_windows(heldout_stream, cfg["eval_windows"], cfg["seq_len"])
    data = f"windows of {len(train_files)} files of the demo corpus (held out: {len(heldout_files)} files)"
    if args.generated:
        from speculative.demo.train_eagle import target_continuations

        prompts = file_prompts(train_encoded, args.generated, cfg["prompt_len"], args.seed).tolist()
        texts = target_continuations(args.pair, prompts, cfg["seq_len"] // 2)
        train_stream = (train_stream, corpus.token_stream(texts, eos))
        data = (
            f"half windows of {len(train_files)} files of the demo corpus, half {args.generated} training "
            "prompts continued greedily by the target"
        )
    sizes = dict(cfg["draft"], intermediate_size=args.intermediate or cfg["draft"]["intermediate_size"])
    drafter = dflash_drafter(target, sizes, args.block, args.layers, args.target_layers)
    before = held_out_figures(drafter, target, heldout, args.anchors, gamma, cfg["batch"])
    record = train_dflash(
        target, train_stream, heldout, cfg, args.steps, args.seed, deadline, drafter, args.anchors, gamma
    )
    after = held_out_figures(drafter, target, heldout, args.anchors, gamma, cfg["batch"])
    out = args.out or args.pair / "dflash"
    save_dflash(drafter, out)
    new_tokens = args.new_tokens or cfg["new_tokens"]
    prompts = file_prompts(heldout_encoded, args.prompts, cfg["prompt_len"], args.seed).tolist()
    ks = sorted({min(4, args.block - 1), args.block - 1})
    acceptance = chain_acceptance(target_dir, out, prompts, new_tokens, ks)
    return {
        "target": str(target_dir),
        "target_name": args.target_name or f"the demo target {target_dir}",
        "out": str(out),
        **_drafter_info(drafter, args, gamma, ""),
        "data": data,
        **record,
        "tokens": record["steps"] * cfg["batch"] * cfg["seq_len"],
        "batch": cfg["batch"],
        "batch_description": f"{cfg['batch']} windows of {cfg['seq_len']} tokens",
        "seq_len": cfg["seq_len"],
        "heldout_before": before,
        "heldout_after": after,
        "acceptance": {
            "prompts": len(prompts),
            "source": f"prompts of {cfg['prompt_len']} tokens from held-out files",
            "new_tokens": new_tokens,
            **acceptance,
        },
    }


def _on_answers(args, cfg: dict, gamma: float) -> dict:
    """The --target recipe: the target's own answers in --data (module docstring); --max-minutes counts
    from the end of the features' pass."""
    seq_len = args.seq_len or 768
    if seq_len <= args.block:
        raise SystemExit(f"--seq-len ({seq_len}) must exceed --block ({args.block})")
    answers = stored_answers(args.data)
    if len(answers) < 2:
        raise SystemExit(f"{args.data} holds {len(answers)} answers ({', '.join(ANSWER_FILES)}); 2 at least")
    args.lr = args.lr or ANSWERS_LR
    args.warmup = cfg["warmup"]
    start = time.monotonic()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target.eval().requires_grad_(False)
    t = target.config
    held = heldout_indices(len(answers))
    everything = torch.arange(t.vocab_size)
    train_answers = [a for i, a in enumerate(answers) if i not in held]
    heldout_answers = [answers[i] for i in sorted(held)]
    rows = training_rows(train_answers, everything, seq_len)
    heldout = training_rows(heldout_answers[: args.heldout], everything, seq_len)
    intermediate = args.intermediate or t.intermediate_size
    drafter = dflash_drafter(
        target, {"intermediate_size": intermediate}, args.block, args.layers, args.target_layers
    )
    lm_head = target.get_output_embeddings().weight.detach()
    vocabulary, index = None, None
    if args.draft_vocab < t.vocab_size:
        eos = target.generation_config.eos_token_id
        always = [eos] if isinstance(eos, int) else list(eos or [])
        vocabulary = frequent_tokens(train_answers, args.draft_vocab, always).sort().values
        index = torch.full((t.vocab_size,), -1, dtype=torch.long)
        index[vocabulary] = torch.arange(len(vocabulary))
    head = lm_head if vocabulary is None else lm_head[vocabulary]
    layers = (*drafter.hidden_layers, t.num_hidden_layers)  # and the final hidden state, the teacher's
    features = target_features(target, rows + heldout, layers, args.features)
    feature_seconds = time.monotonic() - start
    del target
    train_data = Answers(rows, features[: len(rows)], head, index)
    heldout_data = Answers(heldout, features[len(rows) :], head, index)
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    before = answer_figures(drafter, heldout_data, args.batch_tokens, args.anchors, gamma)
    loop = LoopArgs(args.steps, args.lr, args.warmup, args.batch_tokens, args.seed, args.eval_every)
    record = train_on_answers(
        drafter,
        rows,
        loop,
        answer_step_loss(drafter, train_data, args, gamma),
        deadline,
        partial(answer_figures, drafter, heldout_data, args.batch_tokens, args.anchors, gamma),
        "dflash",
    )
    after = answer_figures(drafter, heldout_data, args.batch_tokens, args.anchors, gamma)
    save_dflash(drafter if vocabulary is None else with_own_head(drafter, head, vocabulary), args.out)
    new_tokens = args.new_tokens or 128
    prompts = [a["prompt"][-seq_len:] for a in heldout_answers[: args.prompts]]
    ks = sorted({min(4, args.block - 1), args.block - 1})
    acceptance = chain_acceptance(args.target, args.out, prompts, new_tokens, ks)
    counts = {name: len(read_answers(args.data / name)) for name in ANSWER_FILES}
    files = ", ".join(f"{name} {count}" for name, count in counts.items() if count)
    measured = min(args.heldout, len(heldout_answers))
    return {
        "target": str(args.target),
        "target_name": args.target_name or args.target.name,
        "out": str(args.out),
        **_drafter_info(drafter, args, gamma, " where the token is the target's answer's"),
        "data": f"{len(answers):,} greedy answers of the target to chat requests, collected by "
        f"speculative.demo.train_draft in {args.data} ({files}): {len(train_answers):,} trained on "
        f"({sum(len(a['response']) for a in train_answers):,} answer tokens), one in {HELDOUT_EVERY} held "
        f"out ({len(heldout_answers)}; the figures below: the first {measured}). "
        f"A row is an answer's chat prompt and the answer, its last {seq_len} tokens at most; the loss is on "
        "the answer's tokens only",
        "answers": counts,
        "draft_vocabulary": None if vocabulary is None else len(vocabulary),
        "feature_seconds": round(feature_seconds, 1),
        **record,
        "batch_description": f"about {args.batch_tokens} padded tokens",
        "batch_tokens": args.batch_tokens,
        "seq_len": seq_len,
        "heldout_before": before,
        "heldout_after": after,
        "acceptance": {
            "prompts": len(prompts),
            "source": "prompts of held-out answers",
            "new_tokens": new_tokens,
            **acceptance,
        },
    }


if __name__ == "__main__":
    main()
