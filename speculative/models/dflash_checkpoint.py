"""DFlash drafters (models/dflash.py) as checkpoint directories, in two layouts; load_dflash reads both.

z-lab's layout (save_dflash; z-lab's Qwen3 releases name their config and weights alike):
  config.json: the draft layers' Llama or Qwen3 config, `architectures` [DFlashDraftModel] and
      `dflash_config`: target_layer_ids (DFlash's numbering: layer j's output), block_size and
      mask_token_id (null: a learned mask embedding).
  model.safetensors: `layers.*`, `fc`, `hidden_norm`, `norm`; `mask_embedding` where the mask is learned
      (with a mask_token_id too: the token it stands for); `lm_head` and `d2t` where the drafter has an
      lm_head of its own. The target's embedding and lm_head are not saved.

vLLM's speculators layout (save_speculators_dflash; the speculators library's DFlashDraftModel, which
vLLM serves with `--speculative-config '{"model": PATH}'`), config fields in models/speculators.py:
  model.safetensors: `layers.*`, `fc`, `hidden_norm`, `norm`; `lm_head` [draft vocab, H] (in the
      library, the verifier's rows, frozen; absent: the target's whole lm_head, as vLLM shares it);
      `d2t` [draft vocab] (target token = i + d2t[i]) and `t2d` [vocab] (bool) with a draft vocabulary;
      `embed_tokens` (the library's copy of the verifier's embedding) and the training-only
      `verifier_lm_head` / `verifier_norm` are read past. A leading "model." is accepted.
  mask_embedding.pt (optional; vLLM reads it): {"mask_token_id": id, "embedding": [H]} or the bare
      tensor: a learned vector marks the masked positions in place of the mask token's embedding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig

from speculative.models import speculators
from speculative.models.dflash import FAMILIES, DFlashDrafter
from speculative.models.llama import NativeCausalLM

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name for a learned mask vector beside the weights


def save_dflash(drafter: DFlashDrafter, path: str | Path) -> None:
    """Write `drafter` to directory `path` in z-lab's layout (module docstring), its weights as held."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    config["block_size"] = drafter.block_size
    config["dflash_config"] = {
        "target_layer_ids": list(drafter.target_layer_ids),
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {name: t.detach().contiguous().clone() for name, t in drafter.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"))


def save_speculators_dflash(
    drafter: DFlashDrafter,
    path: str | Path,
    verifier_name: str | None,
    *,
    verifier_architectures: Sequence[str] = (),
    num_speculative_tokens: int | None = None,
    mask_token_id: int | None = None,
    num_target_layers: int | None = None,
) -> None:
    """Write `drafter` to directory `path` in vLLM's speculators layout (module docstring), for the
    verifier `verifier_name` (its `verifier_architectures`), proposing `num_speculative_tokens` drafts
    (default block_size - 1). A learned mask is written to mask_embedding.pt as the token
    `mask_token_id` (default the drafter's own; one is needed: pick a token that never ends a context,
    since vLLM embeds every occurrence of it with the mask vector). `num_target_layers`, the target's
    layer count where known, refuses a drafter reading the last layer's output (vLLM captures only
    the streams entering layers 0 .. L - 1). ValueError: a Llama-layer drafter (vLLM's DFlash layers
    are Qwen3's, with q/k norms), a learned mask without a token, or such a layer."""
    if drafter.config.model_type != "qwen3":
        raise ValueError(
            f"vLLM serves DFlash drafters of qwen3 layers (with q/k norms); this one's are "
            f"{drafter.config.model_type!r}"
        )
    learned = hasattr(drafter, "mask_embedding")
    token = mask_token_id if mask_token_id is not None else drafter.mask_token_id
    if token is None or (not learned and token != drafter.mask_token_id):
        raise ValueError(
            "mask_token_id: the speculators layout names the mask token; give the token id a learned "
            f"mask embedding stands for (drafter's: {drafter.mask_token_id!r}, given: {mask_token_id!r})"
        )
    if not 0 <= token < drafter.config.vocab_size:
        raise ValueError(f"mask_token_id must be a token id in [0, {drafter.config.vocab_size}); got {token}")
    if num_target_layers is not None and max(drafter.hidden_layers) >= num_target_layers:
        raise ValueError(
            f"the drafter reads target layers {list(drafter.target_layer_ids)} (DFlash's numbering); "
            f"vLLM reads only the streams entering layers 0 .. {num_target_layers - 1}, not the last "
            "layer's output"
        )
    tokens = drafter.block_size - 1 if num_speculative_tokens is None else num_speculative_tokens
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = speculators.write_dflash_config(drafter, verifier_name, verifier_architectures, tokens, token)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {
        name: t.detach().contiguous().cpu().clone()
        for name, t in drafter.state_dict().items()
        if name not in ("mask_embedding", "d2t")
    }
    if drafter.lm_head is not None and drafter.lm_head.out_features < drafter.config.vocab_size:
        vocabulary = drafter.d2t.cpu() + torch.arange(drafter.d2t.numel())
        weights["d2t"], weights["t2d"] = speculators.vocabulary_maps(vocabulary, drafter.config.vocab_size)
    save_file(weights, str(path / "model.safetensors"))
    if learned:
        embedding = drafter.mask_embedding.detach().float().cpu().clone()
        torch.save({"mask_token_id": token, "embedding": embedding}, path / MASK_EMBEDDING_FILE)


def load_dflash(path: str | Path, target: NativeCausalLM) -> DFlashDrafter:
    """The drafter saved in directory `path`, in either layout (module docstring), on the target's device
    and dtype, sharing its embedding (and lm_head unless it has its own). A missing or wrong config
    field or weight is a ValueError naming it (and `path`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"a DFlash drafter's directory holds config.json; {path} has none")
    fields = json.loads((path / "config.json").read_text())
    weights_file = path / "model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{path}: model.safetensors is missing")
    weights = {name.removeprefix("model."): t for name, t in load_file(str(weights_file)).items()}
    if speculators.is_speculators(fields):
        return _load_speculators(fields, weights, path, target)
    extra = fields.get("dflash_config")
    if not isinstance(extra, dict) or "target_layer_ids" not in extra:
        raise ValueError(f"{path}/config.json: dflash_config.target_layer_ids is missing")
    family = fields.pop("model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"{path}/config.json: model_type must be one of {FAMILIES}; got {family!r}")
    config = AutoConfig.for_model(family, **fields)
    t = target.config
    for name in ("hidden_size", "vocab_size"):
        if getattr(config, name) != getattr(t, name):
            raise ValueError(
                f"{path}/config.json: {name} {getattr(config, name)} is not the target's {getattr(t, name)}"
            )
    ids = extra["target_layer_ids"]
    if not isinstance(ids, list) or any(
        not isinstance(j, int) or not 0 <= j < t.num_hidden_layers for j in ids
    ):
        raise ValueError(
            f"{path}/config.json: dflash_config.target_layer_ids {ids!r} must be layer ids of the target "
            f"(in [0, {t.num_hidden_layers}))"
        )
    mask = extra.get("mask_token_id")
    if mask is not None and not (isinstance(mask, int) and 0 <= mask < t.vocab_size):
        raise ValueError(
            f"{path}/config.json: dflash_config.mask_token_id {mask!r} is not a token of the target"
        )
    own_head = weights.get("lm_head.weight")
    drafter_fields = {
        "config": config,
        "target_layer_ids": tuple(ids),
        "block_size": extra.get("block_size", fields.get("block_size")),
        "mask_token_id": mask,
        "learned_mask": "mask_embedding" in weights,
        "draft_vocab_size": None if own_head is None else own_head.shape[0],
    }
    return _build(drafter_fields, weights, weights_file, target)


def _load_speculators(
    fields: dict, weights: dict[str, Tensor], path: Path, target: NativeCausalLM
) -> DFlashDrafter:
    """A speculators-layout drafter (module docstring): its config mapped by models/speculators.py, the
    library's copies of the verifier's weights read past, its lm_head kept only where it is not the
    target's whole one."""
    where = path / "config.json"
    found = speculators.read_dflash_config(fields, target, where)
    vocab, draft_vocab = found["config"].vocab_size, found.pop("draft_vocab_size")
    for name in (*speculators.TRAINING_WEIGHTS, "embed_tokens.weight"):
        weights.pop(name, None)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    speculators.check_vocabulary_maps(d2t, t2d, vocab, path)
    head = weights.get("lm_head.weight")
    if draft_vocab < vocab and (head is None or d2t is None or d2t.numel() != draft_vocab):
        raise ValueError(
            f"{path}: a draft vocabulary of {draft_vocab} tokens needs weights 'lm_head.weight' and 'd2t' "
            f"of {draft_vocab} rows"
        )
    if draft_vocab == vocab and d2t is not None and d2t.any():
        raise ValueError(f"{path}: weight 'd2t' reorders a draft vocabulary that is the whole vocabulary")
    if head is not None and draft_vocab == vocab and _is_targets_lm_head(head, target):
        del weights["lm_head.weight"]  # the target's own: shared, not copied
    elif head is not None:
        found["draft_vocab_size"] = draft_vocab
        weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.long) if d2t is None else d2t.long()
    mask_file = path / MASK_EMBEDDING_FILE
    if mask_file.is_file():
        state = torch.load(mask_file, map_location="cpu", weights_only=True)
        if isinstance(state, dict):
            if state.get("mask_token_id", found["mask_token_id"]) != found["mask_token_id"]:
                raise ValueError(
                    f"{mask_file}: mask_token_id {state.get('mask_token_id')!r} is not the config's "
                    f"{found['mask_token_id']}"
                )
            state = state.get("embedding")
        if not isinstance(state, Tensor) or state.numel() != found["config"].hidden_size:
            raise ValueError(
                f"{mask_file}: the mask embedding must be a tensor of {found['config'].hidden_size}"
            )
        weights["mask_embedding"] = state.reshape(-1)
    found["learned_mask"] = "mask_embedding" in weights
    return _build(found, weights, path / "model.safetensors", target)


def _is_targets_lm_head(head: Tensor, target: NativeCausalLM) -> bool:
    ours = target.lm_head.weight
    return head.shape == ours.shape and torch.equal(head.to(ours.dtype), ours.detach().cpu())


def _build(
    fields: dict, weights: dict[str, Tensor], weights_file: Path, target: NativeCausalLM
) -> DFlashDrafter:
    """The DFlashDrafter of `fields` (its constructor's arguments) with `weights` (checked by name and
    shape), on the target's device and dtype, sharing its embedding and lm_head."""
    with torch.device("meta"):
        drafter = DFlashDrafter(**fields)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights_file}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in weights.items():
        shape = tuple(expected[name].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{weights_file}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    state = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter = drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    drafter.share_native(target)
    return drafter
