"""Parameter shapes with logical axis names, and the one place that maps them to the mesh.

Global shapes do not depend on the tensor-parallel degree (attention heads are an axis of
their own), so the same parameters and checkpoints serve every mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.mesh import PIPE_AXIS, TENSOR_AXIS

from .config import ModelConfig, head_dim, padded_vocab

# Logical axis -> mesh axis. Everything not named here is replicated. Stacked layers are
# split over "pipe" (pipeline stages); with pipe = 1 that is no split.
LOGICAL_RULES = {
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "ff": TENSOR_AXIS,
    "layers": PIPE_AXIS,
}


def _gpt2_layout(config) -> dict:
    d, f, h, hd, L = config.d_model, config.d_ff, config.n_heads, head_dim(config), config.n_layers
    return {
        "embed": {
            "tokens": ((padded_vocab(config), d), ("vocab", "embed")),
            "positions": ((config.max_positions, d), (None, "embed")),
        },
        "layers": {
            "norm1_scale": ((L, d), ("layers", "embed")),
            "norm1_bias": ((L, d), ("layers", "embed")),
            "qkv_kernel": ((L, d, 3, h, hd), ("layers", "embed", None, "heads", None)),
            "qkv_bias": ((L, 3, h, hd), ("layers", None, "heads", None)),
            "out_kernel": ((L, h, hd, d), ("layers", "heads", None, "embed")),
            "out_bias": ((L, d), ("layers", "embed")),
            "norm2_scale": ((L, d), ("layers", "embed")),
            "norm2_bias": ((L, d), ("layers", "embed")),
            "fc_kernel": ((L, d, f), ("layers", "embed", "ff")),
            "fc_bias": ((L, f), ("layers", "ff")),
            "proj_kernel": ((L, f, d), ("layers", "ff", "embed")),
            "proj_bias": ((L, d), ("layers", "embed")),
        },
        "final": {"norm_scale": ((d,), ("embed",)), "norm_bias": ((d,), ("embed",))},
    }


def _qwen2_layout(config) -> dict:
    d, f, h, kv, hd, L = (
        config.d_model,
        config.d_ff,
        config.n_heads,
        config.n_kv_heads,
        head_dim(config),
        config.n_layers,
    )
    layout: dict[str, Any] = {
        "embed": {"tokens": ((padded_vocab(config), d), ("vocab", "embed"))},
        "layers": {
            "norm1_scale": ((L, d), ("layers", "embed")),
            "q_kernel": ((L, d, h, hd), ("layers", "embed", "heads", None)),
            "q_bias": ((L, h, hd), ("layers", "heads", None)),
            "k_kernel": ((L, d, kv, hd), ("layers", "embed", "kv_heads", None)),
            "k_bias": ((L, kv, hd), ("layers", "kv_heads", None)),
            "v_kernel": ((L, d, kv, hd), ("layers", "embed", "kv_heads", None)),
            "v_bias": ((L, kv, hd), ("layers", "kv_heads", None)),
            "out_kernel": ((L, h, hd, d), ("layers", "heads", None, "embed")),
            "norm2_scale": ((L, d), ("layers", "embed")),
            "gate_kernel": ((L, d, f), ("layers", "embed", "ff")),
            "up_kernel": ((L, d, f), ("layers", "embed", "ff")),
            "down_kernel": ((L, f, d), ("layers", "ff", "embed")),
        },
        "final": {"norm_scale": ((d,), ("embed",))},
    }
    if not config.tie_embeddings:
        layout["final"]["head"] = ((padded_vocab(config), d), ("vocab", "embed"))
    return layout


def layout(config: ModelConfig) -> dict:
    """Nested dict of (global shape, logical axes) for every parameter."""
    return _gpt2_layout(config) if config.family == "gpt2" else _qwen2_layout(config)


def is_layout_leaf(node) -> bool:
    """True for a (shape, logical axes) leaf of `layout`."""
    return isinstance(node, tuple) and len(node) == 2 and isinstance(node[1], tuple)


def check_arrays(expected: Mapping, tree: Any, *, what: str, against: str) -> None:
    """Raise ValueError unless `tree` is a nested dict with exactly the keys of `expected`
    (a nested dict of shape tuples) holding, at each of its shapes, a floating-point array
    of that shape: the check every parameter loader runs before it uses anything.

    Args:
      expected: nested dict of shapes (tuples of ints).
      tree: what was given.
      what: how the message names `tree` (e.g. "parameters").
      against: how it names `expected` (e.g. "the gpt2 layout (models.layout)").

    Raises:
      ValueError: one, naming the missing and unexpected paths, or each path whose
        array has another shape (both shapes) or a dtype that is not floating-point.
    """
    if not isinstance(tree, Mapping):
        raise ValueError(f"{what} must be a nested dict of arrays, got {type(tree).__name__}")
    want = _by_path(expected, is_leaf=lambda node: isinstance(node, tuple))
    got = _by_path(tree)
    missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    if missing or unexpected:
        raise ValueError(f"{what} do not match {against}: missing {missing}, unexpected {unexpected}")
    wrong = [problem for path, shape in want.items() if (problem := _array_problem(path, got[path], shape))]
    if wrong:
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        raise ValueError(f"{what} do not match {against}: {'; '.join(wrong[:5])}{more}")


def _by_path(tree: Any, **kwargs: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree, **kwargs)}


def _array_problem(path: str, value: Any, shape: tuple) -> str | None:
    """What is wrong with `value` as a parameter of `shape`, or None."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return f"{path} is a {type(value).__name__}, expected an array of shape {tuple(shape)}"
    if tuple(value.shape) != tuple(shape):
        return f"{path} is {tuple(value.shape)}, expected {tuple(shape)}"
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return f"{path} is {jnp.dtype(value.dtype).name}, expected a floating-point dtype (float32)"
    return None


def check_params(config: ModelConfig, params: Any, *, what: str = "parameters", against: str | None = None) -> None:
    """Raise ValueError unless `params` are `config`'s parameters (`check_arrays` against
    `layout`): the same keys, shapes, and floating-point dtypes.

    Args:
      config: the model configuration.
      params: nested dict of arrays (host, device or `jax.ShapeDtypeStruct`).
      what: how the message names `params`.
      against: how it names the expected layout (default: the family's layout).
    """
    shapes = jax.tree.map(lambda leaf: leaf[0], layout(config), is_leaf=is_layout_leaf)
    check_arrays(shapes, params, what=what, against=against or f"the {config.family} layout (models.layout)")


def _spec(logical_axes: tuple) -> P:
    return P(*(LOGICAL_RULES.get(axis) for axis in logical_axes))


def partition_specs(config: ModelConfig) -> dict:
    """PartitionSpec of every parameter, from its logical axes and `LOGICAL_RULES`."""
    return jax.tree.map(lambda leaf: _spec(leaf[1]), layout(config), is_leaf=is_layout_leaf)


def _initial_value(path: str, key: jax.Array, shape: tuple, config: ModelConfig) -> jax.Array:
    if "scale" in path:
        return jnp.ones(shape, jnp.float32)
    if "bias" in path:
        return jnp.zeros(shape, jnp.float32)
    std = 0.02
    if path.endswith(("out_kernel", "proj_kernel", "down_kernel")):
        std = 0.02 / np.sqrt(2 * config.n_layers)  # GPT-2's scaled init of residual projections
    value = std * jax.random.normal(key, shape, jnp.float32)
    if "tokens" in path or path.endswith("head"):
        value = value.at[config.vocab_size :].set(0.0)  # padded vocabulary rows
    return value


def init_params(config: ModelConfig, key: jax.Array, mesh: Mesh | None = None) -> dict:
    """Random float32 parameters, born sharded on `mesh` (each device computes only its
    shard; the values do not depend on the mesh).

    Args:
      config: the model configuration.
      key: PRNG key.
      mesh: target mesh; None for the default device.

    Returns:
      Nested dict of arrays.
    """
    shapes = layout(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_layout_leaf)

    def build(key):
        keys = jax.random.split(key, len(flat))
        leaves = [
            _initial_value(jax.tree_util.keystr(path), keys[i], leaf[0], config) for i, (path, leaf) in enumerate(flat)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    if mesh is None:
        return jax.jit(build)(key)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(config))
    return jax.jit(build, out_shardings=shardings)(key)


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """Place (host or device) parameters on `mesh` with their partition specs."""
    specs = partition_specs(config)
    return jax.tree.map(lambda value, spec: jax.device_put(value, NamedSharding(mesh, spec)), params, specs)


def abstract_params(config: ModelConfig, mesh: Mesh) -> dict:
    """ShapeDtypeStructs (float32, with shardings on `mesh`) of every parameter, for
    compiling or restoring without materializing anything."""
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf[0], jnp.float32, sharding=NamedSharding(mesh, _spec(leaf[1]))),
        layout(config),
        is_leaf=is_layout_leaf,
    )
