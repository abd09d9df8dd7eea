"""One rank's shard of a model on transformers' forward, split by transformers' own tensor parallelism.

A model that does not run on the native forward (an architecture that models/llama.py does not run,
or model_impl="transformers") is split by transformers itself: `from_pretrained(distributed_config=
DistributedConfig(tp_size=N))` builds it on the meta device, applies its class's plan (the config's
`base_model_tp_plan` for the decoder layers, the `*ForCausalLM` class's `_tp_plan` for the lm_head,
the embedding split by vocabulary) and loads each rank's shard of every split parameter (a DTensor
whose local tensor is that shard). Megatron-LM's split for the plain plans (q/k/v and gate/up
column-parallel, o_proj and down_proj row-parallel, each followed by an all-reduce); some plans
replicate more (Phi-3's fused qkv and gate_up gather their outputs). The collectives run on a device
mesh that transformers builds over torch.distributed's default group, the group the ranks already
joined (speculative/distributed/), so they are gloo's on CPU and NCCL's on CUDA.

The shard then runs behind HFCausalLM like any transformers model, its KV cache holding this rank's
key/value heads. Every rank ends a forward with the same logits, bit for bit: the lm_head's shards
are all-gathered, each all-reduce hands every rank the same sum, and the rest runs replicated on
identical inputs (as models/tensor_parallel.py argues for the native shard).

transformers splits only what it has a plan for, and only on the machine's accelerator (CUDA's GPU
number LOCAL_RANK), or on the CPU where there is none: `check` refuses the rest before any rank starts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig, PretrainedConfig, PreTrainedModel

from speculative.extras import needs_extra
from speculative.models import llama


def has_plan(config: PretrainedConfig) -> bool:
    """Whether transformers has a tensor-parallel plan for the decoder of this config (its text config's
    `base_model_tp_plan`)."""
    return bool(getattr(config.get_text_config(), "base_model_tp_plan", None))


def mesh_device_type() -> str:
    """The device type transformers' tensor parallelism puts shards on: the machine's accelerator, else
    "cpu"."""
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def check(config: PretrainedConfig, device: str | torch.device, size: int, role: str, name: str) -> None:
    """A ValueError naming `name` (the LLM's keyword) and `size` unless transformers can split the
    `role` ("target" or "draft model") of this config over `size` ranks on `device`: it needs a plan for
    the model type and a device of the type it places shards on (CPU or CUDA). A ModuleNotFoundError
    naming the transformers-tp extra without accelerate, which transformers' loading requires."""
    with needs_extra("transformers-tp", f"{name}={size} with the {role} on transformers' forward"):
        import accelerate  # noqa: F401  (transformers' from_pretrained splits a model only with it)
    if not has_plan(config):
        native = ", ".join(sorted(llama.SUPPORTED_MODEL_TYPES))
        raise ValueError(
            f"{name}={size} cannot split the {role}: it is {config.model_type!r}, which runs on "
            "transformers' forward, and transformers has no tensor-parallel plan for it (its config has no "
            f"base_model_tp_plan); tensor parallelism runs on the native forward (model types {native}, "
            "model_impl 'auto' or 'native') and on transformers' own for model types with a plan "
            "(gemma, phi3, olmo, granite, ...)"
        )
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda") or device_type != mesh_device_type():
        raise ValueError(
            f"{name}={size} splits the {role} ({config.model_type!r}) with transformers' tensor "
            f"parallelism, which places each rank's shard on this machine's {mesh_device_type()} (CPU or "
            f"CUDA only); device={device_type!r} is not it"
        )


def from_pretrained(model: str | PreTrainedModel, dtype: torch.dtype, size: int) -> PreTrainedModel:
    """This rank's shard of `model` (a hub id or path, whose checkpoint each rank reads for its own
    shard, or a PreTrainedModel, from its state dict) over the `size` ranks of torch.distributed's
    default group, in `dtype`, in eval mode. Every rank must call it, in the same order as its other
    collectives: the device mesh is built, and the forwards run, in collectives over every rank."""
    distributed = DistributedConfig(tp_size=size)
    if isinstance(model, str):
        shard = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, distributed_config=distributed)
    else:
        shard = type(model).from_pretrained(
            None,
            config=model.config,
            state_dict=model.state_dict(),
            dtype=dtype,
            distributed_config=distributed,
        )
        shard.generation_config = model.generation_config  # its EOS ids, as the whole model's
    _own_storage(shard)
    return shard


def _own_storage(model: nn.Module) -> None:
    """Give each parameter that is a view into a larger tensor (a shard loaded from a state dict in
    memory, or from a .bin checkpoint, is a view of the whole) a copy of its own, so that the rank holds
    its shards' bytes alone once the whole is dropped. Tied parameters stay tied."""
    copies: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in copies:
                copies[id(param)] = _owning(param)
            module._parameters[name] = copies[id(param)]


def _owning(param: nn.Parameter) -> nn.Parameter:
    """`param` if its tensor (a DTensor's: its local shard) fills its storage, else a copy that does (a
    DTensor with the same mesh, placements, global shape and stride)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.untyped_storage().nbytes() <= local.numel() * local.element_size():
        return param
    copy = local.detach().clone()
    if isinstance(param, DTensor):
        copy = DTensor.from_local(
            copy,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return nn.Parameter(copy, requires_grad=param.requires_grad)
