"""Measurements of the trained demo pair and its model card (`README.md`, `training.json`).

The pair is reloaded from the written directories with `AutoModelForCausalLM` (float32), so what is
measured is what was saved. The greedy acceptance rate: prompts cut from held-out files, the target
generates greedily with `generate(do_sample=False)`, the draft is teacher-forced on prompt + continuation,
and the rate is the fraction of generated positions (up to and including a first `<|endoftext|>`) where
the draft's argmax equals the target's token. The decode-step cost is the mean wall time of one cached
single-token forward at batch 1.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from speculative.machine import machine


def file_prompts(encoded: list[list[int]], count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] token windows at seeded offsets in distinct files of `encoded` (cycling if too
    few): held-out prompts for the acceptance, or training prompts for the target to continue."""
    eligible = [ids for ids in encoded if len(ids) > length]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(eligible), generator=gen).tolist()
    prompts = []
    for i in range(count):
        ids = eligible[order[i % len(eligible)]]
        start = int(torch.randint(0, len(ids) - length + 1, (1,), generator=gen))
        prompts.append(ids[start : start + length])
    return torch.tensor(prompts, dtype=torch.int64)


@torch.no_grad()
def greedy_acceptance(target, draft, prompts: torch.Tensor, new_tokens: int, eos_id: int) -> dict:
    """Per-token greedy acceptance of `draft` against `target` on the target's greedy continuations."""
    seqs = target.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=eos_id,
    )
    generated = seqs[:, prompts.shape[1] :]
    is_eos = (generated == eos_id).long()
    valid = (is_eos.cumsum(1) - is_eos) == 0
    preds = draft(input_ids=seqs).logits[:, prompts.shape[1] - 1 : -1].argmax(-1)
    matches = ((preds == generated) & valid).sum().item()
    total = valid.sum().item()
    return {
        "greedy_acceptance_rate": round(matches / total, 4),
        "positions": total,
        "prompts": len(prompts),
        "prompt_len": prompts.shape[1],
        "new_tokens": new_tokens,
    }


@torch.no_grad()
def engine_acceptance(
    target: Path,
    drafters: dict[str, tuple[Path, str]],
    prompts: list[list[int]],
    new_tokens: int,
    **speculative,
) -> dict:
    """Greedy acceptance through the engine (float32, EOS ignored) of the target in folder `target` on
    `prompts` (its token ids) with each drafter `drafters[name]` = (its folder, its SpeculativeConfig
    method), with the fields `speculative` (say num_speculative_tokens, tree): per name, the
    acceptance rate and the mean tokens per step."""
    from speculative.config import SpeculativeConfig
    from speculative.llm import LLM
    from speculative.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    result = {}
    for name, (folder, method) in drafters.items():
        llm = LLM(
            str(target),
            draft_model=str(folder),
            speculative_config=SpeculativeConfig(method=method, **speculative),
            dtype="float32",
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        drafted = sum(o.metrics.num_drafted for o in outputs)
        accepted = sum(o.metrics.num_accepted for o in outputs)
        steps = sum(o.metrics.num_steps for o in outputs)
        result[name] = {
            "acceptance_rate": round(accepted / max(drafted, 1), 4),
            "mean_accepted_length": round(1 + accepted / max(steps, 1), 3),
        }
        del llm, outputs
        gc.collect()  # the engine's caches, before the next drafter's
    return result


def decode_step_ms(model, context: int, steps: int) -> float:
    """Mean milliseconds of one batch-1 single-token forward with a KV cache holding `context` tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for i in range(steps + 5):
        if i == 5:
            start = time.perf_counter()
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps * 1e3


def measure_and_write_card(
    out: Path, info: dict, heldout_encoded: list[list[int]], cfg: dict, seed: int
) -> None:
    """Reload the pair from `out`, measure acceptance and step costs, write `training.json` and
    `README.md`."""
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval()
    prompts = file_prompts(heldout_encoded, cfg["prompts"], cfg["prompt_len"], seed)
    info["acceptance"] = greedy_acceptance(
        target, draft, prompts, cfg["new_tokens"], target.config.eos_token_id
    )
    steps = 20 if info["smoke"] else 200
    t_ms, d_ms = (
        decode_step_ms(target, cfg["prompt_len"], steps),
        decode_step_ms(draft, cfg["prompt_len"], steps),
    )
    info["decode_step_ms_fp32"] = {
        "target": round(t_ms, 3),
        "draft": round(d_ms, 3),
        "ratio": round(t_ms / d_ms, 2),
        "context": cfg["prompt_len"],
    }
    info["machine"] = machine()
    info["corpus"]["python"] = info["machine"]["python"]
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(card(info))
    print(f"acceptance {info['acceptance']}\ndecode step {info['decode_step_ms_fp32']}", flush=True)


def _model_row(name: str, m: dict) -> str:
    return (
        f"| {name} | {m['params'] / 1e6:.2f}M | {m['num_hidden_layers']} | {m['hidden_size']} | "
        f"{m['intermediate_size']} | {m['num_attention_heads']}/{m['num_key_value_heads']} | "
        f"{m['steps']} / {m['planned_steps']} | {m['peak_lr']} | {m['loss']} | {m['final_train_loss']} | "
        f"{m['final_heldout_ce']} | {m['seconds'] / 60:.1f} min, {m['tokens_per_second']:.0f} tok/s |"
    )


def card(info: dict) -> str:
    """The model card (markdown) for the numbers in `info`."""
    c, t, d, a, s, mc = (
        info["corpus"],
        info["target"],
        info["draft"],
        info["acceptance"],
        info["decode_step_ms_fp32"],
        info["machine"],
    )
    early = [n for n in ("target", "draft") if info[n]["stopped_early"]]
    stop_note = (
        f"**The --max-minutes {info['max_minutes']} cap stopped {' and '.join(early)} training early** "
        "(see the steps column)."
        if early
        else "All planned steps ran (no time cap was hit)."
    )
    return f"""# The demo model pair: `target/` and `draft/`

Two small Llama-family models (`LlamaForCausalLM`) for demonstrating and testing speculative decoding,
made by `python -m speculative.demo.train --out models/demo --seed {info["seed"]}`. They write plausible
Python and nothing more. Both directories load unchanged with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`; weights are bf16 safetensors; the tokenizer is shared (`draft/`'s tokenizer
files are links to `target/`'s).

## Corpus and split

- The `.py` files of the Python {c["python"]} standard library (`sysconfig.get_paths()["stdlib"]`, sorted
  by relative path, site-packages excluded): {c["files"]} files.
- Held out: a file whose relative path's SHA-256 (first 8 bytes, big-endian) is below
  {c["heldout_fraction"]} x 2^64, fixed for every run and machine: {c["heldout_files"]} files
  ({c["heldout_tokens"]:,} tokens). Training (tokenizer included) never sees them.
- Train: {c["train_files"]} files, {c["train_tokens"]:,} tokens.
- Tokenizer: byte-level BPE (`tokenizers`), vocab {c["vocab_size"]}, `<|endoftext|>` (id 0) is bos, eos and
  pad; it opens every file in the token stream, and the tokenizer prepends it to every encoded text.

## Models and training

Sequence length {info["seq_len"]}, batch {info["batch"]} random windows, AdamW (betas 0.9/0.95, weight decay
0.1), {info["warmup_steps"]} warmup steps then cosine decay to 10%, gradient clipping at 1.0, bf16 autocast
where the CPU computes bf16 natively (float32 elsewhere), seed {info["seed"]}. Tied input/output embeddings,
`max_position_embeddings` = {info["seq_len"]}.
The draft is distilled from the finished (bf16) target: forward KL to the target's distribution at every
position; its embeddings start as {d["embedding_init"]}. Losses are means over the last 50 steps (train)
and over {info["heldout_windows"]} fixed held-out windows (cross-entropy).

| model | params | layers | hidden | MLP | heads/kv | steps (done/planned) | peak lr | train loss | final train loss | held-out CE | time |
|---|---|---|---|---|---|---|---|---|---|---|---|
{_model_row("target", t)}
{_model_row("draft", d)}

{stop_note} Training wall time, tokenizer and data included: {info["train_wall_seconds"] / 60:.1f} min.

## Draft against target

- Greedy acceptance rate on held-out files: **{a["greedy_acceptance_rate"]}** ({a["prompts"]} prompts of
  {a["prompt_len"]} tokens from distinct held-out files, the target's {a["new_tokens"]}-token greedy
  continuation, {a["positions"]} positions; the draft's argmax, teacher-forced, equals the target's token).
- Decode step (batch 1, one token, KV cache of {s["context"]} tokens, Hugging Face float32 on this
  machine): target {s["target"]} ms, draft {s["draft"]} ms, ratio {s["ratio"]}x.

## Machine

`nproc` {mc["nproc"]} ({mc["torch_threads"]} torch threads, OMP_WAIT_POLICY {mc["omp_wait_policy"]}),
{mc["cpu"]}, {mc["platform"]}; Python {mc["python"]}, torch {mc["torch"]},
transformers {mc["transformers"]}, tokenizers {mc["tokenizers"]}. All numbers are in `training.json`.
"""
