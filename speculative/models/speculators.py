"""EAGLE heads and DFlash drafters in vLLM's `speculators` checkpoint format: the config and
weight-name mapping.

The speculators library (github.com/vllm-project/speculators) trains heads and saves them as a
directory vLLM serves from (its SpeculatorsConfig adapter, vllm/transformers_utils/configs/
speculators/): config.json and model.safetensors. What this module reads and writes:

  config.json:
      speculators_model_type: "eagle3" (or "eagle", the library's EAGLE-1/HASS head, which it has
          since dropped and vLLM's adapter does not serve), or "dflash" (below); other types,
          "peagle", "mtp", ..., are other drafters and are refused.
      architectures: ["Eagle3Speculator"] / ["EagleSpeculator"] (the library's class; not read).
      transformer_layer_config: the draft layers' transformers config (model_type "llama";
          hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
          num_hidden_layers (1 here), vocab_size (the verifier's), rms_norm_eps, hidden_act,
          rope_theta / rope_scaling or rope_parameters, attention_bias, mlp_bias). The library
          wrote it as a diff against the config class's defaults, so a missing field is LlamaConfig's
          default.
      speculators_config: {algorithm, proposal_methods: [{proposal_type: "greedy",
          speculative_tokens: k, verifier_accept_k}], default_proposal_method,
          verifier: {name_or_path, architectures}} (vLLM requires proposal_methods[0].
          speculative_tokens and verifier.name_or_path).
      "eagle3": draft_vocab_size, target_hidden_size (default: the layer's hidden_size),
          norm_before_residual (vLLM's default when absent: true), eagle_aux_hidden_state_layer_ids
          (the verifier layers whose entering residual streams are read; vLLM's default
          (2, L // 2, L - 3)), norm_output (EAGLE 3.1: the head's normed state is fed back and read
          by lm_head), norm_before_fc / fc_norm (norms of the verifier features before fc, with
          weights of their own: not supported here).
      "eagle": fusion_bias (fusion_fc has a bias), layernorms (HASS's extra norms: not supported),
          transformer_layer_architecture.
  weights, no "model." prefix:
      "eagle3": fc.weight [H, 3 * target H], layers.0.{self_attn.{q,k,v}_proj [.., 2H],
          self_attn.o_proj, mlp.{gate,up,down}_proj, input_layernorm, hidden_norm,
          post_attention_layernorm}.weight, norm.weight, lm_head.weight [draft vocab, H],
          d2t [draft vocab] int64 (target token = i + d2t[i]) and t2d [vocab] bool (which target
          tokens the draft vocabulary holds), both only with a draft vocabulary smaller than the
          verifier's; embed_tokens.weight optional (the library saves a copy of the verifier's).
          (vLLM: "model." + name except lm_head, d2t as draft_id_to_target_id, t2d skipped.)
      "eagle": fusion_fc.weight [H, 2H] (+ fusion_fc.bias), transformer.{self_attn.*, mlp.*,
          post_attention_layernorm}.weight (no input_layernorm: an identity without layernorms);
          the verifier's embedding and lm_head are not saved. d2t / t2d with a draft_vocab_size:
          this engine's extension (FR-Spec, models/eagle.py), as EAGLE-3's.

models/eagle_checkpoint.py loads (load_eagle_head) and saves (save_speculators) through this.

"dflash" (the library's DFlashDraftModel; models/dflash_checkpoint.py reads and writes its weights):
      transformer_layer_config: the draft layers' config (model_type "qwen3" where absent, the
          library's default; num_hidden_layers of them), draft_vocab_size, block_size (default 8),
          target_hidden_size, aux_hidden_state_layer_ids (the streams entering those target layers,
          Hugging Face's hidden_states[i]: DFlash's own layer id + 1), mask_token_id (required),
          sample_from_anchor (true: the block's first position drafts too, DSpark's variant: refused).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import LlamaConfig

from speculative.models.eagle import EagleLayout

TYPES: tuple[EagleLayout, ...] = ("eagle", "eagle3")
_NAMES = {"eagle": "an EAGLE-1 head", "eagle3": "an EAGLE-3 head", "dflash": "a DFlash block drafter"}
ARCHITECTURES = {"eagle": "EagleSpeculator", "eagle3": "Eagle3Speculator"}
# speculators weight-name prefix -> the EagleHead parameter prefix (embed_tokens, norm: see eagle_checkpoint)
WEIGHT_PREFIXES: dict[str, dict[str, str]] = {
    "eagle": {"fusion_fc.": "fc.", "transformer.": "model.layers.0."},
    "eagle3": {"layers.0.": "model.layers.0."},
}
# saved by some versions of the library for training only: read past
TRAINING_WEIGHTS = frozenset({"verifier_lm_head.weight", "verifier_norm.weight"})
# the transformer_layer_config fields the head is built from (eagle_checkpoint's flat config)
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
)
_UNSUPPORTED_EAGLE3 = {
    "norm_before_fc": "an RMSNorm over the concatenated verifier features before fc",
    "fc_norm": "an RMSNorm per verifier feature before fc",
}


def is_speculators(raw: dict) -> bool:
    """Whether a config.json (as a dict) is in the speculators format."""
    return "speculators_model_type" in raw


def verifier(raw: dict) -> tuple[str | None, list[str]]:
    """The verifier the head was made for: its name_or_path and architectures."""
    found = (raw.get("speculators_config") or {}).get("verifier") or {}
    return found.get("name_or_path"), list(found.get("architectures") or [])


def read_config(raw: dict, layout: EagleLayout, target: Any, where: Path) -> dict:
    """The speculators config.json `raw` as the flat config of the published EAGLE layouts
    (models/eagle_checkpoint.py reads it: the layer's llama fields, draft_vocab_size,
    target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual, fusion_bias).
    Checks the method against `layout` and the verifier's sizes against `target`'s (a ValueError
    naming the difference); warns when the verifier's architecture is not the target's."""
    _check_type(raw, layout, where)
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: the speculators config has no transformer_layer_config (a dict)")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"{where}: transformer_layer_config.model_type {model_type!r}: only llama draft layers load "
            "here (a qwen3 layer's q/k norms are not supported)"
        )
    dropped = ("model_type", "architectures", "transformers_version")
    settings = {key: value for key, value in layer.items() if key not in dropped}
    with warnings.catch_warnings():  # e.g. a rope scaling's original length against the default max length
        warnings.simplefilter("ignore")
        config = LlamaConfig(**settings)
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"{where}: transformer_layer_config.num_hidden_layers is {config.num_hidden_layers}: only "
            "heads of one decoder layer load here"
        )
    if "sliding_attention" in (layer.get("layer_types") or []) and layer.get("sliding_window"):
        warnings.warn(
            f"{where}: the draft layer was trained with sliding-window attention of "
            f"{layer['sliding_window']} tokens; this head attends to the whole context, so past that "
            "its drafts may differ from the trained head's (the output stays exact)",
            stacklevel=3,
        )
    flat: dict[str, Any] = {name: getattr(config, name) for name in _LAYER_FIELDS}
    flat["rope_parameters"] = dict(config.rope_parameters)
    if layout == "eagle3":
        for name, what in _UNSUPPORTED_EAGLE3.items():
            if raw.get(name):
                raise ValueError(f"{where}: {name} ({what}) is not supported")
        flat["draft_vocab_size"] = raw.get("draft_vocab_size")
        flat["target_hidden_size"] = raw.get("target_hidden_size") or config.hidden_size
        flat["eagle_aux_hidden_state_layer_ids"] = raw.get("eagle_aux_hidden_state_layer_ids")
        flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))  # vLLM's default
        flat["norm_output"] = bool(raw.get("norm_output", False))
    else:
        if raw.get("layernorms"):
            raise ValueError(
                f"{where}: layernorms (HASS's norms of the embedding, the fused input and before the "
                "lm_head) are not supported: only EAGLE-1 heads without them load"
            )
        flat["fusion_bias"] = bool(raw.get("fusion_bias", False))
        flat["draft_vocab_size"] = raw.get("draft_vocab_size")
    hidden = flat["target_hidden_size"] if layout == "eagle3" else flat["hidden_size"]
    which = "target_hidden_size" if layout == "eagle3" else "hidden_size"
    _check_verifier(raw, hidden, which, flat["vocab_size"], target, where)
    return flat


def read_dflash_config(raw: dict, target: Any, where: Path) -> dict:
    """The speculators config.json `raw` of a "dflash" drafter (module docstring) as the fields a
    DFlashDrafter is built from: config (the layers' PretrainedConfig), target_layer_ids (DFlash's
    numbering), block_size, mask_token_id, draft_vocab_size. A ValueError names a field that is
    missing, wrong or not supported, or a verifier whose sizes are not `target`'s."""
    from transformers import AutoConfig

    _check_type(raw, "dflash", where)
    if raw.get("sample_from_anchor"):
        raise ValueError(
            f"{where}: sample_from_anchor true (the block's first position drafts too, DSpark's "
            "variant) is not supported: the block's first token is the context's last"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: the speculators config has no transformer_layer_config (a dict)")
    family = layer.get("model_type", "qwen3")
    if family not in ("llama", "qwen3"):
        raise ValueError(
            f"{where}: transformer_layer_config.model_type {family!r}: only llama and qwen3 draft layers load"
        )
    dropped = ("model_type", "architectures", "transformers_version")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(family, **{k: v for k, v in layer.items() if k not in dropped})
    hidden = raw.get("target_hidden_size") or config.hidden_size
    _check_verifier(raw, hidden, "target_hidden_size", config.vocab_size, target, where)
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"{where}: transformer_layer_config.hidden_size {config.hidden_size} is not the target's "
            f"{target.config.hidden_size} (the drafter embeds with the target's embedding)"
        )
    layers = target.config.num_hidden_layers
    ids = raw.get("aux_hidden_state_layer_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or any(not isinstance(i, int) or not 1 <= i <= layers for i in ids)
    ):
        raise ValueError(
            f"{where}: aux_hidden_state_layer_ids {ids!r} must be a list of target layers in [1, {layers}] "
            "(the streams entering them; 0, the embedding, is not read)"
        )
    mask = raw.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < config.vocab_size:
        raise ValueError(f"{where}: mask_token_id {mask!r} must be a token id in [0, {config.vocab_size})")
    block = raw.get("block_size", 8)
    draft_vocab = raw.get("draft_vocab_size") or config.vocab_size
    if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= config.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab!r} must be in [1, {config.vocab_size}]")
    return {
        "config": config,
        "target_layer_ids": tuple(i - 1 for i in ids),
        "block_size": block,
        "mask_token_id": mask,
        "draft_vocab_size": draft_vocab,
    }


def write_dflash_config(
    drafter: Any,
    verifier_name: str | None,
    verifier_architectures: Sequence[str],
    num_speculative_tokens: int,
    mask_token_id: int,
) -> dict:
    """The speculators config.json (a dict) of DFlashDrafter `drafter` for the verifier
    `verifier_name` (module docstring), with the mask token `mask_token_id`."""
    layer = drafter.config.to_dict()
    for name in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        layer.pop(name, None)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.config.vocab_size
        if drafter.lm_head is None
        else drafter.lm_head.out_features,
        "block_size": drafter.block_size,
        "target_hidden_size": drafter.config.hidden_size,
        "aux_hidden_state_layer_ids": list(drafter.hidden_layers),
        "mask_token_id": mask_token_id,
        "sample_from_anchor": False,
        "speculators_config": _speculators_config(
            "dflash", num_speculative_tokens, verifier_name, verifier_architectures
        ),
    }


def _check_type(raw: dict, method: str, where: Path) -> None:
    """The checkpoint's speculators_model_type must be `method`'s; else a ValueError naming the method
    that loads it, if any."""
    kind = raw["speculators_model_type"]
    if kind not in _NAMES:
        raise ValueError(
            f"{where}: speculators_model_type {kind!r} is not supported; this engine loads the "
            'speculators types "eagle", "eagle3" and "dflash" (each with the method of that name)'
        )
    if kind != method:
        raise ValueError(
            f'{where}: speculators_model_type {kind!r} is {_NAMES[kind]}: use method="{kind}", '
            f'not method="{method}"'
        )


def _check_verifier(raw: dict, hidden: int, which: str, vocab_size: int, target: Any, where: Path) -> None:
    """The drafter's verifier sizes (`hidden` read from field `which`, `vocab_size`) must be `target`'s;
    a warning where the verifier's architectures are not the target's."""
    name, architectures = verifier(raw)
    made_for = f"the head was made for verifier {name!r}" if name else "the head's verifier"
    if hidden != target.config.hidden_size:
        raise ValueError(
            f"{where}: {made_for}, of hidden size {hidden} ({which}); the target's is "
            f"{target.config.hidden_size}: load it with that verifier"
        )
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"{where}: {made_for}, of vocabulary {vocab_size} (transformer_layer_config."
            f"vocab_size); the target's is {target.vocab_size}: load it with that verifier"
        )
    ours = set(getattr(target.config, "architectures", None) or [])
    if architectures and ours and not ours & set(architectures):
        warnings.warn(
            f"{where}: {made_for} ({', '.join(architectures)}); the target is {', '.join(sorted(ours))}: "
            "its sizes match, its drafts may still be poor",
            stacklevel=3,
        )


def write_config(
    head: Any,
    verifier_name: str | None,
    verifier_architectures: Sequence[str] = (),
    num_speculative_tokens: int = 3,
) -> dict:
    """The speculators config.json (a dict) of EagleHead `head` for the verifier `verifier_name`:
    the fields vLLM's adapter reads and the speculators library validates (module docstring)."""
    c = head.config
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **{name: getattr(c, name) for name in _LAYER_FIELDS},
        "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_parameters["rope_theta"],
        "tie_word_embeddings": False,
    }
    if c.rope_parameters.get("rope_type", "default") != "default":
        layer["rope_scaling"] = dict(c.rope_parameters)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[head.layout]],
        "speculators_model_type": head.layout,
        "transformer_layer_config": layer,
        "speculators_config": _speculators_config(
            head.layout, num_speculative_tokens, verifier_name, verifier_architectures
        ),
    }
    draft_vocab = head.lm_head.out_features  # the target's vocab_size without a draft vocabulary
    if head.layout == "eagle3":
        config.update(
            draft_vocab_size=draft_vocab,
            target_hidden_size=head.fc.in_features // 3,
            norm_before_residual=bool(head.norm_before_residual),
            norm_before_fc=False,
            fc_norm=False,
            norm_output=bool(head.norm_output),
            eagle_aux_hidden_state_layer_ids=list(head.target_layers),
        )
    else:
        config.update(
            layernorms=False,
            fusion_bias=head.fc.bias is not None,
            transformer_layer_architecture="LlamaDecoderLayer",
        )
        if draft_vocab != c.vocab_size:
            config["draft_vocab_size"] = draft_vocab
    return config


def _speculators_config(
    algorithm: str, tokens: int, verifier_name: str | None, verifier_architectures: Sequence[str]
) -> dict:
    """The config's speculators_config: a greedy proposal of `tokens` drafts, and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
    }


def vocabulary_maps(tokens: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """d2t and t2d of a draft vocabulary of the target tokens `tokens` (sorted, distinct), as the
    speculators library stores them: d2t[i] = tokens[i] - i (int64), t2d[t] = t in tokens (bool)."""
    tokens = tokens.long().cpu()
    d2t = tokens - torch.arange(tokens.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, tokens, True)
    return d2t, t2d


def check_vocabulary_maps(d2t: Tensor | None, t2d: Tensor | None, vocab_size: int, where: Path) -> None:
    """A t2d must mark exactly the target tokens d2t maps the draft vocabulary to."""
    if t2d is None:
        return
    if d2t is None:
        raise ValueError(f"{where}: weight 't2d' without 'd2t'")
    tokens = torch.arange(d2t.numel()) + d2t.long()
    marked = t2d.bool()
    if int(marked.sum()) != d2t.numel() or not bool(marked[tokens.clamp(0, vocab_size - 1)].all()):
        raise ValueError(f"{where}: weight 't2d' does not mark the target tokens 'd2t' maps to")
