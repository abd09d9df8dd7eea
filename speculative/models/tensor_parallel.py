"""One rank's shard of a native Llama-family model (NativeCausalLM) under tensor parallelism (a model
on transformers' forward is split by transformers itself: models/hf_tensor_parallel.py).

Megatron-LM's split (Shoeybi et al. 2019) over N ranks; rank r holds:

  q/k/v     column-parallel: query heads [r H/N, (r+1) H/N) and KV heads [r KV/N, (r+1) KV/N) (with
            GQA, query head h reads KV head h // (H / KV): contiguous blocks of both keep each group
            on one rank), so its KV cache holds its own KV heads only
  o_proj    row-parallel: the input columns of its heads; the partial products are all-reduced
  gate/up   column-parallel: MLP columns [r I/N, (r+1) I/N)
  down_proj row-parallel: the rows of those columns; all-reduced
  embedding and lm_head  split by vocabulary: rows [r V', (r+1) V'), V' = ceil(V / N), the last
            shard zero-padded; a token's embedding comes from the rank that holds it (the others add
            zeros to it in an all-reduce, exactly), the logits of every shard are all-gathered
  norms, q/k norms, RoPE  replicated

A forward thus makes two all-reduces of [tokens, hidden] per layer, one more for the embedding and
one all-gather of [tokens, V'] logits. The row-parallel layers' bias and the residual are added on
rank 0 alone, before the all-reduce. Every rank ends a forward with the same logits, bit for bit:
an all-reduce or an all-gather hands every rank the same result, and everything after it runs
replicated on identical inputs.

The lm_head is split by vocabulary rather than replicated: a rank then holds 1/N of its bytes, and
by the cost model of docs/parallel.md the split is the cheaper one on GPUs. On a 2-core CPU (gloo,
one thread a rank) the replicated head would be cheaper at decoding sizes, the same from about 40
rows (docs/internals.md#measured-choices; benchmarks/tensor_parallel.py).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from speculative.models import hf_tensor_parallel, llama
from speculative.models.gguf import check_not_split
from speculative.models.packed import PackedLinear
from speculative.models.rope import attention_head_dim


class RankGroup(Protocol):
    """What a shard needs of its tensor-parallel group: this process's `rank` in [0, size) and the
    number of ranks, `size`. The collectives (all_reduce, all_gather_single) are torch.distributed's,
    on its default group, which must be these ranks (speculative.distributed.group.TensorParallelGroup
    is one such group, structurally: models/ never imports distributed/)."""

    rank: int
    size: int


# The layers (their names within a decoder layer) split by output rows, by input columns, and the
# parameters split by vocabulary rows
_COLUMN_PARALLEL = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight")


def _split_counts(config: PretrainedConfig) -> dict[str, int]:
    """What a split must divide, by name: the attention heads, the key/value heads (the attention heads
    where the config names none) and the MLP columns (where it names them)."""
    counts = {
        "attention heads": config.num_attention_heads,
        "key/value heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    }
    if getattr(config, "intermediate_size", None):
        counts["MLP columns (intermediate_size)"] = config.intermediate_size
    return counts


def allowed_sizes(config: PretrainedConfig) -> list[int]:
    """The tensor-parallel sizes a model of this config splits into: those dividing its attention heads,
    its key/value heads and its MLP columns (intermediate_size)."""
    counts = _split_counts(config).values()
    return [n for n in range(1, min(counts) + 1) if all(c % n == 0 for c in counts)]


def check_model(
    model: object, model_impl: str, size: int, role: str, name: str, device: str | torch.device
) -> None:
    """A ValueError naming `name` (the LLM's keyword) unless `model` (a hub id, a path or a transformers
    model; `role` "target" or "draft model") can be split over `size` ranks on `device`: on the native
    forward, or else by transformers' own tensor parallelism (models/hf_tensor_parallel.py: it needs a
    plan for the model type, and the machine's accelerator or the CPU); `size` must divide its heads,
    key/value heads and MLP columns either way (a GGUF file is not split). Reads only the config."""
    check_not_split(model, name, size)
    if isinstance(model, str):
        config = AutoConfig.from_pretrained(model)
    elif isinstance(model, PreTrainedModel):
        config = model.config
    else:
        raise ValueError(
            f"{name}={size} builds the {role} on every rank: give it as a hub id, a path or a transformers "
            f"PreTrainedModel, not a {type(model).__name__}"
        )
    if not llama.runs_natively(config, model_impl):
        hf_tensor_parallel.check(config, device, size, role, name)
    config = config.get_text_config()
    if size not in allowed_sizes(config):
        counts = [f"{count} {what}" for what, count in _split_counts(config).items()]
        raise ValueError(
            f"{name}={size} must divide the {role}'s {', '.join(counts[:-1])} and {counts[-1]}; "
            f"allowed: {', '.join(map(str, allowed_sizes(config)))}"
        )


def shard_state_dict(state_dict: dict[str, Tensor], config: PretrainedConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s share of a HF-named state dict (see the module docstring): split parameters as
    contiguous copies (the whole ones can then be freed), replicated ones as they are; the
    row-parallel biases on rank 0 only."""
    head_dim = attention_head_dim(config)
    lengths = {
        "self_attn.q_proj": config.num_attention_heads // size * head_dim,
        "self_attn.k_proj": config.num_key_value_heads // size * head_dim,
        "self_attn.v_proj": config.num_key_value_heads // size * head_dim,
        "self_attn.o_proj": config.num_attention_heads // size * head_dim,
        "mlp.gate_proj": config.intermediate_size // size,
        "mlp.up_proj": config.intermediate_size // size,
        "mlp.down_proj": config.intermediate_size // size,
    }
    vocab_shard = -(-config.vocab_size // size)
    shard = {}
    for name, tensor in state_dict.items():
        module, _, kind = name.rpartition(".")
        layer = module.split(".", 3)[-1]  # "model.layers.<i>.self_attn.q_proj" -> "self_attn.q_proj"
        if name in _VOCABULARY:
            rows = tensor[rank * vocab_shard : (rank + 1) * vocab_shard]
            shard[name] = tensor.new_zeros(vocab_shard, *tensor.shape[1:])
            shard[name][: rows.shape[0]] = rows
        elif layer in _COLUMN_PARALLEL:
            shard[name] = tensor.narrow(0, rank * lengths[layer], lengths[layer]).clone()
        elif layer in _ROW_PARALLEL and kind == "weight":
            shard[name] = tensor.narrow(1, rank * lengths[layer], lengths[layer]).clone()
        elif not (layer in _ROW_PARALLEL and rank):  # a row-parallel bias: rank 0 adds it
            shard[name] = tensor
    return shard


def _rank_config(config: PretrainedConfig, size: int) -> PretrainedConfig:
    """The config of one rank's layers: 1/size of the heads, key/value heads and MLP columns."""
    local = copy.deepcopy(config)
    local.head_dim = attention_head_dim(config)
    local.num_attention_heads //= size
    local.num_key_value_heads //= size
    local.intermediate_size //= size
    return local


class TensorParallelCausalLM(llama.NativeCausalLM):
    """NativeCausalLM on one rank of a tensor-parallel group (module docstring): the same forward and
    LanguageModel protocol (vocab_size is the whole vocabulary; logits are whole on every rank), with
    this rank's share of the parameters and of the KV heads. Every rank must make the same calls, in
    the same order: each forward meets the others in its collectives. Its state_dict is the rank's
    share. Build it with `from_hf`."""

    def __init__(self, config: PretrainedConfig, group: RankGroup) -> None:
        self.group = group  # before NativeCausalLM.__init__, whose pack_weights reads it
        super().__init__(_rank_config(config, group.size))
        shard = -(-config.vocab_size // group.size)
        self.vocab_start = group.rank * shard
        self.model.embed_tokens = nn.Embedding(shard, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, shard, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        if group.rank:  # the row-parallel layers' biases are added on rank 0 alone
            for layer in self.model.layers:
                layer.self_attn.o_proj.register_parameter("bias", None)
                layer.mlp.down_proj.register_parameter("bias", None)
        self.pack_weights()

    @classmethod
    def from_hf(cls, hf_model: nn.Module, group: RankGroup) -> TensorParallelCausalLM:
        """This rank's shard of a HF `*ForCausalLM` (check_model's conditions hold), on its device and
        dtype: split parameters are copies, replicated ones shared."""
        with torch.device("meta"):
            model = cls(hf_model.config, group)
        shard = shard_state_dict(hf_model.state_dict(), hf_model.config, group.rank, group.size)
        return model._take_weights(hf_model, shard)

    def _row_linear(self, linear: nn.Linear) -> PackedLinear:
        return RowParallelLinear(linear, self.group)

    def _head_linear(self) -> PackedLinear:
        return VocabParallelHead(self.lm_head, self.group, self.vocab_size)

    def embed(self, token_ids: Tensor) -> Tensor:  # [rows] -> [rows, hidden]
        weight = self.model.embed_tokens.weight  # [V', hidden]: rows vocab_start ..
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[:, None], 0)
        dist.all_reduce(hidden)
        return hidden


class RowParallelLinear(PackedLinear):
    """o_proj or down_proj on one rank: x [rows, in / N] (this rank's heads or MLP columns) -> the sum
    over the ranks of x_r @ W_r.T, plus the bias and `residual` ([rows, out]), which rank 0 alone
    adds before the all-reduce: [rows, out], the same on every rank."""

    def __init__(self, linear: nn.Linear, group: RankGroup) -> None:
        self.group = group
        super().__init__([linear])

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        y = super().__call__(x, residual if self.group.rank == 0 else None)
        dist.all_reduce(y)
        return y


class VocabParallelHead(PackedLinear):
    """The lm_head on one rank: x [rows, hidden] -> logits [rows, vocab_size] of the whole vocabulary,
    this rank's shard computed here and the others' all-gathered."""

    def __init__(self, lm_head: nn.Linear, group: RankGroup, vocab_size: int) -> None:
        self.group, self.vocab_size = group, vocab_size
        super().__init__([lm_head])

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        local = super().__call__(x)  # [rows, V']
        rows, shard = local.shape
        gathered = local.new_empty(self.group.size * rows, shard)  # the ranks' shards, one after the other
        dist.all_gather_single(gathered, local.contiguous())
        whole = gathered.view(self.group.size, rows, shard).transpose(0, 1).reshape(rows, -1)
        return whole[:, : self.vocab_size]
