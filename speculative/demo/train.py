"""The recipe for the demo model pair: `python -m speculative.demo.train --out models/demo`.

Trains, on the Python standard library's source (see `speculative.demo.corpus`), a byte-level BPE
tokenizer, a 6-layer Llama target and a 1-layer, narrower Llama draft distilled from the target (forward
KL to the target's distribution at every position; its embeddings start as the target's projected onto
their top principal directions). Both are written as Hugging Face directories (`target/`, `draft/`:
config, generation config, tokenizer, bf16 safetensors), with `README.md` and `training.json` beside
them. Everything is seeded and runs fixed step counts; `--max-minutes` is a safety cap that, if it stops
training early, is recorded. `--smoke` runs tiny sizes on a few files in seconds. The target's EAGLE
head is trained afterwards by `speculative.demo.train_eagle`.

On a CPU shared with other processes, launch with `OMP_WAIT_POLICY=PASSIVE` in the environment (it must be
set before torch is imported): with spinning OpenMP threads, element-wise ops ran ~10x slower there. It
changes speed only, never results.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from speculative.demo import corpus
from speculative.demo.model_card import measure_and_write_card
from speculative.models.dtypes import cpu_computes_natively

FULL = {
    "vocab_size": 8192,
    "seq_len": 512,
    "batch": 8,
    "target_steps": 800,
    "draft_steps": 700,
    "target_lr": 1.5e-3,
    "draft_lr": 3e-3,
    "warmup": 80,
    "eval_windows": 64,
    "eval_every": 200,
    "target": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "draft": {
        "hidden_size": 192,
        "num_hidden_layers": 1,
        "intermediate_size": 576,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "files": None,
    "prompts": 32,
    "prompt_len": 128,
    "new_tokens": 64,
}
SMOKE = {
    "vocab_size": 384,
    "seq_len": 64,
    "batch": 4,
    "target_steps": 8,
    "draft_steps": 8,
    "target_lr": 3e-3,
    "draft_lr": 3e-3,
    "warmup": 2,
    "eval_windows": 4,
    "eval_every": 4,
    "target": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    "draft": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
    },
    "files": (24, 4),
    "prompts": 4,
    "prompt_len": 32,
    "new_tokens": 8,
}


def llama(sizes: dict, vocab_size: int, seq_len: int, eos_id: int) -> LlamaForCausalLM:
    """A freshly initialised Llama with tied embeddings whose bos/eos/pad are all `eos_id`."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **sizes,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return model


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warmup to `peak`, then cosine decay to a tenth of it at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW, weight decay 0.1 on matrices, none on norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def ce_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `model` on [batch, seq_len + 1] windows."""
    logits = model(input_ids=windows[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def kl_loss(draft: LlamaForCausalLM, target: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean per-token KL(target || draft) on the windows' inputs: the distillation loss."""
    inputs = windows[:, :-1]
    with torch.no_grad():
        teacher = F.log_softmax(target(input_ids=inputs).logits.float(), dim=-1)
    student = F.log_softmax(draft(input_ids=inputs).logits.float(), dim=-1)
    kl = F.kl_div(
        student.reshape(-1, student.shape[-1]),
        teacher.reshape(-1, teacher.shape[-1]),
        log_target=True,
        reduction="batchmean",
    )
    return kl


def autocast() -> torch.autocast:
    """The recipes' training precision: bfloat16 autocast where the CPU computes bfloat16 natively
    (AVX512-BF16 or AMX), float32 elsewhere, where a bfloat16 matmul runs in generic code (on an
    AVX2-only CPU an EAGLE head's training step took 14 times as long under it)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_computes_natively(torch.bfloat16))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int, ce=ce_loss) -> float:
    """Mean cross-entropy `ce(model, windows)` (default next-token) over the fixed held-out windows."""
    model.eval()
    with autocast():
        losses = [ce(model, windows[i : i + batch]).item() for i in range(0, len(windows), batch)]
    model.train()
    return sum(losses) / len(losses)


def train_loop(name, model, loss_fn, stream, heldout, cfg, steps, lr, seed, deadline, ce=ce_loss) -> dict:
    """Train `model` for `steps` steps of `loss_fn(model, windows)` on random windows of `stream`;
    `ce(model, windows)` is its held-out cross-entropy (default: next-token).

    Stops early (and says so in the returned record) if `deadline` (a `time.monotonic()` value) passes.
    Prints the train loss and the held-out cross-entropy every `eval_every` steps and at the end.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer(model, lr)
    model.train()
    recent: list[float] = []
    start, done = time.monotonic(), 0
    bar = tqdm(range(steps), desc=name, mininterval=5.0, dynamic_ncols=True)
    for step in bar:
        if deadline is not None and time.monotonic() > deadline:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg["warmup"], lr)
        windows = corpus.random_windows(stream, cfg["batch"], cfg["seq_len"], gen)
        with autocast():
            loss = loss_fn(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        recent = (recent + [loss.item()])[-50:]
        tok_s = done * cfg["batch"] * cfg["seq_len"] / (time.monotonic() - start)
        bar.set_postfix(loss=f"{recent[-1]:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
        if done % cfg["eval_every"] == 0 and done < steps:
            held = heldout_loss(model, heldout, cfg["batch"], ce)
            tqdm.write(
                f"{name} step {done}: train loss {sum(recent) / len(recent):.4f}, held-out CE {held:.4f}, "
                f"{tok_s:.0f} tokens/s"
            )
    bar.close()
    seconds = time.monotonic() - start
    record = {
        "steps": done,
        "planned_steps": steps,
        "stopped_early": done < steps,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(done * cfg["batch"] * cfg["seq_len"] / max(seconds, 1e-9), 1),
        "final_train_loss": round(sum(recent) / max(1, len(recent)), 4),
        "final_heldout_ce": round(heldout_loss(model, heldout, cfg["batch"], ce), 4),
        "peak_lr": lr,
    }
    tqdm.write(f"{name} done: {json.dumps(record)}")
    return record


def init_draft_embeddings(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Set the draft's (tied) embeddings to the target's projected onto their top principal directions."""
    emb = target.get_input_embeddings().weight.detach().float()
    width = draft.config.hidden_size
    _, _, vh = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(emb @ vh[:width].T)


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def save(model: LlamaForCausalLM, tokenizer, path: Path) -> None:
    """Write `model` in bf16 and `tokenizer` as a Hugging Face directory (its chat template in
    tokenizer_config.json)."""
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path, save_jinja_files=False)


def link_tokenizer(path: Path, source: Path) -> None:
    """Replace the tokenizer files in `path` by relative links to those of `source`, a sibling folder: a
    draft sharing the target's tokenizer keeps one copy of it in the pair."""
    for file in sorted(source.glob("tokenizer*")):
        link = path / file.name
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..") / source.name / file.name)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for target/, draft/, README.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few steps, few files")
    parser.add_argument("--target-steps", type=int, help="override the target's step count")
    parser.add_argument("--draft-steps", type=int, help="override the draft's step count")
    parser.add_argument("--max-minutes", type=float, help="safety cap on training time (recorded if hit)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["target_steps"] = args.target_steps or cfg["target_steps"]
    cfg["draft_steps"] = args.draft_steps or cfg["draft_steps"]
    wall_start = time.monotonic()
    cap = None if args.max_minutes is None else wall_start + 60 * args.max_minutes

    files = corpus.list_files()
    train_files, heldout_files = corpus.split_files(files)
    if cfg["files"] is not None:
        train_files, heldout_files = train_files[: cfg["files"][0]], heldout_files[: cfg["files"][1]]
    print(f"corpus: {len(files)} files, {len(train_files)} train, {len(heldout_files)} held out", flush=True)
    train_texts = corpus.read_texts(train_files)
    tokenizer = corpus.train_tokenizer(train_texts, cfg["vocab_size"])
    eos = tokenizer.eos_token_id
    train_stream = corpus.token_stream(corpus.encode_files(tokenizer, train_texts), eos)
    heldout_encoded = corpus.encode_files(tokenizer, corpus.read_texts(heldout_files))
    heldout_stream = corpus.token_stream(heldout_encoded, eos)
    heldout = corpus.even_windows(heldout_stream, cfg["eval_windows"], cfg["seq_len"])
    tokenizer.model_max_length = cfg["seq_len"]
    print(
        f"tokens: {len(train_stream)} train, {len(heldout_stream)} held out "
        f"({time.monotonic() - wall_start:.0f} s)",
        flush=True,
    )

    torch.manual_seed(args.seed)
    target = llama(cfg["target"], len(tokenizer), cfg["seq_len"], eos)
    draft = llama(cfg["draft"], len(tokenizer), cfg["seq_len"], eos)
    target_deadline = None if cap is None else time.monotonic() + 0.68 * (cap - time.monotonic())
    target_rec = train_loop(
        "target",
        target,
        ce_loss,
        train_stream,
        heldout,
        cfg,
        cfg["target_steps"],
        cfg["target_lr"],
        args.seed,
        target_deadline,
    )
    save(target, tokenizer, args.out / "target")
    target.eval().requires_grad_(False)

    init_draft_embeddings(draft, target)
    draft_rec = train_loop(
        "draft",
        draft,
        lambda m, w: kl_loss(m, target, w),
        train_stream,
        heldout,
        cfg,
        cfg["draft_steps"],
        cfg["draft_lr"],
        args.seed + 1,
        cap,
    )
    save(draft, tokenizer, args.out / "draft")
    link_tokenizer(args.out / "draft", args.out / "target")
    train_seconds = time.monotonic() - wall_start

    info = {
        "seed": args.seed,
        "smoke": args.smoke,
        "max_minutes": args.max_minutes,
        "corpus": {
            "files": len(files),
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
            "heldout_fraction": corpus.HELDOUT_FRACTION,
            "vocab_size": len(tokenizer),
        },
        "seq_len": cfg["seq_len"],
        "batch": cfg["batch"],
        "warmup_steps": cfg["warmup"],
        "heldout_windows": cfg["eval_windows"],
        "target": {**cfg["target"], "params": count_params(target), "loss": "cross-entropy", **target_rec},
        "draft": {
            **cfg["draft"],
            "params": count_params(draft),
            "loss": "KL(target || draft), T=1",
            "embedding_init": "target embeddings projected on their top principal directions",
            **draft_rec,
        },
        "train_wall_seconds": round(train_seconds, 1),
    }
    measure_and_write_card(args.out, info, heldout_encoded, cfg, args.seed)
    return info


if __name__ == "__main__":
    main()
