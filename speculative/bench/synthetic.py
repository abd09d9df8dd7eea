"""Synthetic pairs of real sizes, built in process: no model hub, no checkpoint on disk.

Speed at real sizes needs real shapes, not real weights: a forward's cost is its shapes and dtype.
`build_pair("1b" | "7b", ...)` builds a Llama-shaped target with random weights (SIZES) and a draft cut
from it: the target's embedding, its first `draft_layers` layers, final norm and LM head (shared
tensors, not copies). Undamped, the target's later layers would make its argmax unrelated to the
draft's; so their residual branches (o_proj and down_proj, the two projections whose outputs are added
to the residual stream) are scaled by a damping factor chosen by bisection until the draft's greedy
token agrees with the target's on a fraction `acceptance` of the positions of the target's own greedy
continuations of random prompts. Acceptance in the benchmark's runs then lands near it (it is measured
and reported there, not assumed). The text such a pair writes means nothing; only its speed and
acceptance are real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BISECTION_STEPS = 12
# the agreement is measured on the target's greedy continuations of AGREEMENT_LENGTH tokens of
# AGREEMENT_BATCH random prompts of AGREEMENT_PROMPT tokens
AGREEMENT_BATCH, AGREEMENT_PROMPT, AGREEMENT_LENGTH = 4, 16, 48


@dataclass(frozen=True)
class SyntheticShape:
    """A Llama shape: the target's sizes and how many of its first layers make the draft."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    draft_layers: int
    max_position_embeddings: int = 2048

    def config(self, num_layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )


SIZES = {
    # TinyLlama-1.1B's shape: 1.10 B parameters, 2.20 GB in bfloat16; the draft (2 layers, the LM head)
    # reads about 14% of the target's bytes a token
    "1b": SyntheticShape(22, 2048, 32, 4, 5632, 32000, draft_layers=2),
    # Llama-2-7B's shape: 6.74 B parameters, 13.5 GB in bfloat16
    "7b": SyntheticShape(32, 4096, 32, 32, 11008, 32000, draft_layers=2, max_position_embeddings=4096),
    # for tests: builds and calibrates in seconds on a CPU (the vocabulary: the demo tokenizer's)
    "tiny": SyntheticShape(4, 64, 4, 2, 128, 8192, draft_layers=1, max_position_embeddings=512),
}


@dataclass
class SyntheticPair:
    """A built pair. damping: the factor on the target's later residual branches; agreement: the
    draft's greedy agreement with the target it gives (the calibration's result)."""

    name: str
    shape: SyntheticShape
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    damping: float
    agreement: float

    def describe(self) -> str:
        """One line for a report: what the pair is and that it is synthetic."""
        params = sum(p.numel() for p in self.target.parameters())
        s = self.shape
        return (
            f"synthetic pair {self.name!r}: random Llama-shaped weights, target {params / 1e6:,.1f} M "
            f"parameters ({s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads, "
            f"{s.num_kv_heads} KV heads, MLP {s.intermediate_size}, vocabulary {s.vocab_size}); draft: "
            f"its first {s.draft_layers} layers with its embedding, norm and LM head; later layers' "
            f"residual branches damped by {self.damping:.3g} to a greedy agreement of "
            f"{self.agreement:.2f}. Its text means nothing: only speed and acceptance are real."
        )


def build_pair(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    acceptance: float = 0.8,
) -> SyntheticPair:
    """The synthetic pair `name` (a key of SIZES) in `dtype` on `device`, its damping calibrated so that
    the draft's greedy token agrees with the target's on about `acceptance` of random positions."""
    if name not in SIZES:
        raise ValueError(f"synthetic must be one of {sorted(SIZES)}; got {name!r}")
    if not 0.0 < acceptance < 1.0:
        raise ValueError(f"acceptance must be in (0, 1); got {acceptance}")
    shape = SIZES[name]
    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM._from_config(shape.config(shape.num_layers), dtype=dtype).eval()
    with torch.device("meta"):  # every tensor of it is then the target's
        draft = LlamaForCausalLM._from_config(shape.config(shape.draft_layers), dtype=dtype).eval()
    _share_first_layers(target, draft)
    prompts = torch.randint(0, shape.vocab_size, (AGREEMENT_BATCH, AGREEMENT_PROMPT), device=device)
    damping, agreement = _calibrate(target, draft, shape.draft_layers, prompts, acceptance)
    return SyntheticPair(name, shape, target, draft, damping, agreement)


def _share_first_layers(target: LlamaForCausalLM, draft: LlamaForCausalLM) -> None:
    """Make the draft's parameters the target's own tensors (its first layers, embedding, norm, head)."""
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    for i in range(len(draft.model.layers)):
        draft.model.layers[i] = target.model.layers[i]
    draft.model.rotary_emb = target.model.rotary_emb


def _residual_branches(target: LlamaForCausalLM, first: int) -> list[torch.Tensor]:
    """The weights whose outputs are added to the residual stream, in layers `first` onwards."""
    layers = target.model.layers[first:]
    return [w for layer in layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]


@torch.no_grad()
def _calibrate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, first: int, prompts: torch.Tensor, acceptance: float
) -> tuple[float, float]:
    """Bisect the damping (in log space, between 1e-4 and 1) for the agreement closest to
    `acceptance`; leaves the target damped by the returned factor. Returns (damping, agreement).

    The agreement is measured where generation runs: on the target's own greedy continuation of
    `prompts` ([batch, length] random tokens), at the continuation's positions (random text alone
    agrees far more often than what a random model writes, which tends to loop)."""
    originals = [w.clone() for w in _residual_branches(target, first)]

    def agreement_at(damping: float) -> float:
        for w, original in zip(_residual_branches(target, first), originals):
            w.copy_(original * damping)
        tokens = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=AGREEMENT_LENGTH,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        continuation = slice(prompts.shape[1] - 1, -1)  # the logits that chose each generated token
        drafted = draft(tokens).logits[:, continuation].argmax(-1)
        return (drafted == tokens[:, prompts.shape[1] :]).float().mean().item()

    low, high = math.log(1e-4), 0.0  # more damping, more agreement
    best = (1.0, agreement_at(1.0))
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        found = agreement_at(math.exp(middle))
        if abs(found - acceptance) < abs(best[1] - acceptance):
            best = (math.exp(middle), found)
        low, high = (middle, high) if found > acceptance else (low, middle)
    agreement_at(best[0])
    return best
