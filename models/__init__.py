"""GPT-2 and Qwen2 with Megatron tensor (and sequence) parallelism over taco_jax.

Parameters are plain nested dicts of arrays (usable with optax and orbax), laid out with
logical axis names that map to the (data, pipe, tensor) mesh in one place
(`models.params.LOGICAL_RULES`); layers are stacked for `lax.scan`.
"""

from .api import logits, loss_and_grads, shard_loss_and_grads
from .config import PRESETS, GPT2Config, ModelConfig, Qwen2Config, check_tensor_parallel, check_token_ids, preset
from .generate import generate, prompt_logits
from .hf import load_hf
from .params import LOGICAL_RULES, abstract_params, init_params, layout, partition_specs, shard_params
from .transformer import Parallelism

__all__ = [
    "LOGICAL_RULES",
    "PRESETS",
    "GPT2Config",
    "ModelConfig",
    "Parallelism",
    "Qwen2Config",
    "abstract_params",
    "generate",
    "check_tensor_parallel",
    "check_token_ids",
    "init_params",
    "layout",
    "load_hf",
    "logits",
    "loss_and_grads",
    "partition_specs",
    "prompt_logits",
    "preset",
    "shard_loss_and_grads",
    "shard_params",
]
