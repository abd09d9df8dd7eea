"""The training loop of the drafters trained on a target's own answers (train_dflash's and
train_eagle's `--target` recipes): batches of answer rows of similar length (train_draft.batches),
AdamW (train.optimizer), gradients clipped to norm 1, a linear warmup then a cosine decay to a tenth of
the peak learning rate as the run progresses (the larger of its fractions of the planned steps and of
the time allowed).
"""

from __future__ import annotations

import math
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from speculative.demo.train import optimizer
from speculative.demo.train_draft import batches


@dataclass
class LoopArgs:
    """What the loop needs of a recipe's arguments: steps planned, peak learning rate, warmup steps,
    padded tokens a batch, the seed of the batches' order, and held-out figures every `eval_every`
    steps (0: never)."""

    steps: int
    lr: float
    warmup: int
    batch_tokens: int
    seed: int
    eval_every: int = 0


StepLoss = Callable[[list[int]], tuple[Tensor, int, int]]
"""A batch's loss: the indices of its rows -> (the loss to minimise, the rows' real tokens, the
positions the loss counted)."""


def train_on_answers(
    model: torch.nn.Module,
    rows: list,
    args: LoopArgs,
    step_loss: StepLoss,
    deadline: float | None,
    evaluate: Callable[[], dict] | None = None,
    desc: str = "train",
) -> dict:
    """Train `model`'s parameters that require a gradient on `rows` (each (tokens, labels), as
    train_draft.training_rows makes them) for args.steps steps of `step_loss` or until `deadline` (a
    time.monotonic() value), whichever ends first; `evaluate()` (held-out figures, printed) every
    args.eval_every steps. Returns the record: steps, seconds, tokens, counted positions, the final
    train loss (the mean of the last 50), a trace of the loss, the schedule and the peak memory."""
    rng = random.Random(args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(model, args.lr)
    model.train()
    start = time.monotonic()
    budget = None if deadline is None else max(deadline - start, 1e-9)
    step, groups, recent, trace, seen, counted, progress = 0, [], [], [], 0, 0, 0.0
    every = max(1, args.steps // 50)
    bar = tqdm(total=args.steps, desc=desc, mininterval=5.0, dynamic_ncols=True)
    while progress < 1:
        if not groups:
            groups = batches(rows, args.batch_tokens, rng)
        warm = min(1.0, (step + 1) / args.warmup)
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        loss, tokens, positions = step_loss(groups.pop())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, seen, counted = step + 1, seen + tokens, counted + positions
        progress = step / args.steps
        if budget is not None:
            progress = max(progress, (time.monotonic() - start) / budget)
        recent = (recent + [loss.item()])[-50:]
        if step % every == 0 or step == 1:
            trace.append([step, round(recent[-1], 4)])
        bar.update(1)
        bar.set_postfix(loss=f"{recent[-1]:.3f}", refresh=False)
        if evaluate is not None and args.eval_every and step % args.eval_every == 0 and progress < 1:
            held = evaluate()
            tqdm.write(f"step {step}: train loss {sum(recent) / len(recent):.4f}, held-out {held}")
            model.train()
    bar.close()
    seconds = time.monotonic() - start
    return {
        "steps": step,
        "planned_steps": args.steps,
        "stopped_early": step < args.steps,
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / max(step, 1), 3),
        "tokens": seen,
        "drafted_positions": counted,
        "tokens_per_second": round(seen / max(seconds, 1e-9), 1),
        "final_train_loss": round(sum(recent) / max(1, len(recent)), 4),
        "loss_trace": trace,
        "peak_lr": args.lr,
        "warmup": args.warmup,
        "peak_memory_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
