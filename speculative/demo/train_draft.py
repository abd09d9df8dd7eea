"""A draft model for any target, distilled on the target's own answers:
`python -m speculative.demo.train_draft --target DIR --out DIR`.

1. Data (speculative.demo.self_distill): the target answers greedily a few thousand chats built from
   templates (speculative.demo.instructions), two follow-ups of some, requests it wrote itself
   (sampled from its chat template's opening of a user turn), and bundled requests written one by
   one (`--written`, with two follow-ups of some); no data set is downloaded.
   Every response token is the target's argmax given what precedes it: what a draft must predict
   for its tokens to be accepted. A fixed 3% of the answers (by index) is held out.
2. The draft: a Llama of `--layers` layers and width `--hidden` with the target's tokenizer. Its token
   embedding is the target's, frozen, times a learned projection P [target hidden, hidden] (started at
   the embeddings' top principal directions; the identity, not learned, where the widths are equal),
   and its lm_head is that embedding too (tied). A draft as wide as the target may start from some of
   the target's layers (`--init-layers`, e.g. "0,1") and its final norm.
3. A draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv:2502.14856) of the `--draft-vocab` tokens most
   frequent in the responses (EOS always in): the lm_head keeps only those rows, so each drafted
   token reads that many rows instead of the whole vocabulary's; the engine never drafts another
   token, and the output stays exact (speculative.models.llama: NativeCausalLM.restrict_vocabulary).
   Training uses the same cut: the loss is the cross-entropy over the draft vocabulary of the
   target's token, at response positions whose token it holds. With `--soft-top K` the draft learns
   the target's whole distribution there instead (knowledge distillation, Hinton et al. 2015; for
   drafts, DistillSpec, Zhou et al. 2024, arXiv:2310.08461): the cross-entropy against the target's
   probabilities over the draft vocabulary, cut to its K most likely tokens and renormalized,
   computed once by a teacher-forced pass of the target over the answers. A greedy answer tells
   the draft only which token won; the distribution also says by how much and what came second,
   which matters where a few thousand answers are all the data.
4. Written to `--out` as a Hugging Face folder that loads anywhere (`draft_vocabulary.json` beside it
   for this engine), and with `--package DIR` also without the embedding, which is the target's: the
   committed form, rebuilt by `assemble_draft(package, target, out)`.

Training: AdamW, linear warmup and cosine decay over the run (its steps or its minutes, whichever
ends it), batches of about `--batch-tokens` tokens of answers of similar length, bf16 autocast where
the CPU computes bf16 natively. The card (README.md) and training.json state the data, the held-out
agreement per draft position and the engine's acceptance on a held-out prompt set.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from speculative.demo.train import autocast, optimizer
from speculative.machine import machine

ANSWER_FILES = ("first.jsonl", "second.jsonl", "sampled.jsonl", "written.jsonl", "written-second.jsonl")
"""The answers files self_distilled writes in its folder, in the order it returns their answers
(requests.jsonl beside them holds the sampled requests, not answers)."""
HELDOUT_EVERY = 33
"""Answer i (in that order) is held out where i % HELDOUT_EVERY == 0."""
VOCABULARY_FILE = "draft_vocabulary.json"
"""Beside a draft's weights: {"token_ids": [...]}, its draft vocabulary (most frequent first)."""
PACKAGE_FILE = "draft.safetensors"
"""A packaged draft's weights, without the embedding (`embedding_projection` [target hidden, hidden]
where the draft is narrower than the target)."""


def draft_config(target: LlamaConfig, hidden: int, layers: int, intermediate: int) -> LlamaConfig:
    """The draft's Llama config: the target's vocabulary, special tokens, head size, RoPE and norm
    epsilon, with `layers` layers of width `hidden` (a multiple of the head size), MLP `intermediate`,
    hidden / head size heads and KV heads in the target's ratio (at least one); tied embeddings."""
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    if hidden % head_dim:
        raise ValueError(f"--hidden must be a multiple of the target's head size {head_dim}; got {hidden}")
    heads = hidden // head_dim
    ratio = target.num_attention_heads // target.num_key_value_heads
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // ratio),
        head_dim=head_dim,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=dict(getattr(target, "rope_parameters", None) or {"rope_type": "default"}),
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=getattr(target, "pad_token_id", None),
    )


def principal_projection(embedding: Tensor, width: int) -> Tensor:
    """[hidden, width]: the embedding rows' top `width` principal directions, scaled so that projected
    rows keep the embeddings' mean norm (`embedding` [vocab, hidden])."""
    centred = embedding.float() - embedding.float().mean(0)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    projection = vh[:width].T.contiguous()
    scale = embedding.float().norm(dim=1).mean() / (embedding.float() @ projection).norm(dim=1).mean()
    return projection * scale


def stored_answers(folder: str | Path) -> list[dict]:
    """The answers self_distilled wrote to `folder` (ANSWER_FILES), in its order, without a model."""
    from speculative.demo.self_distill import read_answers

    return [answer for name in ANSWER_FILES for answer in read_answers(Path(folder) / name)]


def heldout_indices(count: int) -> set[int]:
    """The indices of the held-out answers among `count` (one in HELDOUT_EVERY, by index)."""
    return {i for i in range(count) if i % HELDOUT_EVERY == 0}


def frequent_tokens(answers: list[dict], size: int, always: list[int]) -> Tensor:
    """[size] int64: the `always` tokens, then the tokens most frequent in the answers' responses
    (ties by id), without repeats."""
    counts: dict[int, int] = {}
    for answer in answers:
        for token in answer["response"]:
            counts[token] = counts.get(token, 0) + 1
    order = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if t not in always]
    return torch.tensor((list(dict.fromkeys(always)) + order)[:size], dtype=torch.long)


class Distilled(nn.Module):
    """The draft being trained: the target's frozen embedding `embedding` [vocab, target hidden] times
    `projection` (learned; None where the widths are equal), the Llama layers and final norm of
    `model`, and the tied lm_head over the draft vocabulary `vocabulary` [draft vocab]."""

    def __init__(self, model: LlamaForCausalLM, embedding: Tensor, vocabulary: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("embedding", embedding.float(), persistent=False)
        self.register_buffer("vocabulary", vocabulary, persistent=False)
        width, hidden = embedding.shape[1], model.config.hidden_size
        self.projection = None if width == hidden else nn.Parameter(principal_projection(embedding, hidden))
        model.model.embed_tokens.weight.requires_grad_(False)

    def embed(self, token_ids: Tensor) -> Tensor:  # [...] -> [..., hidden]
        rows = F.embedding(token_ids, self.embedding)
        return rows if self.projection is None else rows @ self.projection

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask [batch, q] -> logits over the draft vocabulary [batch, q, draft
        vocab] (float32)."""
        hidden = self.model.model(inputs_embeds=self.embed(input_ids), attention_mask=attention_mask)
        head = self.embed(self.vocabulary)  # [draft vocab, hidden]
        return (hidden.last_hidden_state @ head.T.to(hidden.last_hidden_state.dtype)).float()

    def finished(self) -> LlamaForCausalLM:
        """The trained draft as a plain Llama: its embedding (and tied lm_head) the projected target
        embedding, over the whole vocabulary."""
        with torch.no_grad():
            self.model.model.embed_tokens.weight.copy_(self.embed(torch.arange(self.embedding.shape[0])))
        self.model.tie_weights()
        return self.model


def training_rows(answers: list[dict], vocabulary: Tensor, max_length: int) -> list[tuple[Tensor, Tensor]]:
    """Per answer, (tokens [n], labels [n]): prompt + response cut to its last `max_length` tokens, and
    at each position the index in the draft vocabulary of the next token where it is a response
    token the vocabulary holds, else -100 (no loss)."""
    index = torch.full((int(vocabulary.max()) + 1,), -100, dtype=torch.long)
    index[vocabulary] = torch.arange(len(vocabulary))
    rows = []
    for answer in answers:
        tokens = torch.tensor(answer["prompt"] + answer["response"], dtype=torch.long)
        labels = torch.full_like(tokens, -100)
        response = tokens[len(answer["prompt"]) :]
        known = response.clamp(max=len(index) - 1)
        labels[len(answer["prompt"]) - 1 : -1] = torch.where(response < len(index), index[known], -100)
        rows.append((tokens[-max_length:], labels[-max_length:]))
    return rows


def batches(rows: list, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Row indices grouped into batches of similar lengths, about `batch_tokens` padded tokens each,
    in random order."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]), rng.random()))
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(rows[i][0]) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    rng.shuffle(groups)
    return groups


@torch.no_grad()
def teacher_targets(
    target: LlamaForCausalLM, rows: list, vocabulary: Tensor, top: int, batch_tokens: int
) -> list[tuple[Tensor, Tensor]]:
    """Per row of `training_rows`, (indices [m, top] int16 into the draft vocabulary, probabilities
    [m, top] float16) at its m positions with a label, in order: the target's `top` most likely tokens
    of the draft vocabulary after that position and their probabilities, renormalized over those.
    One teacher-forced pass of the target (bf16 autocast where native) over the rows."""
    head = target.get_output_embeddings().weight[vocabulary].float()  # [draft vocab, hidden]
    out: list = [None] * len(rows)
    groups = batches(rows, batch_tokens, random.Random(0))
    for group in tqdm(groups, desc="teacher", mininterval=10.0):
        tokens, mask, labels = collate(rows, group)
        with autocast():
            hidden = target.model(input_ids=tokens, attention_mask=mask).last_hidden_state
        for b, i in enumerate(group):
            logits = hidden[b][labels[b] >= 0].float() @ head.T  # [m, draft vocab]
            values, indices = logits.topk(min(top, len(vocabulary)), dim=-1)
            out[i] = (indices.to(torch.int16), values.softmax(-1).half())
    return out


def batch_targets(soft: list, indices: list[int]) -> tuple[Tensor, Tensor]:
    """The teacher's (indices, probabilities) of the rows `indices`, concatenated in their order: the
    order of `logits[labels >= 0]` for the batch `collate(rows, indices)`."""
    return torch.cat([soft[i][0] for i in indices]), torch.cat([soft[i][1] for i in indices])


def soft_loss(logits: Tensor, soft: tuple[Tensor, Tensor]) -> Tensor:
    """The cross-entropy of logits [m, draft vocab] against the teacher's (indices, probabilities)
    [m, top] (`teacher_targets`)."""
    indices, probs = soft
    logq = logits.log_softmax(-1).gather(1, indices.long())
    return -(probs.float() * logq).sum(-1).mean()


def collate(rows: list, indices: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """tokens, attention mask, labels [batch, longest] of the rows, right-padded (labels -100)."""
    longest = max(len(rows[i][0]) for i in indices)
    tokens = torch.zeros(len(indices), longest, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, -100)
    for b, i in enumerate(indices):
        n = len(rows[i][0])
        tokens[b, :n], mask[b, :n], labels[b, :n] = rows[i][0], 1, rows[i][1]
    return tokens, mask, labels


@torch.no_grad()
def agreement(draft: Distilled, rows: list, batch_tokens: int, depth: int = 4) -> dict:
    """Held-out teacher-forced figures: the draft's argmax equals the target's token at a response
    position (`top1`), and per draft position d = 1..depth the fraction of response positions where
    the draft's argmax agrees at that position and the d - 1 before it (`chain`, an estimate of a
    greedy chain's acceptance at each position), with the cross-entropy over the draft vocabulary."""
    draft.eval()
    hits, total, losses, runs = 0, 0, [], torch.zeros(depth)
    for group in batches(rows, batch_tokens, random.Random(0)):
        tokens, mask, labels = collate(rows, group)
        with autocast():
            logits = draft(tokens, mask)
        wanted = labels >= 0
        losses.append(F.cross_entropy(logits[wanted], labels[wanted]).item())
        right = (logits.argmax(-1) == labels) & wanted  # [batch, q]
        hits, total = hits + int(right.sum()), total + int(wanted.sum())
        run = right.clone()
        for d in range(depth):  # runs[d]: positions where d + 1 consecutive drafts are right
            runs[d] += run.sum()
            run = run[:, :-1] & right[:, d + 1 :] if d + 1 < right.shape[1] else run[:, :0]
    draft.train()
    return {
        "top1": round(hits / max(total, 1), 4),
        "chain": [round(float(r) / max(total, 1), 4) for r in runs],
        "ce": round(sum(losses) / len(losses), 4),
        "positions": total,
    }


def train(
    draft: Distilled, rows: list, heldout: list, args: argparse.Namespace, soft: list | None = None
) -> dict:
    """Train `draft` on `rows` for args.steps steps or args.max_minutes, whichever ends first; the
    learning rate warms up over args.warmup steps, then decays along a cosine to a tenth of args.lr
    as the run progresses (the larger of its fractions of steps and of minutes). The loss is the
    cross-entropy of the labels, or of the teacher's distributions `soft` (`teacher_targets`, one per
    row) where given. Returns the record."""
    rng = random.Random(args.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = optimizer(draft, args.lr)
    budget = 60 * args.max_minutes if args.max_minutes else None
    start, step, recent, tokens_seen, groups, progress = time.monotonic(), 0, [], 0, [], 0.0
    bar = tqdm(total=args.steps, desc="draft", mininterval=10.0, dynamic_ncols=True)
    while progress < 1:
        if not groups:
            groups = batches(rows, args.batch_tokens, rng)
        group_rows = groups.pop()
        tokens, mask, labels = collate(rows, group_rows)
        warm = min(1.0, (step + 1) / args.warmup)
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        with autocast():
            logits = draft(tokens, mask)
        wanted = labels >= 0
        if soft is None:
            loss = F.cross_entropy(logits[wanted], labels[wanted])
        else:  # logits[wanted] runs row by row, each row's labelled positions in order, as soft's do
            loss = soft_loss(logits[wanted], batch_targets(soft, group_rows))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, tokens_seen = step + 1, tokens_seen + int(mask.sum())
        progress = step / args.steps
        if budget is not None:
            progress = max(progress, (time.monotonic() - start) / budget)
        recent = (recent + [loss.item()])[-50:]
        bar.update(1)
        bar.set_postfix(loss=f"{recent[-1]:.3f}", refresh=False)
        if step % args.eval_every == 0:
            held = agreement(draft, heldout, args.batch_tokens)
            tqdm.write(f"step {step}: train loss {sum(recent) / len(recent):.4f}, held-out {held}")
    bar.close()
    seconds = time.monotonic() - start
    return {
        "steps": step,
        "planned_steps": args.steps,
        "stopped_early": step < args.steps,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens_seen / max(seconds, 1e-9), 1),
        "final_train_loss": round(sum(recent) / max(1, len(recent)), 4),
        "heldout": agreement(draft, heldout, args.batch_tokens),
    }


def initial_draft(target: LlamaForCausalLM, config: LlamaConfig, init_layers: list[int]) -> LlamaForCausalLM:
    """A new draft of `config`, whose layers i start as the target's `init_layers[i]` and whose final
    norm starts as the target's where given (the widths must then be equal)."""
    draft = LlamaForCausalLM(config)
    if not init_layers:
        return draft
    if (
        config.hidden_size != target.config.hidden_size
        or config.intermediate_size != target.config.intermediate_size
    ):
        raise ValueError("--init-layers needs the target's hidden and MLP sizes (--hidden, --intermediate)")
    if len(init_layers) != config.num_hidden_layers:
        raise ValueError(
            f"--init-layers names {len(init_layers)} layers; the draft has {config.num_hidden_layers}"
        )
    for mine, theirs in enumerate(init_layers):
        draft.model.layers[mine].load_state_dict(target.model.layers[theirs].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft


def save_draft(draft: LlamaForCausalLM, tokenizer, vocabulary: Tensor, out: Path) -> None:
    """The draft as a Hugging Face folder in float32 (what `dtype="auto"` then runs on every CPU) with its
    tokenizer and VOCABULARY_FILE."""
    draft.to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / VOCABULARY_FILE).write_text(json.dumps({"token_ids": vocabulary.tolist()}) + "\n")


def package_draft(distilled: Distilled, out: Path) -> None:
    """The committed form: config, generation config, VOCABULARY_FILE and PACKAGE_FILE (every weight
    but the embedding, which assemble_draft rebuilds from the target's; with the projection)."""
    out.mkdir(parents=True, exist_ok=True)
    model = distilled.model
    tensors = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if "embed_tokens" not in k and k != "lm_head.weight"
    }
    if distilled.projection is not None:
        tensors["embedding_projection"] = distilled.projection.detach().float().contiguous()
    save_file(tensors, out / PACKAGE_FILE)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    (out / VOCABULARY_FILE).write_text(json.dumps({"token_ids": distilled.vocabulary.tolist()}) + "\n")


def assemble_draft(package: str | Path, target: str | Path, out: str | Path) -> Path:
    """Rebuild a packaged draft (package_draft) into a whole Hugging Face folder at `out`, its
    embedding made from the target's (times the projection, where there is one), with the target's
    tokenizer; returns `out`."""
    package, out = Path(package), Path(out)
    config = LlamaConfig.from_pretrained(package)
    tensors = load_file(package / PACKAGE_FILE)
    projection = tensors.pop("embedding_projection", None)
    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    embedding = target_model.get_input_embeddings().weight.detach()
    if projection is not None:
        embedding = embedding @ projection
    draft = LlamaForCausalLM(config)
    draft.generation_config = GenerationConfig.from_pretrained(package)  # its declared k, where it has one
    missing = draft.load_state_dict(tensors, strict=False).missing_keys
    if set(missing) - {"model.embed_tokens.weight", "lm_head.weight"}:
        raise ValueError(f"{package / PACKAGE_FILE} lacks {sorted(missing)}")
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(embedding)
    draft.tie_weights()
    vocabulary = torch.tensor(json.loads((package / VOCABULARY_FILE).read_text())["token_ids"])
    save_draft(draft, AutoTokenizer.from_pretrained(target), vocabulary, out)
    return out


@torch.no_grad()
def engine_figures(
    target: str | Path, draft: str | Path, prompts: list[list[int]], k: int, tokens: int
) -> dict:
    """The draft through the engine, float32, greedy, `tokens` tokens a prompt (EOS ignored), chains of
    k: acceptance rate, mean accepted length, acceptance per position; and its cost: the draft's
    one-token forward against the target's (ms, batch 1, context of the first prompt), as the engine
    runs them (native forward, eager; a figure of the training machine, not a benchmark)."""
    from speculative.config import SpeculativeConfig
    from speculative.llm import LLM
    from speculative.sampling_params import SamplingParams

    llm = LLM(
        str(target),
        draft_model=str(draft),
        speculative_config=SpeculativeConfig(num_speculative_tokens=k),
        dtype="float32",
    )
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    drafted = sum(o.metrics.num_drafted for o in outputs)
    accepted = sum(o.metrics.num_accepted for o in outputs)
    steps = sum(o.metrics.num_steps for o in outputs)
    per_position = torch.tensor([o.metrics.acceptance_per_position for o in outputs]).mean(0)
    times = {
        name: _step_ms(loaded.model, prompts[0])
        for name, loaded in (("target", llm.target), ("draft", llm.draft))
    }
    return {
        "prompts": len(prompts),
        "new_tokens": tokens,
        "k": k,
        "acceptance_rate": round(accepted / max(drafted, 1), 4),
        "mean_accepted_length": round(1 + accepted / max(steps, 1), 3),
        "acceptance_per_position": [round(float(a), 3) for a in per_position],
        "step_ms": {name: round(ms, 3) for name, ms in times.items()},
        "draft_cost": round(times["draft"] / times["target"], 4),
    }


def _step_ms(model, prompt: list[int], steps: int = 20) -> float:
    """Median ms of one-token forwards of `model` (the engine's) after `prompt`."""
    cache = model.new_cache(1, len(prompt) + steps + 1)
    model.forward(torch.tensor([prompt]), cache)
    token, times = torch.tensor([[prompt[-1]]]), []
    for _ in range(steps):
        start = time.perf_counter()
        model.forward(token, cache)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def card(info: dict) -> str:
    """The draft's model card (Markdown) from the training record `info`."""
    a, t, e = info["args"], info["training"], info["engine"]
    held = t["heldout"]
    chain = " / ".join(f"{c:.3f}" for c in held["chain"])
    per_position = " / ".join(f"{c:.2f}" for c in e["acceptance_per_position"])
    h = info["engine_heldout_answers"]
    held_positions = " / ".join(f"{c:.2f}" for c in h["acceptance_per_position"])
    sampled = (
        f", {a['sampled']} requests the target wrote itself (sampled from its chat template's "
        "opening of a user turn, kept where complete and new)"
        if a.get("sampled")
        else ""
    )
    written = (
        f", {'all' if a['written'] < 0 else a['written']} of the requests written one by one "
        f"(`speculative/demo/written_requests.jsonl`) and two follow-ups of {a.get('written_followed', 0)} "
        "of them"
        if a.get("written")
        else ""
    )
    resumed = ", going on from an earlier draft of this recipe (--resume)" if a.get("resume") else ""
    loss = (
        f"the cross-entropy against the target's distribution over the draft vocabulary, cut to its "
        f"{a['soft_top']} most likely tokens (--soft-top)"
        if a.get("soft_top")
        else "the cross-entropy of the target's tokens"
    )
    return f"""# A draft for {info["target_name"]}

A {a["layers"]}-layer Llama of width {a["hidden"]} (MLP {a["intermediate"]}) with the target's tokenizer,
distilled on the target's own greedy answers by `python -m speculative.demo.train_draft` (the exact
command is in training.json). {info["params"]:,} parameters of its own; its token embedding (and tied
lm_head) is the target's, frozen{", times a learned projection to its width" if info["projected"] else ""}.
Draft vocabulary (FR-Spec): the {a["draft_vocab"]} tokens most frequent in the training answers
(`draft_vocabulary.json`), {info["vocabulary_coverage"]:.1%} of the held-out answers' tokens; its
lm_head reads those rows only.

## Data

{info["answers"]:,} answers of the target ({info["response_tokens"]:,} response tokens, greedy, at most
{a["answer_tokens"]} tokens each) to {a["chats"]} first-turn chats made from templates
(`speculative/demo/instructions.py`: questions, how-tos, advice, writing, code) and two follow-ups of
{a["followed"]} of them (a further question, and a summary / rewrite / proofreading request over the
answer pasted in){sampled}{written}. No data set was downloaded. One answer in 33 is held out.

## Training

{t["steps"]} steps of about {a["batch_tokens"]} tokens (AdamW, peak lr {a["lr"]}, cosine decay){resumed};
loss: {loss};
{t["seconds"] / 60:.1f} minutes at {t["tokens_per_second"]:.0f} tokens/s; final train loss
{t["final_train_loss"]:.3f}. Held out, teacher-forced: the draft's top token is the target's on
{held["top1"]:.1%} of response positions; the chance that a chain's first 1 / 2 / 3 / 4 drafts are all
right: {chain}.

## Acceptance and cost

Through the engine ({e["prompts"]} chat prompts written apart from the templates, the bench's chat set,
{e["new_tokens"]} tokens each, EOS ignored, greedy, float32, chains of k = {e["k"]}): acceptance rate
{e["acceptance_rate"]:.3f}, **{e["mean_accepted_length"]:.2f} tokens a step**; per draft position
{per_position}. On the prompts of {h["prompts"]} held-out answers (the templates' kind):
{h["mean_accepted_length"]:.2f} tokens a step, per draft position {held_positions}.
One draft forward costs {e["draft_cost"]:.3f} of a target forward
({e["step_ms"]["draft"]:.2f} against {e["step_ms"]["target"]:.2f} ms, batch 1, eager,
on {info["machine"]["cpu"]}, {info["machine"]["nproc"]} cores).
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", type=Path, required=True, help="the draft's folder (written)")
    parser.add_argument("--package", type=Path, help="also write the draft without its embedding here")
    parser.add_argument("--data", type=Path, help="where the target's answers are kept (default OUT/data)")
    parser.add_argument("--chats", type=int, default=5000, help="first-turn chats the target answers")
    parser.add_argument("--followed", type=int, default=300, help="first turns followed up (two each)")
    parser.add_argument("--sampled", type=int, default=3000, help="requests the target writes and answers")
    parser.add_argument(
        "--written", type=int, default=0, help="bundled written requests the target answers (-1: all)"
    )
    parser.add_argument(
        "--written-followed", type=int, default=0, help="written requests followed up (two each)"
    )
    parser.add_argument("--answer-tokens", type=int, default=192, help="tokens of an answer at most")
    parser.add_argument("--answer-batch", type=int, default=48, help="chats answered at once")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--init-layers", default="", help="the target's layers the draft's start as")
    parser.add_argument(
        "--resume", type=Path, help="go on training this packaged draft (--package's; its sizes, vocabulary)"
    )
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary's size")
    parser.add_argument(
        "--soft-top", type=int, default=0, help="learn the target's top-K distribution (0: its tokens)"
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens of a batch")
    parser.add_argument("--max-length", type=int, default=768, help="an answer's context, at most")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", help="a bench prompt set (JSONL) for the card's engine figures")
    parser.add_argument("--target-name", help="the target's name in the card (default: its folder's)")
    args = parser.parse_args(argv)
    from speculative.demo.instructions import written_requests
    from speculative.demo.self_distill import self_distilled
    from speculative.llm import LLM

    torch.manual_seed(args.seed)
    started = time.monotonic()
    llm = LLM(args.target, dtype="float32")
    answers = self_distilled(
        llm,
        args.data or args.out / "data",
        args.chats,
        args.followed,
        args.answer_tokens,
        args.answer_batch,
        args.seed,
        args.sampled,
        len(written_requests()) if args.written < 0 else args.written,
        args.written_followed,
    )
    tokenizer = llm.tokenizer
    del llm
    data_seconds = time.monotonic() - started
    heldout_ids = heldout_indices(len(answers))
    train_answers = [a for i, a in enumerate(answers) if i not in heldout_ids]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    if args.resume is None:
        vocabulary = frequent_tokens(train_answers, args.draft_vocab, always)
        config = draft_config(target.config, args.hidden, args.layers, args.intermediate)
        init_layers = [int(i) for i in args.init_layers.split(",") if i.strip()]
        model = initial_draft(target, config, init_layers)
    else:  # a packaged draft goes on training: its sizes, weights and vocabulary
        vocabulary = torch.tensor(json.loads((args.resume / VOCABULARY_FILE).read_text())["token_ids"])
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(args.resume))
        resumed = load_file(args.resume / PACKAGE_FILE)
        projection = resumed.pop("embedding_projection", None)
        model.load_state_dict({k: v.float() for k, v in resumed.items()}, strict=False)
    model.generation_config = target.generation_config
    distilled = Distilled(model, target.get_input_embeddings().weight.detach(), vocabulary)
    if args.resume is not None and projection is not None:
        with torch.no_grad():
            distilled.projection.copy_(projection)
    rows = training_rows(train_answers, vocabulary, args.max_length)
    heldout = training_rows([answers[i] for i in sorted(heldout_ids)], vocabulary, args.max_length)
    soft = None
    if args.soft_top:
        teacher_started = time.monotonic()
        soft = teacher_targets(target, rows, vocabulary, args.soft_top, args.batch_tokens)
        data_seconds += time.monotonic() - teacher_started
    del target
    record = train(distilled, rows, heldout, args, soft)
    finished = distilled.finished()
    save_draft(finished, tokenizer, vocabulary, args.out)
    held_tokens = [t for i in sorted(heldout_ids) for t in answers[i]["response"]]
    kept = set(vocabulary.tolist())
    info = {
        "target_name": args.target_name or Path(args.target).name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": "python -m speculative.demo.train_draft "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "params": sum(p.numel() for n, p in finished.named_parameters() if "embed_tokens" not in n),
        "projected": distilled.projection is not None,
        "vocabulary_coverage": round(sum(t in kept for t in held_tokens) / len(held_tokens), 4),
        "data_seconds": round(data_seconds, 1),
        "answers": len(answers),
        "response_tokens": sum(len(a["response"]) for a in answers),
        "training": record,
        "engine": engine_figures(
            args.target, args.out, eval_prompts(args, tokenizer, answers, heldout_ids), 4, 128
        ),
        "engine_heldout_answers": engine_figures(
            args.target, args.out, [answers[i]["prompt"] for i in sorted(heldout_ids)[:16]], 4, 128
        ),
        "machine": machine(),
    }
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (args.out / "README.md").write_text(card(info))
    if args.package:
        package_draft(distilled, args.package)
        for name in ("training.json", "README.md"):
            shutil.copy(args.out / name, args.package / name)
    print(json.dumps(info, indent=2))
    return info


def eval_prompts(
    args: argparse.Namespace, tokenizer, answers: list[dict], heldout: set[int]
) -> list[list[int]]:
    """The prompts the card's engine figures run: --eval-prompts' set (a bench prompt set), else the
    prompts of the first 16 held-out answers."""
    if args.eval_prompts is None:
        return [answers[i]["prompt"] for i in sorted(heldout)[:16]]
    from speculative.prompts import encode, load_jsonl

    return [encode(tokenizer, record, args.max_length) for record in load_jsonl(args.eval_prompts)]


if __name__ == "__main__":
    main()
