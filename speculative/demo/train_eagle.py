"""An EAGLE head for an already trained demo target: `python -m speculative.demo.train_eagle --pair
models/demo --steps 600` (EAGLE-1 layout by default, `--layout eagle3` for EAGLE-3); `--resume --steps N`
trains the saved head N steps more.

The recipe trains the head on the demo corpus's training files (the pair's held-out files for the
measurements), encoded with the pair's own tokenizer, at the draft's learning rate and schedule, to
the target's own next-token distributions: the loss is KL(target || head) at every position, the
target's distributions computed on the same windows (distillation: the head learns what the target
would say, not the corpus's next token). It is trained as it drafts (EAGLE-3's "training-time
test"): `--depth` D passes over each window, pass d feeding the head its own hidden states from pass
d - 1 as the features, so that the drafts after the first are learned from the head's own guesses,
as they are made; pass d's loss is weighted 0.8^(d-1). The head is written to `<pair>/<layout>/` in
the published layout (an EAGLE-3 head without its lm_head, the target's rows, frozen, which the
loader takes from the target; save_speculators writes it where a checkpoint must hold it), with
`training.json` beside it (the training record and the measured acceptance, greedy, of the head
and of the pair's draft model: k=4 chains and dynamic trees on held-out prompts through the
engine, the acceptance rate and the mean tokens per step) and `README.md`, its card.

`--generated N` mixes in the target's own text (self-distillation data, as EAGLE and Medusa-2
recommend): N prompts of the training files, each continued greedily by the target through the engine,
half of every batch's windows drawn from those, half from the corpus. A head trained on the corpus
alone agrees with the target less on the target's own continuations (what a drafter drafts after)
than a draft model does, though it agrees more on the corpus.

A head can be trained in pieces: `--resume` loads `<pair>/<layout>/` and trains it `--steps` steps more
(a fresh optimizer, warmup and decay: a warm restart; its windows drawn with the seed offset by the
steps so far, so that they are not the earlier pieces' again), then measures it again. training.json
keeps every piece's record (`pieces`) and their sums: steps, tokens, seconds.

`--draft-vocab N` trains nothing: it gives the saved EAGLE-1 head a draft vocabulary of the N tokens
most frequent in the training files (FR-Spec: its drafts then read N rows of the target's lm_head
instead of all; models/eagle.py), then measures it again; training.json records the cut and the
held-out files' share of tokens inside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from speculative.demo import corpus
from speculative.demo.model_card import engine_acceptance, file_prompts
from speculative.demo.train import FULL, SMOKE, train_loop
from speculative.models.eagle import EagleHead, EagleLayout
from speculative.models.eagle_checkpoint import load_head_weights, save_eagle_head, write_draft_vocabulary

LAYOUT_NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}
DEPTH_DECAY = 0.8  # pass d's loss weight is DEPTH_DECAY ** (d - 1)
ANSWERS_VOCAB = 16384  # --target's draft vocabulary


def eagle_head(
    target: LlamaForCausalLM, sizes: dict, layout: EagleLayout = "eagle", vocabulary: Tensor | None = None
) -> EagleHead:
    """A fresh head for `target`: one decoder layer of the target's width and RoPE with `sizes`'
    intermediate_size, attention heads and KV heads, and the target's embedding and lm_head, frozen.
    "eagle": fc over [embedding ; the target's last hidden state] (bias), the lm_head shared, not
    saved; "eagle3": fc over the streams entering the target's layers 2 and L // 2 and its final
    norm's output (what its lm_head reads; vLLM's default third layer is L - 3, which trained no
    better on the demo target from the earlier start, but vLLM serves only heads reading streams
    entering layers below L: eagle_checkpoint.save_speculators refuses this one), its own norm and a
    copy of the target's lm_head over the whole vocabulary (the norm saved as the layout has it, the
    lm_head frozen and left out: save_eagle_head's share_lm_head). `vocabulary` ([n] int64 token ids,
    distinct): the head's lm_head is cut to those rows (a draft vocabulary).

    It starts near the identity on the target's final hidden state: fc passes that feature through (its
    other inputs weighted 0), the layer's MLP output is 0 (down_proj), and so is its attention's for
    "eagle" (o_proj), while an "eagle3" head's attention starts adding its position's own token
    (attend_to_own_token); the "eagle3" norm's gain is the RMS of the target's final norm's, so that
    its first logits are close to the target's own at the position before, well scaled. From a random
    start the head's logits are large and far off: a first cross-entropy of 25 on SmolLM2-135M's
    answers, against 12 from this start."""
    t = target.config
    config = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        max_position_embeddings=t.max_position_embeddings,
        num_hidden_layers=1,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters=t.rope_parameters,
        **{k: sizes[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")},
    )
    layers, width = t.num_hidden_layers, t.hidden_size
    if layout == "eagle":
        head = EagleHead(config, "eagle", width, (layers,), fc_bias=True)
    else:
        head = EagleHead(config, "eagle3", 3 * width, (min(2, layers - 1), layers // 2, layers))
    with torch.no_grad():  # the identity on the final hidden state (docstring)
        head.fc.weight.zero_()
        head.fc.weight[:, -width:] = torch.eye(width)
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        layer = head.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if layout == "eagle3":
            head.model.norm.weight.fill_(target.model.norm.weight.float().pow(2).mean().sqrt().item())
            attend_to_own_token(layer.self_attn, config.num_attention_heads, config.num_key_value_heads)
    frozen = ((head.model.embed_tokens, target.get_input_embeddings()), (head.lm_head, target.lm_head))
    for module, source in frozen:
        module.weight = torch.nn.Parameter(source.weight.detach().float(), requires_grad=False)
    if vocabulary is not None:
        head.restrict_vocabulary(vocabulary)  # packs the weights
    else:
        head.pack_weights()
    return head


SELF_SCORE = 8.0  # attend_to_own_token: a position's attention logit on its own token, at the start
OWN_TOKEN_GAIN = 0.3  # attend_to_own_token's share of the token's embedding added to the residual stream


@torch.no_grad()
def attend_to_own_token(attention: nn.Module, heads: int, kv_heads: int) -> None:
    """Start an "eagle3" head's attention (its q/k/v projections read [input_layernorm(embedding) ;
    hidden_norm(feature)], 2H) reading each position's own token: the embedding's columns of q and k
    project onto the same orthonormal directions (kv_heads blocks of head_dim, a query head using its
    KV head's block), v onto them too, and o_proj maps them back (OWN_TOKEN_GAIN of the projection);
    the feature's columns keep their random start.

    Why: in EAGLE-3's layout the token a position reads (x_{p+1}, the one whose successor it drafts)
    reaches the residual stream only through the attention, and from the usual start (o_proj 0 so that
    the head is the identity on its feature, q/k random) the attention is spread over the whole window
    and gets no gradient until o_proj has moved, so the head learns slowly and drafts badly past its
    first token (docs/drafters.md, "EAGLE heads", has the runs). A position's logit on itself is
    SELF_SCORE (the normed embedding has unit RMS, so its projection onto head_dim directions has
    |.|^2 about head_dim, and RoPE turns q and k by the same angle), other tokens' scatter around 0, so
    the softmax starts on the position itself (and on earlier copies of its token), and its token
    enters the stream as EAGLE-1's fc enters it."""
    hidden = attention.o_proj.out_features
    head_dim = attention.o_proj.in_features // heads
    group, width = heads // kv_heads, kv_heads * head_dim
    basis = torch.linalg.qr(torch.randn(hidden, hidden))[0][:, :width].T  # [width, H] orthonormal rows
    per_head = basis.view(kv_heads, head_dim, hidden).repeat_interleave(group, 0).reshape(-1, hidden)
    scale = (SELF_SCORE / head_dim**0.5) ** 0.5  # the logit: scale^2 |projection|^2 / sqrt(head_dim)
    attention.q_proj.weight[:, :hidden] = scale * per_head
    attention.k_proj.weight[:, :hidden] = scale * basis
    attention.v_proj.weight[:, :hidden] = basis
    attention.o_proj.weight.copy_(OWN_TOKEN_GAIN / group * per_head.T)


def ttt_visible(length: int, depth: int) -> Tensor:
    """[length, depth * length] bool: which keys pass `depth`'s query p sees in training-time test.
    Keys [0, length) are pass 1's (fed the target's features): those at positions <= p, as the head's
    cache holds them when drafting after position p. Key (e - 1) * length + p is pass e's at the same
    p: the head's own earlier drafts of that chain."""
    index = torch.arange(length)
    visible = torch.zeros(length, depth * length, dtype=torch.bool)
    visible[:, :length] = index[None, :] <= index[:, None]
    for e in range(1, depth):
        visible[index, e * length + index] = True
    return visible


def ttt_hidden(head: EagleHead, features: Tensor, tokens: Tensor, depth: int) -> list[Tensor]:
    """The head's hidden states in each pass of the training-time test, drafting `depth` tokens deep
    from each of `length` positions: features [batch, length, feature_size] (the target's, at positions
    0 .. length - 1), tokens [batch, length + depth] -> `depth` tensors [batch, length, hidden_size].

    Pass d (1 .. depth) at index p is head position p + d - 1: it reads token tokens[:, p + d] and, as
    its feature, the target's at position p (d = 1) or the head's own hidden state from pass d - 1 at
    p; it sees pass 1's keys up to p and the earlier passes' at p (ttt_visible), and its hidden state
    gives the draft of the token after tokens[:, p + d]. Runs in float32 (the head's cache does);
    differentiable with respect to the head's parameters."""
    batch, length = features.shape[:2]
    head.prepare(depth * length)
    visible = ttt_visible(length, depth)[None, None]
    index = torch.arange(length, device=tokens.device).expand(batch, length)
    hidden, out, keys, values = features, [], [], []
    with torch.autocast("cpu", enabled=False):
        for d in range(1, depth + 1):
            span = d * length
            cache = head.new_cache(batch, length)  # this pass's K/V, after the earlier passes'
            keys = [torch.cat(pair, dim=2) for pair in zip(keys, cache.keys)] or cache.keys
            values = [torch.cat(pair, dim=2) for pair in zip(values, cache.values)] or cache.values
            _, hidden = head.run_head(
                tokens[:, d : d + length],
                hidden,
                index + d - 1,
                keys,
                values,
                head._arange[:span],
                None,
                slots=index + (d - 1) * length,
                tree_masks={None: visible[..., :span]},
                with_logits=False,
            )
            out.append(hidden)
    return out


def ttt_losses(head: EagleHead, target: LlamaForCausalLM, windows: Tensor, depth: int) -> tuple:
    """The head's losses on [batch, n + 1] token windows, drafting `depth` tokens deep (ttt_hidden over
    the first n - depth positions). Returns the list of per-pass KL(target || head) (mean over
    positions; the target's distribution of pass d's token x_{p+d+1} is its logits at position p + d)
    and pass 1's cross-entropy of the corpus's x_{p+2}. The target runs under the caller's autocast."""
    with torch.no_grad():
        out = target(input_ids=windows[:, :-1], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in head.target_layers], dim=-1).float()
        teacher = F.log_softmax(out.logits.float(), dim=-1)  # [batch, n, vocab]
    length = windows.shape[1] - 1 - depth
    kls = []
    for d, hidden in enumerate(ttt_hidden(head, features[:, :length], windows[:, :-1], depth), start=1):
        logits = head.head_logits(hidden).reshape(-1, teacher.shape[-1])
        if d == 1:
            ce = F.cross_entropy(logits, windows[:, 2 : 2 + length].reshape(-1))
        teacher_d = teacher[:, d : d + length].reshape(-1, teacher.shape[-1])
        kls.append(F.kl_div(F.log_softmax(logits, -1), teacher_d, log_target=True, reduction="batchmean"))
    return kls, ce


def ttt_loss(head: EagleHead, target: LlamaForCausalLM, windows: Tensor, depth: int) -> Tensor:
    """The training loss: ttt_losses' per-pass KLs, pass d weighted DEPTH_DECAY ** (d - 1)."""
    kls, _ = ttt_losses(head, target, windows, depth)
    return sum(DEPTH_DECAY**d * kl for d, kl in enumerate(kls))


def train_eagle_head(target, stream, heldout, cfg, steps, seed, deadline, path: Path, head: dict) -> dict:
    """Train a head for `target` `steps` steps of ttt_loss on `stream` at the draft's learning rate
    (train_loop's other arguments). `head`: its "layout", the training-time test's "depth", and
    "resume": a fresh head (eagle_head, with the draft's sizes) or the one saved in `path` (its sizes
    and weights; a fresh optimizer and schedule). Write it to `path` in the published layout and return
    train_loop's record (its held-out figure: pass 1's cross-entropy of the corpus's next token)."""
    resume, layout = head["resume"], head["layout"]
    sizes = json.loads((path / "config.json").read_text()) if resume else cfg["draft"]
    model = eagle_head(target, sizes, layout)
    if resume:
        load_head_weights(model, path)
    record = train_loop(
        layout,
        model,
        lambda m, w: ttt_loss(m, target, w, head["depth"]),
        stream,
        heldout,
        cfg,
        steps,
        cfg["draft_lr"],
        seed + 2,
        deadline,
        ce=lambda m, w: ttt_losses(m, target, w, 1)[1],
    )
    save_eagle_head(model, path, share_lm_head=True)
    return record


PIECE_TOTALS = ("steps", "planned_steps", "tokens", "seconds", "wall_seconds")
# The drafting shapes whose greedy acceptance the card reports: k=4 chains (what the draft model runs
# best) and a dynamic tree (EAGLE-2's: the most confident of the top-4 candidates, 24 nodes, 6 deep).
SHAPES = {
    "chain": {"num_speculative_tokens": 4},
    "tree": {"num_speculative_tokens": 6, "tree": "dynamic", "tree_width": 4, "tree_nodes": 24},
}


GENERATION_BATCH = 64  # prompts the target continues at once


def target_continuations(pair: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt (the target's token ids) followed by the target's greedy continuation of
    `new_tokens` tokens, through the engine (float32), GENERATION_BATCH prompts at a time."""
    from speculative.llm import LLM
    from speculative.sampling_params import SamplingParams

    llm = LLM(str(pair / "target"), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    texts = []
    for start in range(0, len(prompts), GENERATION_BATCH):
        part = prompts[start : start + GENERATION_BATCH]
        outputs = llm.generate([{"prompt_token_ids": p} for p in part], params)
        texts += [p + list(o.outputs[0].token_ids) for p, o in zip(part, outputs)]
    return texts


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
    acceptance, layout = info["acceptance"], info["layout"]
    rows = "\n".join(
        f"| {name} | {shape} | {figures['acceptance_rate']:.3f} | {figures['mean_accepted_length']:.2f} |"
        for shape in SHAPES
        for name, figures in acceptance[shape].items()
    )
    pieces = "\n".join(
        f"- {p['steps']} steps of {p['batch']} windows of {p['seq_len']} tokens, peak learning rate "
        f"{p['peak_lr']}, loss {p['loss']}, on {p.get('data', 'corpus windows')}"
        for p in info["pieces"]
    )
    if layout == "eagle":
        reads = (
            "an `fc` over [token embedding ; the target's last hidden state], sharing the target's "
            "embedding and LM head"
        )
    else:
        low, middle, _ = info["target_layers"]
        reads = (
            f"an `fc` over the target's hidden states {info['target_layers']} (the residual streams entering "
            f"its layers {low} and {middle}, and its final norm's output) and its own final norm, sharing "
            "the target's embedding and LM head (over the whole vocabulary: frozen in training, not saved)"
        )
    cut = info.get("draft_vocabulary")
    vocabulary = (
        ""
        if cut is None
        else f"""
Its draft vocabulary is the {cut["size"]} tokens {cut["chosen_by"]} (`--draft-vocab {cut["size"]}`,
FR-Spec): each drafted token reads those rows of the target's LM head rather than all of them, and
the head drafts no other token; they are {cut["heldout_coverage"]:.1%} of the held-out files' tokens.
"""
    )
    path.joinpath("README.md").write_text(
        f"""# {LAYOUT_NAMES[layout]} head for the demo target

One Llama decoder layer (intermediate size {info["intermediate_size"]}) with {reads}: load it with
`LLM("models/demo/target", draft_model="models/demo/{layout}",
speculative_config=SpeculativeConfig(method="{layout}"))`. Trained by `python -m
speculative.demo.train_eagle --pair models/demo --layout {layout}` on the demo corpus's training files, in
pieces (the first with `--steps N`, each later one with `--resume --steps N`):

{pieces}

In all {info["steps"]} steps, {info["tokens"]} tokens, {info["seconds"]} s of training; final train loss
{info["final_train_loss"]}, held-out cross-entropy of the corpus's next token {info["final_heldout_ce"]}.
{vocabulary}
Greedy acceptance through the engine, {acceptance["prompts"]} held-out prompts of {acceptance["prompt_len"]}
tokens, {acceptance["new_tokens"]} new tokens each (training.json): chains of k = 4, and dynamic trees
(EAGLE-2's) of 24 nodes, 6 deep, from the top 4 candidates of each node expanded.

| drafter | shape | acceptance rate | mean tokens per step |
|---|---|---|---|
{rows}
"""
    )


def measure_acceptance(pair: Path, layout: EagleLayout, prompts: list, cfg: dict, count: int) -> dict:
    """training.json's `acceptance`: the saved head's and the pair's draft model's, greedy, through the
    engine, on the held-out `prompts` (`count` of them), in each of SHAPES."""
    drafters = {layout: (pair / layout, layout), "draft": (pair / "draft", "draft_model")}
    return {
        "prompts": count,
        "prompt_len": cfg["prompt_len"],
        "new_tokens": cfg["new_tokens"],
        **{
            shape: engine_acceptance(pair / "target", drafters, prompts, cfg["new_tokens"], **speculative)
            for shape, speculative in SHAPES.items()
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pair", type=Path, help="a demo pair's directory (target/, draft/)")
    source.add_argument("--target", type=Path, help="a target's Hugging Face folder, on its answers (--data)")
    parser.add_argument("--data", type=Path, help="--target: the folder of the answers train_draft collected")
    parser.add_argument("--out", type=Path, help="--target: the head's folder")
    parser.add_argument("--target-name", help="--target: its name in the card")
    parser.add_argument("--features", type=Path, help="--target: a file keeping the target's features")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="--target: padded tokens a batch")
    parser.add_argument("--heldout", type=int, default=64, help="--target: held-out answers measured")
    parser.add_argument("--eval-every", type=int, default=0, help="--target: held-out figures every N steps")
    parser.add_argument("--intermediate", type=int, help="--target: MLP size (default: the target's)")
    parser.add_argument("--warmup", type=int, default=80, help="--target: warmup steps")
    parser.add_argument("--new-tokens", type=int, default=128, help="--target: tokens a prompt, acceptance")
    parser.add_argument("--layout", choices=tuple(LAYOUT_NAMES), default="eagle")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--depth", type=int, default=3, help="training-time test passes (drafts deep)")
    parser.add_argument("--seq-len", type=int, help="tokens a training window (default: the recipe's / 2)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the recipe's draft's)")
    parser.add_argument(
        "--resume", action="store_true", help="train the saved head (<pair>/<layout>) --steps steps more"
    )
    parser.add_argument(
        "--generated", type=int, default=0, help="training prompts the target continues: half the windows"
    )
    parser.add_argument("--smoke", action="store_true", help="the recipe's tiny windows and few files")
    parser.add_argument("--max-minutes", type=float, help="safety cap on training time (recorded if hit)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="--pair: train nothing, cut the saved EAGLE-1 head's draft vocabulary to the N most frequent "
        f"tokens; --target: train over the N tokens most frequent in the answers (default {ANSWERS_VOCAB})",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.depth < 1:
        parser.error(f"--depth must be at least 1; got {args.depth}")
    if args.target is not None:
        return _on_answers(parser, args, argv)
    if args.data is not None or args.out is not None:
        parser.error("--data and --out are --target's (a pair's head goes to <pair>/<layout>)")
    if args.generated < 0:
        parser.error(f"--generated must be at least 0; got {args.generated}")
    if args.draft_vocab is not None and (args.layout != "eagle" or args.draft_vocab < 1):
        parser.error(f"--draft-vocab takes --layout eagle and N >= 1; got {args.layout}, {args.draft_vocab}")
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["seq_len"] = args.seq_len or cfg["seq_len"] // 2
    cfg["draft_lr"] = args.lr or cfg["draft_lr"]
    start = time.monotonic()
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes

    tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    target = AutoModelForCausalLM.from_pretrained(args.pair / "target", dtype=torch.float32)
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

    path = args.pair / args.layout
    prompts = file_prompts(heldout_encoded, args.prompts, cfg["prompt_len"], args.seed).tolist()
    if args.draft_vocab is not None:
        counts = torch.bincount(train_stream, minlength=target.config.vocab_size)
        tokens = counts.argsort(descending=True, stable=True)[: args.draft_vocab]
        write_draft_vocabulary(path, tokens)
        inside = torch.zeros(target.config.vocab_size, dtype=torch.bool).index_fill_(0, tokens, True)
        info = json.loads((path / "training.json").read_text())
        info["draft_vocabulary"] = {
            "size": args.draft_vocab,
            "chosen_by": "most frequent in the training files",
            "heldout_coverage": round(inside[heldout_stream].float().mean().item(), 4),
        }
        info["acceptance"] = measure_acceptance(args.pair, args.layout, prompts, cfg, args.prompts)
        (path / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        write_card(info, path)
        print(json.dumps(info["acceptance"], indent=2))
        return info
    before = []
    if args.resume:  # earlier pieces keep the loss they were trained with
        earlier = json.loads((path / "training.json").read_text())
        before = [{"loss": earlier["loss"], **p} for p in earlier["pieces"]]
    seed = args.seed + sum(p["steps"] for p in before)  # new windows for a resumed head
    torch.manual_seed(seed)
    head = {"layout": args.layout, "depth": args.depth, "resume": args.resume}
    data = "corpus windows"
    if args.generated:
        starts = file_prompts(train_encoded, args.generated, cfg["prompt_len"], seed).tolist()
        new_tokens = cfg["seq_len"] // 2
        texts = target_continuations(args.pair, starts, new_tokens)
        train_stream = (train_stream, corpus.token_stream(texts, eos))
        data = (
            f"half corpus windows, half windows of {args.generated} training prompts of "
            f"{cfg['prompt_len']} tokens, each continued greedily by the target for {new_tokens} tokens"
        )
    record = train_eagle_head(target, train_stream, heldout, cfg, args.steps, seed, deadline, path, head)
    acceptance = measure_acceptance(args.pair, args.layout, prompts, cfg, args.prompts)
    piece = {
        **record,
        "loss": f"KL(target || head) at every position, training-time test {args.depth} drafts deep, "
        f"draft d weighted {DEPTH_DECAY}^(d-1)",
        "data": data,
        "tokens": record["steps"] * cfg["batch"] * cfg["seq_len"],
        "batch": cfg["batch"],
        "seq_len": cfg["seq_len"],
        "wall_seconds": round(time.monotonic() - start, 1),
    }
    head_config = json.loads((path / "config.json").read_text())
    info = {
        "layout": args.layout,
        "target": str(args.pair / "target"),
        "target_layers": head_config.get("eagle_aux_hidden_state_layer_ids", [len(target.model.layers)]),
        "intermediate_size": head_config["intermediate_size"],
        **combined([*before, piece]),
        "acceptance": acceptance,
    }
    (path / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    write_card(info, path)
    print(json.dumps(info["acceptance"], indent=2))
    return info


def _on_answers(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> dict:
    """The --target recipe (speculative/demo/eagle_answers.py)."""
    from speculative.demo import eagle_answers

    missing = [name for name in ("data", "out") if getattr(args, name) is None]
    if missing:
        parser.error("--target needs " + " and ".join(f"--{m}" for m in missing))
    if args.smoke or args.generated:
        parser.error("--smoke and --generated are --pair's")
    for name in ("steps", "batch_tokens", "heldout", "prompts", "new_tokens", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    args.seq_len = args.seq_len or 768
    args.lr = args.lr or eagle_answers.ANSWERS_LR
    args.draft_vocab = args.draft_vocab or ANSWERS_VOCAB
    if args.seq_len <= args.depth or args.draft_vocab < 1:
        parser.error(
            f"--seq-len must exceed --depth and --draft-vocab be at least 1; got {args.seq_len}, "
            f"{args.draft_vocab}"
        )
    torch.manual_seed(args.seed)
    info = eagle_answers.train(args)
    info["command"] = "python -m speculative.demo.train_eagle " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    eagle_answers.write(info)
    print(json.dumps({k: info[k] for k in ("heldout_before", "heldout_after", "acceptance")}, indent=2))
    return info


if __name__ == "__main__":
    main()
