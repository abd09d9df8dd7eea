"""Loading an EAGLE head (models/eagle.py) from a published checkpoint directory.

The directory holds `config.json` and `model.safetensors` or `pytorch_model.bin`, as the EAGLE and
EAGLE-3 releases (SafeAILab/EAGLE, SpecForge) and vLLM read them:

  config.json: a Llama config of the one layer: hidden_size, intermediate_size, num_attention_heads
      and vocab_size (the target's) are required; num_key_value_heads, head_dim, rms_norm_eps,
      hidden_act, rope_theta / rope_scaling (or rope_parameters), attention_bias, mlp_bias are read
      where present.
      Both read draft_vocab_size (default vocab_size); "eagle3" also reads target_hidden_size
      (default hidden_size) and the target layers it reads, eagle_aux_hidden_state_layer_ids (top
      level or in `eagle_config`; default vLLM's (2, L // 2, L - 3) for a target of L layers).
  weights, "eagle": fc.weight [H, 2H] (fc.bias [H] optional), layers.0.{self_attn.{q,k,v,o}_proj,
      mlp.{gate,up,down}_proj, post_attention_layernorm}.weight (layers.0.input_layernorm.weight is
      absent in the releases and unused), embed_tokens.weight optional; with a draft_vocab_size below
      vocab_size, d2t [draft vocab] as EAGLE-3's (an extension of the layout, FR-Spec's cut of the
      target's lm_head: models/eagle.py).
  weights, "eagle3": fc.weight [H, 3 * target H], midlayer.{self_attn.* (q/k/v over 2H),
      mlp.*, input_layernorm, hidden_norm, post_attention_layernorm}.weight, norm.weight,
      lm_head.weight [draft vocab, H], d2t [draft vocab] and t2d [vocab] (bool, not needed to draft)
      optional, embed_tokens.weight optional; lm_head.weight may be left out where it is the target's
      rows at the draft vocabulary (as the project's recipe trains it: save_eagle_head's
      `share_lm_head`), an extension of the layout.
A leading "model." is accepted on any name. Without embed_tokens the head shares the target's
embedding; an "eagle" head always uses the target's lm_head, and an "eagle3" one without an
lm_head.weight (a copy of its d2t rows where it has a draft vocabulary). An "eagle3" config may
say norm_before_residual and norm_output (as vLLM and the speculators library read them,
models/eagle.py; default false).

A directory in vLLM's speculators format (config.json with `speculators_model_type`) loads as well:
models/speculators.py maps its config and weight names onto the head; save_speculators writes one.
Weights may also be sharded (model.safetensors.index.json).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import LlamaConfig

from speculative.models import speculators
from speculative.models.eagle import EagleHead, EagleLayout
from speculative.models.llama import NativeCausalLM

REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_OPTIONAL_FIELDS = (
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
)
# checkpoint prefix -> the head's parameter prefix
_PREFIXES = {"eagle": {"layers.0.": "model.layers.0."}, "eagle3": {"midlayer.": "model.layers.0."}}
# head parameters a checkpoint may leave out (fc.bias exists in a head only where its checkpoint has one
# or its speculators config says fusion_bias)
_OPTIONAL_WEIGHTS = {
    "eagle": {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "d2t"},
    "eagle3": {"d2t", "model.embed_tokens.weight", "lm_head.weight"},
}


def load_eagle_head(path: str | Path, layout: EagleLayout, target: NativeCausalLM) -> EagleHead:
    """The head of the checkpoint directory `path` (module docstring) in `layout`, for `target` (on its
    device and dtype, sharing its embedding unless the checkpoint has one, and its lm_head for
    "eagle"). A ValueError names the field or weight that is missing, unexpected or misshapen."""
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"EAGLE head {str(path)!r}: no config.json in that directory")
    raw = json.loads(config_path.read_text())
    in_speculators = speculators.is_speculators(raw)
    if in_speculators:
        raw = speculators.read_config(raw, layout, target, config_path)
    config, feature_size, target_layers = _head_config(raw, layout, target, config_path)
    weights, prefixes = _weights(directory, layout, in_speculators)
    mapped = {_head_name(name, prefixes) for name in weights}
    fc_bias = layout == "eagle" and (bool(raw.get("fusion_bias")) or "fc.bias" in mapped)
    head = EagleHead(config, layout, feature_size, target_layers, raw.get("draft_vocab_size"), fc_bias)
    head.norm_before_residual = layout == "eagle3" and bool(raw.get("norm_before_residual", False))
    head.norm_output = layout == "eagle3" and bool(raw.get("norm_output", False))
    state = _head_state(weights, layout, head, directory, prefixes, in_speculators)
    if in_speculators:
        speculators.check_vocabulary_maps(weights.get("d2t"), weights.get("t2d"), head.vocab_size, directory)
    if "model.embed_tokens.weight" not in state and config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"{directory}: the head's hidden_size {config.hidden_size} is not the target's "
            f"({target.config.hidden_size}), so it needs an embed_tokens.weight of its own"
        )
    head.load_state_dict(state, strict=False)
    head = head.to(target.device, target.dtype).eval()
    if "model.embed_tokens.weight" not in state:
        head.model.embed_tokens.weight = target.model.embed_tokens.weight
    if layout == "eagle" or "lm_head.weight" not in state:  # the target's, at the draft vocabulary
        vocabulary, shared = head.draft_vocabulary, target.lm_head.weight
        whole = vocabulary is None or torch.equal(vocabulary.cpu(), torch.arange(head.vocab_size))
        head.lm_head.weight = shared if whole else nn.Parameter(shared[vocabulary], False)
    head.pack_weights()
    return head


def load_head_weights(head: EagleHead, path: str | Path) -> None:
    """Load the weights of the checkpoint directory `path` (as save_eagle_head writes them, checked as
    load_eagle_head checks them) into `head`, a head of the same layout and shapes, to train it further;
    the weights it shares with its target are left as they are."""
    directory = Path(path)
    config_path = directory / "config.json"
    in_speculators = config_path.is_file() and speculators.is_speculators(json.loads(config_path.read_text()))
    weights, prefixes = _weights(directory, head.layout, in_speculators)
    state = _head_state(weights, head.layout, head, directory, prefixes, in_speculators)
    head.load_state_dict(state, strict=False)
    head.pack_weights()


def save_eagle_head(head: EagleHead, path: str | Path, share_lm_head: bool = False) -> None:
    """Write `head` as a checkpoint directory in its published layout (module docstring): config.json
    and model.safetensors, without the weights it shares with its target; with `share_lm_head`, an
    "eagle3" head's lm_head is left out too (it must be the target's rows at its draft vocabulary,
    which load_eagle_head then takes: vLLM and the EAGLE-3 releases want it written, save_speculators
    writes it)."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    c = head.config
    config = {
        "architectures": ["LlamaForCausalLM" if head.layout == "eagle" else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{name: getattr(c, name) for name in (*REQUIRED_FIELDS, *_OPTIONAL_FIELDS[:4]) if hasattr(c, name)},
        "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings,
    }
    if head.draft_vocabulary is not None:
        config["draft_vocab_size"] = head.lm_head.out_features
    if head.layout == "eagle3":
        config["eagle_aux_hidden_state_layer_ids"] = list(head.target_layers)
        config.update({name: True for name in ("norm_before_residual", "norm_output") if getattr(head, name)})
    shared = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    if head.layout == "eagle3":
        shared = {"model.embed_tokens.weight", *(["lm_head.weight"] if share_lm_head else [])}
    weights = {
        _checkpoint_name(name, _PREFIXES[head.layout]): tensor.detach().contiguous().cpu()
        for name, tensor in head.state_dict().items()
        if name not in shared
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(directory / "model.safetensors"))


def save_speculators(
    head: EagleHead,
    path: str | Path,
    verifier_name: str | None,
    *,
    verifier_architectures: Sequence[str] = (),
    num_speculative_tokens: int = 3,
    num_target_layers: int | None = None,
    embedding: bool = False,
) -> None:
    """Write `head` as a checkpoint directory in vLLM's speculators format (models/speculators.py):
    config.json (speculators_model_type, transformer_layer_config, speculators_config with the
    verifier `verifier_name` and its `verifier_architectures`, a greedy proposal of
    `num_speculative_tokens`) and model.safetensors under the speculators names. vLLM serves an
    "eagle3" one (`--speculative-config '{"model": PATH}'`); its adapter does not read "eagle" ones
    (the library's former EAGLE-1 layout), which load back here. The weights shared with the target
    are left out (with `embedding`, the head's embed_tokens is written too). `num_target_layers`, the
    target's layer count where known, refuses an "eagle3" head that reads the target's final norm
    output (layer id L: vLLM captures only the streams entering layers 0 .. L - 1)."""
    from safetensors.torch import save_file

    if num_target_layers is not None and head.layout == "eagle3":
        if any(i >= num_target_layers for i in head.target_layers):
            raise ValueError(
                f"the head reads target layers {list(head.target_layers)}; vLLM reads only the streams "
                f"entering layers 0 .. {num_target_layers - 1}, not the final norm's output"
            )
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = speculators.write_config(head, verifier_name, verifier_architectures, num_speculative_tokens)
    skipped = {"model.embed_tokens.weight"} - ({"model.embed_tokens.weight"} if embedding else set())
    if head.layout == "eagle":
        skipped |= {"lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"}
    draft_vocabulary = head.draft_vocabulary if head.lm_head.out_features < head.vocab_size else None
    skipped.add("d2t")
    prefixes = speculators.WEIGHT_PREFIXES[head.layout]
    weights = {
        _checkpoint_name(name, prefixes): tensor.detach().contiguous().cpu()
        for name, tensor in head.state_dict().items()
        if name not in skipped
    }
    if draft_vocabulary is not None:
        weights["d2t"], weights["t2d"] = speculators.vocabulary_maps(draft_vocabulary, head.vocab_size)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(directory / "model.safetensors"))


def saved_draft_vocabulary(path: str | Path) -> Tensor | None:
    """[draft vocab] int64, sorted: the target tokens of the lm_head rows of the head saved in directory
    `path` (i + its d2t[i]); None where it drafts over the whole vocabulary (no d2t)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as weights:
        if "d2t" not in weights.keys():
            return None
        d2t = weights.get_tensor("d2t").long()
    return torch.arange(d2t.numel()) + d2t


def write_draft_vocabulary(path: str | Path, tokens: Tensor) -> None:
    """Give the "eagle" head saved in directory `path` the draft vocabulary `tokens` (target token
    ids, [n] int64, a repeated one counted once): its d2t and draft_vocab_size, written into the
    directory (module docstring), replacing any it had. The head then drafts among these tokens
    only, each draft reading their rows of the target's lm_head (models/eagle.py)."""
    from safetensors.torch import load_file, save_file

    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    tokens = tokens.long().unique()  # sorted
    if "architectures" in config and config["architectures"] != ["LlamaForCausalLM"]:
        raise ValueError(f"{directory}: a draft vocabulary is written into an EAGLE-1 head only")
    if tokens.numel() == 0 or tokens.min() < 0 or tokens.max() >= config["vocab_size"]:
        raise ValueError(f"tokens must be target token ids in [0, {config['vocab_size']}), at least one")
    weights = load_file(directory / "model.safetensors")
    weights["d2t"] = tokens - torch.arange(tokens.numel())
    config["draft_vocab_size"] = tokens.numel()
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _head_config(
    raw: dict, layout: EagleLayout, target: NativeCausalLM, where: Path
) -> tuple[LlamaConfig, int, tuple[int, ...]]:
    """The head's one-layer llama config, the width of the target features it reads and the target's
    layers they come from (NativeCausalLM.forward's `hidden_layers`)."""
    for name in REQUIRED_FIELDS:
        if name not in raw:
            raise ValueError(f"{where}: the EAGLE head's config has no {name!r}")
    target_hidden, layers = target.config.hidden_size, len(target.model.layers)
    if raw["vocab_size"] != target.vocab_size:
        raise ValueError(f"{where}: vocab_size {raw['vocab_size']} is not the target's ({target.vocab_size})")
    fields = {name: raw[name] for name in (*REQUIRED_FIELDS, *_OPTIONAL_FIELDS) if raw.get(name) is not None}
    config = LlamaConfig(
        **fields, num_hidden_layers=1, max_position_embeddings=target.max_length, tie_word_embeddings=False
    )
    if layout == "eagle":
        if raw["hidden_size"] != target_hidden:
            raise ValueError(
                f"{where}: hidden_size {raw['hidden_size']} is not the target's ({target_hidden})"
            )
        return config, target_hidden, (layers,)
    if raw.get("target_hidden_size", raw["hidden_size"]) != target_hidden:
        name = "target_hidden_size" if "target_hidden_size" in raw else "hidden_size"
        raise ValueError(f"{where}: {name} {raw[name]} is not the target's hidden size ({target_hidden})")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ids = tuple(ids) if ids else (2, layers // 2, layers - 3)
    if len(ids) != 3 or any(not 0 <= i <= layers for i in ids):  # layers: the final norm's output
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids {ids} must be 3 layer indices in [0, {layers}] "
            f"({layers}: the final norm's output; the default (2, L // 2, L - 3) needs a target of at "
            "least 3 layers)"
        )
    return config, 3 * target_hidden, ids


def _read_weights(directory: Path) -> dict[str, Tensor]:
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(directory / "model.safetensors")
    if (directory / "model.safetensors.index.json").is_file():  # sharded, as save_pretrained shards
        from safetensors.torch import load_file

        index = json.loads((directory / "model.safetensors.index.json").read_text())
        weights: dict[str, Tensor] = {}
        for shard in sorted(set(index.get("weight_map", {}).values())):
            weights.update(load_file(directory / shard))
        return weights
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"EAGLE head {str(directory)!r}: no model.safetensors or pytorch_model.bin")


def _strip(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name.removeprefix("model."): tensor for name, tensor in weights.items()}


def _weights(
    directory: Path, layout: EagleLayout, in_speculators: bool
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The checkpoint's weights (no "model." prefix, the speculators library's training-only ones
    left out) and its name map (checkpoint prefix -> the head's)."""
    weights = _strip(_read_weights(directory))
    if not in_speculators:
        return weights, _PREFIXES[layout]
    kept = {name: tensor for name, tensor in weights.items() if name not in speculators.TRAINING_WEIGHTS}
    return kept, speculators.WEIGHT_PREFIXES[layout]


def _head_state(
    weights: dict[str, Tensor],
    layout: EagleLayout,
    head: EagleHead,
    where: Path,
    prefixes: dict[str, str],
    in_speculators: bool = False,
) -> dict[str, Tensor]:
    """The checkpoint's weights (names mapped by `prefixes`) under the head's names, each checked
    against the head's shape; t2d (checked, not needed to draft) in "eagle3" and speculators ones."""
    expected = {**head.state_dict()}
    own = {"model.embed_tokens.weight"}  # the target's unless the checkpoint has its own
    if layout == "eagle":
        own |= {"lm_head.weight", "model.norm.weight"}  # the target's lm_head; no final norm
    with_t2d = layout == "eagle3" or in_speculators
    names = {name: _head_name(name, prefixes) for name in weights if not (name == "t2d" and with_t2d)}
    for name, mapped in names.items():  # names first: a head of the other layout fails here
        if mapped not in expected or (mapped in own and name != "embed_tokens.weight"):
            raise ValueError(
                f"{where}: unexpected weight {name!r} for an {layout!r} head (an EAGLE-1 head is "
                f'method="eagle", an EAGLE-3 one method="eagle3")'
            )
    shapes = {name: (weights[name].shape, expected[mapped].shape) for name, mapped in names.items()}
    if "t2d" in weights and with_t2d:
        shapes["t2d"] = (weights["t2d"].shape, torch.Size([head.vocab_size]))
    for name, (theirs, ours) in shapes.items():
        if theirs != ours:
            raise ValueError(f"{where}: weight {name!r} has shape {tuple(theirs)}, expected {tuple(ours)}")
    state = {mapped: weights[name] for name, mapped in names.items()}
    required = set(expected) - own - _OPTIONAL_WEIGHTS[layout]
    missing = sorted(_checkpoint_name(name, prefixes) for name in required - set(state))
    if missing:
        raise ValueError(f"{where}: the {layout!r} head's checkpoint lacks weights {missing}")
    if head.draft_vocabulary is not None:
        _check_d2t(state.get("d2t"), head, where)
    return state


def _check_d2t(d2t: Tensor | None, head: EagleHead, where: Path) -> None:
    """d2t must map the draft vocabulary into the target's, one to one; without it they are the same."""
    draft_vocab = head.lm_head.out_features
    if d2t is None:
        if draft_vocab != head.vocab_size:
            raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} tokens needs the weight 'd2t'")
        return
    targets = torch.arange(draft_vocab) + d2t.long()  # the draft vocabulary's tokens in the target's
    if targets.min() < 0 or targets.max() >= head.vocab_size or targets.unique().numel() != draft_vocab:
        raise ValueError(
            f"{where}: weight 'd2t' does not map the draft vocabulary one to one into the target's"
        )


def _head_name(name: str, prefixes: dict[str, str]) -> str:
    """A checkpoint's weight name (no "model.") as the head's; `prefixes`: checkpoint -> head prefix."""
    if name == "embed_tokens.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    for theirs, ours in prefixes.items():
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


def _checkpoint_name(name: str, prefixes: dict[str, str]) -> str:
    """A head's parameter name as the checkpoint's (no "model.")."""
    if name == "model.norm.weight":
        return "norm.weight"
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight"
    for theirs, ours in prefixes.items():
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name
