"""Load GPT-2 and Qwen2 weights from a local HuggingFace folder (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike
from safetensors import SafetensorError, safe_open

from .config import GPT2Config, ModelConfig, Qwen2Config, head_dim, padded_vocab
from .params import check_params


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of one .safetensors file as numpy arrays in their stored dtype (bf16
    as `ml_dtypes.bfloat16`), read through the memory-mapped `safetensors.safe_open`.

    Raises:
      ValueError: a missing, truncated or malformed file (naming it).
    """
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a safetensors file or truncated ({error})") from None


def _read_folder(folder: Path) -> dict[str, np.ndarray]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(folder / name))
    return tensors


# GPT-2 here is GELU's tanh approximation, as HF's default "gelu_new"; Qwen2 is SiLU.
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
QWEN2_ACTIVATIONS = ("silu",)


def _config_from_hf(hf: object) -> ModelConfig:
    """The model configuration of an HF config.json's contents.

    Raises:
      ValueError: not a mapping, an unsupported architecture or activation, or a key
        missing or of the wrong type (naming it).
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    kind = hf.get("model_type")
    if kind == "gpt2":
        _check_activation(hf, "activation_function", "gelu_new", GPT2_ACTIVATIONS)
        d = _integer(hf, "n_embd")
        return GPT2Config(
            _integer(hf, "vocab_size"),
            _integer(hf, "n_positions"),
            d,
            _integer(hf, "n_layer"),
            _integer(hf, "n_head"),
            _integer(hf, "n_inner", None) or 4 * d,
            _number(hf, "layer_norm_epsilon", 1e-5),
        )
    if kind == "qwen2":
        _check_activation(hf, "hidden_act", "silu", QWEN2_ACTIVATIONS)
        theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return Qwen2Config(
            _integer(hf, "vocab_size"),
            _integer(hf, "max_position_embeddings", 32768),
            _integer(hf, "hidden_size"),
            _integer(hf, "num_hidden_layers"),
            _integer(hf, "num_attention_heads"),
            _integer(hf, "num_key_value_heads"),
            _integer(hf, "intermediate_size"),
            _number(hf, "rms_norm_eps", 1e-6),
            _number({"rope_theta": theta}, "rope_theta"),
            bool(hf.get("tie_word_embeddings", False)),
        )
    raise ValueError(f"unsupported model_type {kind!r} in config.json; expected 'gpt2' or 'qwen2'")


_REQUIRED = object()


def _integer(hf: dict, key: str, default=_REQUIRED):
    """config.json's positive integer `key` (or `default` where it is absent or null)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json has no {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _number(hf: dict, key: str, default: float | None = None) -> float:
    """config.json's positive finite number `key` (or `default` where it is absent)."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _check_activation(hf: dict, key: str, default: str, supported: tuple[str, ...]) -> None:
    if hf.get(key, default) not in supported:
        raise ValueError(f"config.json: {key} {hf.get(key)!r} is not supported; this model computes {supported[0]!r}")


class _Tensors:
    """Name lookup that strips a model prefix and collects missing names."""

    def __init__(self, tensors: dict[str, np.ndarray], prefixes: tuple[str, ...], dtype: DTypeLike | None):
        self.dtype = dtype
        self.tensors = {}
        for name, value in tensors.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            self.tensors[name] = value
        self.missing: list[str] = []

    def get(self, name: str) -> np.ndarray | None:
        if name not in self.tensors:
            self.missing.append(name)
            return None
        value = self.tensors[name]
        return value if self.dtype is None else value.astype(self.dtype)

    def stack(self, pattern: str, layers: int, transform) -> np.ndarray | None:
        found = {name: value for name in map(pattern.format, range(layers)) if (value := self.get(name)) is not None}
        if len(found) < layers:
            return None
        laid_out = [_laid_out(name, value, transform) for name, value in found.items()]
        if len({value.shape for value in laid_out}) > 1:
            shapes = {name: value.shape for name, value in found.items()}
            raise ValueError(f"the layers' tensors {pattern.format('N')} differ in shape: {shapes}")
        return np.stack(laid_out)


def _laid_out(name: str, value: np.ndarray, transform) -> np.ndarray:
    """`transform(value)`, or a ValueError naming the tensor whose shape it cannot take."""
    try:
        return transform(value)
    except ValueError as error:
        raise ValueError(f"{name} is {value.shape}, which config.json does not imply ({error})") from None


def _pad_vocab(table: np.ndarray | None, config: ModelConfig) -> np.ndarray | None:
    """The table with zero rows up to the padded vocabulary (as it is where it cannot be:
    `check_params` then names its shape)."""
    if table is None or table.ndim != 2 or table.shape[0] > padded_vocab(config):
        return table
    return np.pad(table, ((0, padded_vocab(config) - table.shape[0]), (0, 0)))


def _gpt2_params(t: _Tensors, c: GPT2Config) -> dict:
    h, hd, d, L = c.n_heads, head_dim(c), c.d_model, c.n_layers
    layer = lambda name, fn=lambda v: v: t.stack("h.{}." + name, L, fn)
    return {
        "embed": {"tokens": _pad_vocab(t.get("wte.weight"), c), "positions": t.get("wpe.weight")},
        "layers": {
            "norm1_scale": layer("ln_1.weight"),
            "norm1_bias": layer("ln_1.bias"),
            "qkv_kernel": layer("attn.c_attn.weight", lambda v: v.reshape(d, 3, h, hd)),
            "qkv_bias": layer("attn.c_attn.bias", lambda v: v.reshape(3, h, hd)),
            "out_kernel": layer("attn.c_proj.weight", lambda v: v.reshape(h, hd, d)),
            "out_bias": layer("attn.c_proj.bias"),
            "norm2_scale": layer("ln_2.weight"),
            "norm2_bias": layer("ln_2.bias"),
            "fc_kernel": layer("mlp.c_fc.weight"),
            "fc_bias": layer("mlp.c_fc.bias"),
            "proj_kernel": layer("mlp.c_proj.weight"),
            "proj_bias": layer("mlp.c_proj.bias"),
        },
        "final": {"norm_scale": t.get("ln_f.weight"), "norm_bias": t.get("ln_f.bias")},
    }


def _qwen2_params(t: _Tensors, c: Qwen2Config) -> dict:
    h, kv, hd, d, L = c.n_heads, c.n_kv_heads, head_dim(c), c.d_model, c.n_layers
    layer = lambda name, fn=lambda v: v: t.stack("layers.{}." + name, L, fn)
    heads_in = lambda n: lambda v: v.T.reshape(d, n, hd)
    params = {
        "embed": {"tokens": _pad_vocab(t.get("embed_tokens.weight"), c)},
        "layers": {
            "norm1_scale": layer("input_layernorm.weight"),
            "q_kernel": layer("self_attn.q_proj.weight", heads_in(h)),
            "q_bias": layer("self_attn.q_proj.bias", lambda v: v.reshape(h, hd)),
            "k_kernel": layer("self_attn.k_proj.weight", heads_in(kv)),
            "k_bias": layer("self_attn.k_proj.bias", lambda v: v.reshape(kv, hd)),
            "v_kernel": layer("self_attn.v_proj.weight", heads_in(kv)),
            "v_bias": layer("self_attn.v_proj.bias", lambda v: v.reshape(kv, hd)),
            "out_kernel": layer("self_attn.o_proj.weight", lambda v: v.T.reshape(h, hd, d)),
            "norm2_scale": layer("post_attention_layernorm.weight"),
            "gate_kernel": layer("mlp.gate_proj.weight", lambda v: v.T),
            "up_kernel": layer("mlp.up_proj.weight", lambda v: v.T),
            "down_kernel": layer("mlp.down_proj.weight", lambda v: v.T),
        },
        "final": {"norm_scale": t.get("norm.weight")},
    }
    if not c.tie_embeddings:
        params["final"]["head"] = _pad_vocab(t.get("lm_head.weight"), c)
    return params


def load_hf(path: str | Path, dtype: DTypeLike | None = np.float32) -> tuple[ModelConfig, dict]:
    """Read a local HuggingFace GPT-2 or Qwen2 folder (config.json + safetensors).

    Args:
      path: folder written by `save_pretrained` (single or sharded safetensors).
      dtype: parameter dtype; float32 (the trainer's master weights) by default, None
        keeps the checkpoint's own (e.g. bf16 for inference in bf16).

    Returns:
      (config, params): numpy parameters in this package's global layout, for any
      tensor-parallel degree (place them with `models.shard_params`).

    Raises:
      ValueError: missing files, an unsupported architecture or activation, a
        config.json with keys missing or wrong, or tensors missing, of shapes the
        config does not imply or not floating-point (named, with both shapes).
    """
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise ValueError(f"{folder}: no config.json")
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{folder / 'config.json'} cannot be read: {error}") from None
    config = _config_from_hf(hf_config)
    tensors = _Tensors(
        _read_folder(folder), ("transformer.",) if isinstance(config, GPT2Config) else ("model.",), dtype
    )
    try:
        params = _gpt2_params(tensors, config) if isinstance(config, GPT2Config) else _qwen2_params(tensors, config)
    except ValueError as error:  # a tensor of a shape its layout cannot take
        raise ValueError(f"{folder}: {error}") from None
    if tensors.missing:
        raise ValueError(
            f"{folder}: {config.family} checkpoint is missing tensors: {sorted(set(tensors.missing))[:10]}"
        )
    check_params(config, params, what=f"{folder}: tensors", against="config.json")
    return config, params
