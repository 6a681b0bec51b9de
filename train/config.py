"""Training configuration: a dataclass, YAML files (presets shipped in configs/), key=value overrides.

The configuration's keys (YAML, `key=value`, config.json, checkpoints) are flat; inside,
the compression of each mesh axis is one `AxisCompression` group (`TrainConfig.compression`)
and the mesh a named `MeshShape`. `COMPRESSION_KEYS` maps the flat keys onto the groups.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from taco_jax.models.layers import OVERLAP_SITES
from taco_jax.models.transformer import REMAT_POLICIES
from taco_jax.policy import PRESETS, QuantSpec, TacoConfig

# Seeds are 32-bit: jax.random.key folds larger ones onto these (2**32 is seed 0).
SEED_LIMIT = 2**32
# The preset YAML files (the repository's configs/, installed as package data).
PRESET_FILES = resources.files("taco_jax.configs")
CALIBRATION_STRATEGIES = ("auto", "identity", "cluster", "interleave")
# What `--resume` lets differ from the checkpoint's configuration: how long and how
# often, not what is trained. Turning the data-parallel compression on or off is also
# allowed (its residuals start at zero, or are dropped), as is recalibrating or how the
# layers run (collective matmuls, a scanned loop: the same arithmetic); decay_steps
# only where it names the schedule's own horizon (the trainer checks it).
RESUMABLE_KEYS = (
    "steps",
    "decay_steps",
    "eval_every",
    "eval_batches",
    "sample_tokens",
    "checkpoint_every",
    "keep_checkpoints",
    "max_bad_steps",
    "debug_nan_steps",
    "recalibrate",
    "calibration_steps",
    "taco_data",
    "taco_data_backward",
    "tp_overlap",
    "scan_layers",
    "out",
)


class MeshShape(NamedTuple):
    """The degrees of a run's (data, pipe, tensor) mesh."""

    data: int
    pipe: int
    tensor: int


@dataclasses.dataclass(frozen=True)
class AxisCompression:
    """How one mesh axis's traffic is compressed.

    Attributes:
      preset: TACO preset (`taco_jax.TacoConfig.preset`): off | fp8 | taco | taco+ |
        taco+mixed | taco6-4 | taco4.
      forward, backward: replace the preset's forward / backward quantizer, as
        "fmt:group_size:H|-:scales" (e.g. "int4:128:H:bf16"); empty: the preset's.
    """

    preset: str
    forward: str = ""
    backward: str = ""


@dataclasses.dataclass(frozen=True)
class Compression:
    """The compression of each mesh axis's traffic (see `TrainConfig`)."""

    tensor: AxisCompression = AxisCompression("taco+")
    pipe: AxisCompression = AxisCompression("off")
    data: AxisCompression = AxisCompression("off")

    def of(self, axis: str) -> AxisCompression:
        """The group of mesh axis `axis` ("tensor", "pipe" or "data")."""
        return {"tensor": self.tensor, "pipe": self.pipe, "data": self.data}[axis]


# The flat keys of the compression groups: key -> (axis, field). The data-parallel
# reduction sends gradients only, so it has no forward quantizer.
COMPRESSION_KEYS = {
    "taco": ("tensor", "preset"),
    "taco_forward": ("tensor", "forward"),
    "taco_backward": ("tensor", "backward"),
    "taco_pipe": ("pipe", "preset"),
    "taco_pipe_forward": ("pipe", "forward"),
    "taco_pipe_backward": ("pipe", "backward"),
    "taco_data": ("data", "preset"),
    "taco_data_backward": ("data", "backward"),
}

# The preset keys: YAML reads an unquoted `off` as False, which these take as "off".
PRESET_KEYS = tuple(key for key, (_, field) in COMPRESSION_KEYS.items() if field == "preset")

POSITIVE_KEYS = (
    "steps",
    "batch_size",
    "seq_len",
    "microbatches",
    "grad_accum",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "max_bad_steps",
)


def overlap_sites(tp_overlap: str) -> bool | frozenset[str]:
    """A tp_overlap value as the models take it (`Parallelism.overlap`): True for "on",
    False for "off" and "auto" (until the probe decides), else the named sites.

    Raises:
      ValueError: a value that is none of these, or an unknown site.
    """
    if tp_overlap in ("on", "off", "auto"):
        return tp_overlap == "on"
    sites = frozenset(s.strip() for s in tp_overlap.split(",") if s.strip())
    unknown = sorted(sites - set(OVERLAP_SITES))
    if not sites or unknown:
        named = f" (unknown sites {unknown})" if sites and unknown else ""
        raise ValueError(
            f"tp_overlap must be on, off, auto or a comma-separated list of sites from {list(OVERLAP_SITES)}, "
            f"got {tp_overlap!r}{named}"
        )
    return sites


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; every key can be set from YAML or key=value.

    Build one from flat keys with `TrainConfig.from_keys(**keys)` (and change keys with
    `cfg.with_keys(**keys)`); the keys are the attributes below, except that the
    compression keys (taco, taco_forward, ..., `COMPRESSION_KEYS`) make up `compression`.

    Attributes:
      model: model preset (models.PRESETS).
      mesh: `MeshShape` (data, pipe, tensor) degrees; their product is the device count.
      compression: the `Compression` of each axis, from the keys below.
      taco: TACO preset for the tensor-parallel collectives (off | fp8 | taco | taco+ |
        taco+mixed | taco6-4 | taco4).
      taco_min_bytes: messages under this many bytes stay uncompressed (-1: preset's).
      taco_policy: where compression is used (train/link_policy.py): "auto" (on GPUs
        with tensor > 1, a start-up probe times every TP message plain and compressed
        and compresses only where that was measured faster, written to
        OUT/link_profile.json; elsewhere every message is compressed), "always" (every
        message of at least taco_min_bytes), or a link_profile.json to reuse.
      taco_forward: replace the preset's quantizer of forward-pass messages
        (activations), as "fmt:group_size:H|-:scales[:sr]" (e.g. "int4:128:H:bf16");
        empty: the preset's.
      taco_backward: replace the preset's quantizer of backward-pass messages
        (activation gradients), written as taco_forward's; empty: the preset's.
      taco_pipe: TACO preset for what pipeline stages send each other (activations
        forward with the preset's forward quantizer, their gradients backward with its
        backward one); "off": plain sends.
      taco_pipe_forward: replace taco_pipe's quantizer of the activations sent forward
        (written as taco_forward's).
      taco_pipe_backward: replace taco_pipe's quantizer of the gradients sent back
        (written as taco_forward's).
      taco_data: TACO preset for the data-parallel gradient reduction (one bucket per
        step through the compressed two-shot all-reduce with the preset's backward
        quantizer, with error feedback: each data rank keeps what its quantizers dropped,
        adds it to the next step's gradients, and saves it in checkpoints); "off": pmean.
      taco_data_backward: replace taco_data's quantizer (gradients are backward-pass
        tensors), e.g. "int4:128:H:bf16" for 4-bit gradients.
      sequence_parallel: norms and residuals on sequence shards.
      tp_overlap: "on": every layer's tensor-parallel matmuls and their collectives run
        as collective matmuls (one message per peer, a chunk's matmul beside the other
        chunks' transfers; `taco_jax.collective_matmul`): with sequence_parallel the
        all-gather -> matmul and matmul -> reduce-scatter, without it the matmul ->
        all-reduce and the column matmuls' backward all-reduce. A comma-separated list of
        sites (of layers.attn.in, layers.attn.out, layers.mlp.in, layers.mlp.out,
        head.in): those sites only. "off": the collectives, then the matmuls. "auto": on
        GPUs, per site, by start-up timings of the step (train/link_policy.py,
        OUT/overlap_probe.json); elsewhere "off".
      steps: optimizer steps to run (a resumed run continues up to this step).
      seed: parameter init seed (and data order seed unless data_seed is set).
      data_seed: data order seed; -1 uses `seed` (set it to compare seeds on one data order).
      batch_size: sequences per optimizer step (global).
      seq_len: tokens per sequence.
      microbatches: pipeline microbatches per accumulation step (GPipe schedule).
      grad_accum: gradient-accumulation steps per optimizer step.
      lr: peak learning rate, reached after warmup_steps.
      warmup_steps: steps of linear warmup from 0 to lr.
      decay_steps: the step at which the cosine decay after warmup reaches
        lr * min_lr_ratio (0: at `steps`; set it to stop early and resume on the same
        schedule).
      min_lr_ratio: the learning rate at decay_steps, as a fraction of lr.
      weight_decay: AdamW's decoupled weight decay, on the weight matrices only.
      beta1: AdamW's first-moment decay.
      beta2: AdamW's second-moment decay.
      grad_clip: the largest global gradient norm; larger gradients are scaled down to it.
      compute_dtype: "float32" or "bfloat16" (parameters and optimizer stay float32).
      remat: activation checkpointing per layer: "none", "dots" (keep matmul outputs,
        recompute the rest) or "block" (keep each layer's input only); trades
        recomputation for activation memory (benchmarks/step.py measures both). Both
        keep what the layer's collectives received, so recomputing sends nothing again.
      scan_layers: run the layers as one `lax.scan` loop (compile time independent of
        depth) instead of unrolled (faster step: `models.Parallelism.scan_layers`).
      data: "shakespeare" (byte-level, shipped), a .npy/.bin token file, or a text file
        to tokenize with `tokenizer`.
      tokenizer: local HuggingFace tokenizer folder (tokenizer.json), for a text `data`.
      data_dtype: element type of a raw .bin token file (uint16 as nanoGPT, or uint32).
      val_fraction: tail of the corpus held out for validation.
      eval_every: steps between validations.
      eval_batches: validation batches per validation.
      sample_tokens: at each evaluation, continue the validation split's first 32 tokens
        greedily by this many (`models.generate`, prefill compressed as the run's tensor
        traffic), print the text and keep it as the metrics row's "sample"; 0: none.
      out: run directory (checkpoints, metrics.jsonl, loss.png).
      checkpoint_every: steps between checkpoints.
      keep_checkpoints: how many of the newest checkpoints to keep.
      max_bad_steps: stop after this many consecutive non-finite steps.
      debug_nan_steps: steps whose gradients are replaced by NaN (tests the skip logic).
      calibration_steps: with a "taco" preset, the tensors every compressed site sends
        during the first this many steps are observed (training proceeds with identity
        permutations), then each site's channel permutation and transform are chosen
        by measured codec error (taco_jax.calibration) and kept in checkpoints; 0: no
        calibration.
      calibration_strategy: permutation strategy: "auto" (the lowest error of identity,
        cluster and interleave per site) or one of them.
      calibration_min_gain: relative codec-error cut a permutation must bring over the
        identity to be used (it costs a gather on both sides of the collective).
      simulate_mesh: run the mesh as named vmaps on one device (`taco_jax.simulated_shard_map`):
        the arithmetic of a data x pipe x tensor run on a single GPU, for quality studies.
      calibration_file: use the calibration in this JSON (a run's calibration.json or the
        output of --calibrate-only) instead of observing. It refines the taco preset and
        never overrides it: each site's permutation and transform, and a format only
        among the preset's fewer-bits formats (taco+mixed); a file with another format,
        or with a preset that is not calibrated (off, fp8), is an error naming both keys.
        A resumed run keeps its checkpoint's calibration; the file changed or gone since
        the run started is an error (--force resumes with the checkpoint's).
      recalibrate: observe and calibrate again for calibration_steps from the
        (resumed) start step, replacing the checkpoint's calibration.
    """

    model: str = "gpt2-tiny"
    mesh: MeshShape = MeshShape(2, 1, 4)
    compression: Compression = Compression()
    taco_min_bytes: int = 0
    taco_policy: str = "auto"
    sequence_parallel: bool = False
    tp_overlap: str = "off"
    steps: int = 300
    seed: int = 0
    data_seed: int = -1
    batch_size: int = 16
    seq_len: int = 128
    microbatches: int = 1
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 30
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    data: str = "shakespeare"
    tokenizer: str = ""
    data_dtype: str = "uint16"
    val_fraction: float = 0.05
    eval_every: int = 100
    eval_batches: int = 4
    sample_tokens: int = 0
    out: str = "runs/default"
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_bad_steps: int = 5
    debug_nan_steps: tuple[int, ...] = ()
    calibration_steps: int = 20
    calibration_strategy: str = "auto"
    calibration_min_gain: float = 0.1
    calibration_file: str = ""
    recalibrate: bool = False
    simulate_mesh: bool = False

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))
        object.__setattr__(self, "mesh", MeshShape(*(int(d) for d in self.mesh)))

    @classmethod
    def from_keys(cls, **keys: Any) -> TrainConfig:
        """A config from flat keys (as YAML and key=value give them), values converted.

        Raises:
          ValueError: an unknown key, a value of the wrong type, or a bad config.
        """
        return apply_overrides(cls(), keys)

    def with_keys(self, **keys: Any) -> TrainConfig:
        """This config with flat keys replaced (see `from_keys`)."""
        return apply_overrides(self, keys)

    def _problems(self) -> list[str]:
        """What is wrong with this config, one phrase per key."""
        problems = [
            f"{name} must be >= 1, got {getattr(self, name)}" for name in POSITIVE_KEYS if getattr(self, name) < 1
        ]
        problems += [
            f"{name} must be >= 0, got {getattr(self, name)}"
            for name in ("calibration_steps", "warmup_steps", "decay_steps")
            if getattr(self, name) < 0
        ]
        if len(self.mesh) != 3 or any(int(d) < 1 for d in self.mesh):
            problems.append(f"mesh must be three positive degrees DATA,PIPE,TENSOR, got {tuple(self.mesh)}")
        elif not problems:
            per_step = int(self.mesh[0]) * self.grad_accum * self.microbatches
            if self.batch_size % per_step:
                problems.append(
                    f"batch_size {self.batch_size} is not divisible by data x grad_accum x microbatches = {per_step}"
                )
        if self.compute_dtype not in ("float32", "bfloat16"):
            problems.append(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"remat must be one of {list(REMAT_POLICIES)}, got {self.remat!r}")
        if self.calibration_strategy not in CALIBRATION_STRATEGIES:
            problems.append(
                f"calibration_strategy must be one of {list(CALIBRATION_STRATEGIES)}, got {self.calibration_strategy!r}"
            )
        if self.taco_policy not in ("auto", "always") and not self.taco_policy.endswith(".json"):
            problems.append(f"taco_policy must be auto, always or a link_profile.json, got {self.taco_policy!r}")
        problems += self._compression_problems()
        try:
            overlap_sites(self.tp_overlap)
        except ValueError as error:
            problems.append(str(error))
        if not 0 < self.val_fraction < 1:
            problems.append(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        return problems + self._optimizer_problems() + self._data_problems()

    def _compression_problems(self) -> list[str]:
        """What is wrong with the compression keys: a preset or quantizer that does not
        parse, a quantizer given where its preset compresses nothing, one its preset's
        mode does not take, or a calibration_file with a mode that is not calibrated."""
        problems, flat = [], compression_keys(self.compression)
        for axis in ("tensor", "pipe", "data"):
            preset_key, *spec_keys = _axis_keys(axis)
            preset, specs = flat[preset_key], {key: flat[key] for key in spec_keys if flat[key]}
            if preset not in PRESETS:
                problems.append(f"{preset_key} must be a TACO preset, one of {sorted(PRESETS)}, got {preset!r}")
                continue
            unreadable = [f"{key}: {error}" for key, value in specs.items() if (error := _parse_error(value))]
            if unreadable:
                problems += unreadable
                continue
            if specs and PRESETS[preset].mode == "off":
                given = ", ".join(f"{key}={value!r}" for key, value in specs.items())
                problems.append(
                    f"{given} given with {preset_key}=off, which compresses nothing: drop it or choose a preset"
                )
                continue
            parsed = {COMPRESSION_KEYS[key][1]: QuantSpec.parse(value) for key, value in specs.items()}
            try:
                TacoConfig.preset(preset, **parsed)
            except ValueError as error:
                given = ", ".join(f"{key}={value!r}" for key, value in specs.items())
                problems.append(f"{given} with {preset_key}={preset}: {error}")
        mode = PRESETS.get(self.compression.tensor.preset)
        if self.calibration_file and mode is not None and mode.mode != "taco":
            problems.append(
                f"calibration_file={self.calibration_file!r} given with taco={self.compression.tensor.preset}, "
                f"whose mode {mode.mode!r} takes no calibration (only taco presets are calibrated)"
            )
        return problems

    def _optimizer_problems(self) -> list[str]:
        """What is wrong with the optimizer's keys (a NaN learning rate, say, would train
        NaN parameters)."""
        problems = [
            _out_of_range("lr", self.lr, above=0.0),
            _out_of_range("grad_clip", self.grad_clip, above=0.0),
            _out_of_range("weight_decay", self.weight_decay, at_least=0.0),
            _out_of_range("min_lr_ratio", self.min_lr_ratio, at_least=0.0, at_most=1.0),
            _out_of_range("calibration_min_gain", self.calibration_min_gain, at_least=0.0, at_most=1.0),
        ]
        problems = [problem for problem in problems if problem]
        problems += [
            f"{name} must be in [0, 1), got {getattr(self, name)}"
            for name in ("beta1", "beta2")
            if not 0 <= getattr(self, name) < 1
        ]
        if not 0 <= self.seed < SEED_LIMIT:
            problems.append(f"seed must be in [0, 2**32), got {self.seed}")
        if self.data_seed != -1 and not 0 <= self.data_seed < SEED_LIMIT:
            problems.append(f"data_seed must be -1 (the seed) or in [0, 2**32), got {self.data_seed}")
        return problems

    def _data_problems(self) -> list[str]:
        """What is wrong with the data and run-directory keys."""
        problems = []
        try:
            integer = np.issubdtype(np.dtype(self.data_dtype), np.integer)
        except TypeError:
            integer = False
        if not integer:
            problems.append(f"data_dtype must be an integer dtype such as uint16 or uint32, got {self.data_dtype!r}")
        if not self.out.strip():
            problems.append("out must be a non-empty path (the run directory)")
        if any(step < 0 for step in self.debug_nan_steps):
            problems.append(f"debug_nan_steps must be steps >= 0, got {list(self.debug_nan_steps)}")
        return problems


def _axis_keys(axis: str) -> list[str]:
    """The flat compression keys of mesh axis `axis`, its preset's first."""
    return [key for key, (of, _) in COMPRESSION_KEYS.items() if of == axis]


def _parse_error(text: str) -> str | None:
    """Why `QuantSpec.parse` does not read `text`, or None where it does."""
    try:
        QuantSpec.parse(text)
    except ValueError as error:
        return str(error)
    return None


def _out_of_range(
    name: str, value: float, *, above: float | None = None, at_least: float | None = None, at_most: float = math.inf
) -> str:
    """A phrase saying that key `name` is not a finite number in the range, or ""."""
    low_ok = (above is None or value > above) and (at_least is None or value >= at_least)
    if math.isfinite(value) and low_ok and value <= at_most:
        return ""
    low = f"> {above:g}" if above is not None else f">= {at_least:g}"
    high = f" and <= {at_most:g}" if math.isfinite(at_most) else ""
    return f"{name} must be a finite number {low}{high}, got {value}"


def _coerce(name: str, value: Any, kind) -> Any:
    """Convert a YAML/CLI value to the key's type, refusing what would change it (a float
    truncated to an int, a boolean read as a number, a mapping read as a path).

    Raises:
      ValueError: naming the key, the type it takes and the value.
    """
    if kind is MeshShape or typing.get_origin(kind) is tuple:
        if isinstance(value, str):
            items: list = [t for t in value.replace(" ", "").split(",") if t]
        else:
            items = list(value) if isinstance(value, (list, tuple)) else [value]
        return tuple(_integer(name, item) for item in items)  # TrainConfig checks and names a mesh
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if kind is int:
        return _integer(name, value)
    if kind is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return kind(value)
    raise ValueError(f"{name}: expected a string, got {value!r}")


def _integer(name: str, value: Any) -> int:
    """`value` as an int if it is one (an integral float such as 3.0 included).

    Raises:
      ValueError: a boolean, a fraction, or text that is no integer (naming `name`).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"{name}: expected an integer, got {value!r}")


def _key_types() -> dict:
    """Every flat key and its type."""
    hints = typing.get_type_hints(TrainConfig)
    types = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.name != "compression"}
    return {**types, **dict.fromkeys(COMPRESSION_KEYS, str)}


def flat_keys() -> list[str]:
    """Every flat key a run is configured by (`TrainConfig.from_keys`, key=value)."""
    return list(_key_types())


def compression_keys(compression: Compression) -> dict[str, str]:
    """The flat keys of `compression` (`COMPRESSION_KEYS`)."""
    return {key: getattr(compression.of(axis), field) for key, (axis, field) in COMPRESSION_KEYS.items()}


def _with_compression_keys(compression: Compression, keys: dict[str, str]) -> Compression:
    """`compression` with flat compression keys replaced."""
    groups = {axis: compression.of(axis) for axis in ("tensor", "pipe", "data")}
    for key, value in keys.items():
        axis, field = COMPRESSION_KEYS[key]
        groups[axis] = dataclasses.replace(groups[axis], **{field: value})
    return Compression(**groups)


def apply_overrides(config: TrainConfig, overrides: dict) -> TrainConfig:
    """Replace flat keys, converting values to their types.

    Raises:
      ValueError: an unknown key, a value of the wrong type, or a bad config.
    """
    types = _key_types()
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; valid keys: {sorted(types)}")
    values = {k: _coerce(k, "off" if k in PRESET_KEYS and v is False else v, types[k]) for k, v in overrides.items()}
    grouped = {k: values.pop(k) for k in list(values) if k in COMPRESSION_KEYS}
    return dataclasses.replace(config, **values, compression=_with_compression_keys(config.compression, grouped))


def preset_names() -> list[str]:
    """The names of the shipped preset configurations."""
    return sorted(entry.name.removesuffix(".yaml") for entry in PRESET_FILES.iterdir() if entry.name.endswith(".yaml"))


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping of config fields: a file, or the name of a shipped preset
    (`preset_names`).

    Raises:
      ValueError: no such file or preset, or a file that is not a mapping.
    """
    file = Path(path)
    source: Path | Traversable = file if file.exists() or file.suffix else PRESET_FILES / f"{path}.yaml"
    if not source.is_file():
        raise ValueError(f"config file {path} does not exist (presets: {preset_names()})")
    try:
        values = yaml.safe_load(source.read_text()) or {}
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"config file {path} cannot be read: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of field: value")
    return values


def parse_key_values(items: list[str]) -> dict:
    """['lr=1e-3', 'steps=10'] -> {'lr': '1e-3', 'steps': '10'}."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def to_dict(config: TrainConfig) -> dict:
    """The config as its flat keys, in JSON values (tuples as lists)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "compression":
            values.update(compression_keys(value))
        else:
            values[field.name] = list(value) if isinstance(value, tuple) else value
    return values


def key_descriptions() -> dict[str, str]:
    """Each flat key's description, read from `TrainConfig`'s Attributes docstring (an
    entry may describe several keys: "taco_forward, taco_backward: ...").

    Returns:
      {key: description} for every key of `flat_keys`, in that order.

    Raises:
      ValueError: a flat key the docstring does not describe.
    """
    doc = (TrainConfig.__doc__ or "").split("Attributes:", 1)[-1]
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in doc.splitlines():
        head, sep, text = line.strip().partition(": ")
        if line.startswith("      ") and not line.startswith("        ") and sep:
            names = [name.strip() for name in head.split(",")]
            for name in names:
                entries[name] = text.strip()
        elif line.strip():
            for name in names:
                entries[name] += " " + line.strip()
    missing = [key for key in flat_keys() if key not in entries]
    if missing:
        raise ValueError(f"TrainConfig's docstring does not describe {missing}")
    return {key: entries[key] for key in flat_keys()}


def changed_keys(saved: dict, config: TrainConfig) -> list[str]:
    """The keys of a saved config (`to_dict`) that `config` sets otherwise and a resume
    may not change (`RESUMABLE_KEYS` may), as "key: saved -> now" phrases."""
    now = to_dict(config)
    return [
        f"{key}: {saved[key]!r} -> {now[key]!r}"
        for key in sorted(saved)
        if key in now and key not in RESUMABLE_KEYS and saved[key] != now[key]
    ]
