"""Compressed tensor parallelism for MaxText: its quantization hook answered by taco_jax.

MaxText (0.2.5) runs every dense matmul through `DenseGeneral`, which asks the model's
`quant` object for a `dot_general_cls(mesh_axes=<the kernel's logical axes>)`.
`TacoQuantization` is such an object. For each kernel it reads MaxText's own
`logical_axis_rules`: a kernel dimension on the tensor axis that is an output dimension
makes a column-parallel matmul, a contracting one a row-parallel matmul, and a kernel not
split over the tensor axis keeps plain `lax.dot_general`. The activations stay where
MaxText's rules put them (`layout="auto"`):

| rules put on the tensor axis | layout | column matmul (forward / backward) | row matmul (forward / backward) |
|---|---|---|---|
| `activation_embed` (MaxText's default) | `feature` | 8-bit all-gather of the features / 8-bit reduce-scatter | 8-bit reduce-scatter of the features / 8-bit all-gather |
| `activation_length` | `sequence` | the same along the sequence | the same along the sequence |
| neither | `replicated` | nothing / 8-bit all-reduce | 8-bit all-reduce / nothing |

Column matmuls that read the same activation (key and value; the MLP's two input
projections) share one gather, so their gradients are summed before one reduce-scatter.
Messages are cut into rows of the codec's group size, so that feature shards narrower
than a group make whole groups. The batch axis is split over the mesh axes the rules give
`activation_batch` (`data`, `fsdp`, ...), so data and fsdp parallelism send what they
send without taco.

    from taco_jax.integrations import maxtext as taco_maxtext

    taco_maxtext.install("taco+")   # before MaxText builds its model
    # ... MaxText's own train main, unchanged

or, from the shell, MaxText's train arguments after ours:
`python -m taco_jax.integrations.maxtext --taco taco+ run_name=... steps=...`. It trains,
prints the tensor axis's bytes against bf16, and writes `taco_wire.json` into
`base_output_directory/run_name`.

Site names (wire ledger, calibration) are the kernel's logical axes joined by "/", e.g.
"embed/mlp" (the MLP's input projections) or "heads/kv/embed" (attention's output).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NoReturn

import flax.linen as nn
import jax
from jax import lax
from jax.sharding import Mesh

from taco_jax import accounting, strict_json
from taco_jax.accounting import WireLedger, record_wire
from taco_jax.calibration import Calibration, Collector, calibrate, observing
from taco_jax.dot_general import GatheredInput, ParallelDotGeneral
from taco_jax.hlo import bytes_by_axis, f32_as_bf16
from taco_jax.policy import PRESETS, TacoConfig

MAXTEXT_VERSION = "0.2.5"
LAYOUTS = ("auto", "replicated", "feature", "sequence")
WIRE_FILE = "taco_wire.json"
CALIBRATION_FILE = "taco_calibration.json"
# MaxText's logical names of the residual stream's axes, read to choose the layout and
# the batch axes.
_BATCH, _LENGTHS, _FEATURES = "activation_batch", ("activation_length", "activation_norm_length"), "activation_embed"
# Entries of the gather cache (activations traced most recently): enough for the
# projections of one layer, few enough to hold no trace alive for long.
_SHARED_GATHERS = 8


def _maxtext_module(name: str) -> Any:
    """Import a MaxText module after checking that the installed MaxText is the one this
    integration was written against (it patches one of its functions)."""
    try:
        found = importlib.metadata.version("maxtext")
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            "taco_jax.integrations.maxtext needs MaxText: pip install 'taco_jax[maxtext]' (Python >= 3.12)",
            name="maxtext",
        ) from None
    if found != MAXTEXT_VERSION:
        raise RuntimeError(
            f"taco_jax.integrations.maxtext supports MaxText {MAXTEXT_VERSION} (it replaces its "
            f"layers.quantizations.configure_quantization); found MaxText {found}"
        )
    return importlib.import_module(name)


def _mesh_axes(entry: Any, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of one entry of a resolved PartitionSpec that split it (size > 1)."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in axes if isinstance(a, str) and mesh.shape.get(a, 1) > 1)


def site_name(kernel_axes: Sequence[str | None]) -> str:
    """The wire-ledger and calibration site of a kernel: its logical axes joined by "/"."""
    return "/".join(a or "-" for a in kernel_axes)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How one MaxText kernel is split over the tensor axis.

    Attributes:
      kind: "column" (an output dimension is split) or "row" (a contracting one).
      sharded_dim: the kernel dimension split over the tensor axis.
      kernel_spec: the kernel's mesh axes per dimension (axes of size 1 left out).
      site: the site name (`site_name`).
    """

    kind: str
    sharded_dim: int
    kernel_spec: tuple[tuple[str, ...], ...]
    site: str


@dataclasses.dataclass(frozen=True, eq=False)
class TacoQuantization:
    """MaxText's quantization interface, answered with compressed tensor parallelism.

    Pass it as MaxText's `quant` (what `layers.quantizations.configure_quantization`
    returns); `install` does that for every model MaxText builds.

    Attributes:
      taco: a `TacoConfig` or a preset name ("taco+", "off", ... see `TacoConfig.preset`).
      mesh: MaxText's device mesh (`maxtext.utils.maxtext_utils.get_mesh_from_config`).
      axis_name: the tensor-parallel mesh axis.
      layout: where activations sit between matmuls: "replicated", "feature" (split over
        the tensor axis along the features), "sequence" (along the sequence) or "auto"
        (what MaxText's rules say of `activation_embed` and `activation_length`).
      batch_axes: mesh axes splitting the leading (batch) axis of activations, or "infer"
        (those MaxText's rules give `activation_batch`).
      calibration: per-site plans (`taco_jax.calibration`), keyed by `site_name`.
      rules: MaxText's `logical_axis_rules`; None reads the rules in effect when the
        model is traced (`flax.linen.get_logical_axis_rules`).
    """

    taco: TacoConfig | str
    mesh: Mesh
    axis_name: str = "tensor"
    layout: str = "auto"
    batch_axes: tuple[str, ...] | str = "infer"
    calibration: Calibration | None = None
    rules: tuple | None = None
    # MaxText reads these off every quantization object.
    needs_apply_rngs: ClassVar[bool] = False
    quant_mode: ClassVar[str] = "train"
    _gathers: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.taco, str):
            object.__setattr__(self, "taco", TacoConfig.preset(self.taco))
        if not isinstance(self.taco, TacoConfig):
            raise ValueError(f"taco must be a TacoConfig or a preset name, got {type(self.taco).__name__}")
        if not isinstance(self.mesh, Mesh) or self.axis_name not in self.mesh.axis_names:
            names = getattr(self.mesh, "axis_names", None)
            raise ValueError(f"the mesh has no {self.axis_name!r} axis (its axes: {names})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown taco layout {self.layout!r}; expected one of {list(LAYOUTS)}")
        if self.batch_axes != "infer":
            if isinstance(self.batch_axes, str) or not all(a in self.mesh.axis_names for a in self.batch_axes):
                raise ValueError(
                    f"batch_axes must be 'infer' or a tuple of mesh axes {self.mesh.axis_names}, got {self.batch_axes!r}"
                )
            object.__setattr__(self, "batch_axes", tuple(self.batch_axes))
        if self.rules is not None:
            object.__setattr__(self, "rules", tuple((name, _freeze(axes)) for name, axes in self.rules))

    # ------------------------------------------------------------- MaxText's interface

    def dot_general_cls(self, mesh_axes: Sequence[str | None] = ()) -> functools.partial:
        """The Flax module class (with its fields bound) `DenseGeneral` instantiates for a
        kernel with logical axes `mesh_axes`."""
        return functools.partial(TacoDotGeneral, quantization=self, kernel_axes=tuple(mesh_axes))

    def einsum(self, *args: Any, **kwargs: Any) -> Any:
        """MaxText's einsum hook (mixture-of-experts layers): `jnp.einsum`, uncompressed."""
        return jax.numpy.einsum

    # ------------------------------------------------------------- decisions from the rules

    def _rules(self) -> Any:
        return self.rules if self.rules is not None else nn.get_logical_axis_rules()

    def kernel_plan(self, kernel_axes: Sequence[str | None], contracting: int) -> KernelPlan | None:
        """Column or row for a kernel whose first `contracting` dimensions contract, from
        the rules; None where the kernel is not split over the tensor axis alone (plain
        `lax.dot_general` then)."""
        if self.mesh.shape[self.axis_name] == 1 or not kernel_axes:
            return None
        spec = self._resolve(tuple(kernel_axes))
        split = [dim for dim, axes in enumerate(spec) if self.axis_name in axes]
        # A dimension split over the tensor axis and another axis together has its
        # tensor shards strided: left to the compiler.
        if len(split) != 1 or spec[split[0]] != (self.axis_name,):
            return None
        kind = "row" if split[0] < contracting else "column"
        return KernelPlan(kind, split[0], spec, site_name(kernel_axes))

    def resolved_layout(self) -> str:
        """The activation layout: `layout`, or for "auto" the one MaxText's rules give the
        residual stream."""
        if self.layout != "auto":
            return self.layout
        batch, length, features = self._activation_axes()
        if self.axis_name in features:
            return "feature"
        return "sequence" if self.axis_name in length else "replicated"

    def resolved_batch_axes(self) -> tuple[str, ...]:
        """Mesh axes (of size > 1) splitting the batch: `batch_axes`, or those of the
        rules' `activation_batch`."""
        if self.batch_axes != "infer":
            return tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        return self._activation_axes()[0]

    def _activation_axes(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        resolved = self._resolve((_BATCH, *_LENGTHS, _FEATURES))
        return resolved[0], resolved[1] + resolved[2], resolved[3]

    def _resolve(self, names: tuple[str | None, ...]) -> tuple[tuple[str, ...], ...]:
        """The mesh axes (of size > 1) splitting each named dimension under the rules."""
        resolved = nn.logical_to_mesh_axes(names, self._rules())
        assert resolved is not None  # None only for names None
        return tuple(_mesh_axes(entry, self.mesh) for entry in resolved)

    # ------------------------------------------------------------- the matmul

    def dot_general(
        self,
        kernel_axes: Sequence[str | None],
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """`lax.dot_general(lhs, rhs, dimension_numbers)` with the tensor axis's
        communication compressed (`taco_jax.dot_general.ParallelDotGeneral`), for
        `DenseGeneral`'s dimension numbers (the last k axes of `lhs` contract with the
        first k of the kernel); plain where the kernel or the shapes do not split."""
        plain = functools.partial(
            lax.dot_general,
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
        contracting = len(dimension_numbers[0][1])
        plan = self.kernel_plan(kernel_axes, contracting)
        if plan is None:
            return plain()
        layer = self.parallel_dot_general(plan)
        try:
            layer.check_shapes(lhs.shape, rhs.shape, dimension_numbers)
        except ValueError:
            # MaxText's dummy initialisation call (a batch of one), or shapes that do not
            # split over the mesh or into the codec's groups.
            return plain()
        gathered = self._gathered(layer, lhs, contracting) if plan.kind == "column" else lhs
        return layer(gathered, rhs, dimension_numbers, precision, preferred_element_type)

    def parallel_dot_general(self, plan: KernelPlan) -> ParallelDotGeneral:
        """The library's matmul for one kernel: its split, the activations' layout and
        batch axes, every message cut into rows of the codec's group size (feature
        shards narrower than a group make whole groups)."""
        assert isinstance(self.taco, TacoConfig)
        return ParallelDotGeneral(
            self.mesh,
            self.taco,
            plan.kind,
            site=plan.site,
            axis_name=self.axis_name,
            calibration=self.calibration,
            layout=self.resolved_layout(),
            batch_axes=self.resolved_batch_axes(),
            kernel_spec=plan.kernel_spec,
            message_rows=True,
        )

    def _gathered(self, layer: ParallelDotGeneral, x: jax.Array, contracting: int) -> GatheredInput:
        """x gathered once for the column matmuls that read it (MaxText calls the key
        and value projections, and the MLP's two input projections, one by one)."""
        key = (id(x), layer.layout, layer.batch_axes)
        cached = self._gathers.get(key)
        if cached is not None and cached[0] is x:
            return cached[1]
        gathered = layer.gather_input(x, contracting)
        while len(self._gathers) >= _SHARED_GATHERS:
            self._gathers.pop(next(iter(self._gathers)))
        self._gathers[key] = (x, gathered)
        return gathered


def _freeze(value: Any) -> Any:
    """Rules as nested tuples (hashable), from MaxText's lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class TacoDotGeneral(nn.Module):
    """The Flax module `DenseGeneral` instantiates per kernel (through MaxText's Linen
    bridge). At initialisation (MaxText traces it once with dummy inputs) it is the
    plain `lax.dot_general`; it holds no variables."""

    quantization: TacoQuantization
    kernel_axes: tuple

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        if self.is_initializing():
            return lax.dot_general(
                lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
            )
        return self.quantization.dot_general(
            self.kernel_axes, lhs, rhs, dimension_numbers, precision, preferred_element_type
        )


# ----------------------------------------------------------------------------- install

# MaxText's own configure_quantization, kept while `install` has replaced it.
_ORIGINAL: dict[str, Any] = {}


def install(taco: TacoConfig | str = "taco+", **options: Any) -> None:
    """Make MaxText answer its quantization hook with `TacoQuantization` for every model
    it builds from now on (training; serving and conversion keep MaxText's own).

    Args:
      taco: a `TacoConfig` or a preset name.
      **options: further `TacoQuantization` arguments (axis_name, layout, batch_axes,
        calibration); the mesh and the rules are MaxText's, from its config.

    Raises:
      RuntimeError: a MaxText version other than the one supported.
      ValueError: an unknown preset or layout; when MaxText builds a model, a config
        that asks for MaxText's own quantization too, or a mesh without the tensor axis.
    """
    quantizations = _maxtext_module("maxtext.layers.quantizations")
    maxtext_utils = _maxtext_module("maxtext.utils.maxtext_utils")
    original = _ORIGINAL.setdefault("configure_quantization", quantizations.configure_quantization)
    if isinstance(taco, str):
        taco = TacoConfig.preset(taco)  # an unknown preset raises now, not when MaxText builds its model
    if options.get("layout", "auto") not in LAYOUTS:
        raise ValueError(f"unknown taco layout {options['layout']!r}; expected one of {list(LAYOUTS)}")

    def configure_quantization(config: Any, quant_mode_str: str = "train") -> Any:
        if quant_mode_str != "train":
            return original(config, quant_mode_str)
        check_config(config, options.get("axis_name", "tensor"))
        mesh = maxtext_utils.get_mesh_from_config(config)
        return TacoQuantization(taco, mesh=mesh, rules=config.logical_axis_rules, **options)

    quantizations.configure_quantization = configure_quantization


def uninstall() -> None:
    """Give MaxText its own quantization hook back (no-op when not installed)."""
    if "configure_quantization" in _ORIGINAL:
        quantizations = _maxtext_module("maxtext.layers.quantizations")
        quantizations.configure_quantization = _ORIGINAL.pop("configure_quantization")


def check_config(config: Any, axis_name: str = "tensor") -> None:
    """Raise ValueError for a MaxText config taco cannot run with: MaxText's own
    quantization asked for too, or no tensor axis in its mesh."""
    if config.quantization:
        raise ValueError(_both(config.quantization))
    if axis_name not in config.mesh_axes:
        raise ValueError(f"MaxText's mesh_axes {list(config.mesh_axes)} have no {axis_name!r} axis")


# ----------------------------------------------------------------------------- wire bytes


@contextlib.contextmanager
def counting_scans() -> Iterator[None]:
    """Trace every `jax.lax.scan` body inside `accounting.repeated(trip count)`, so that a
    wire ledger counts a scanned layer's messages once per layer, as the program sends them."""
    original = jax.lax.scan

    def scan(f, init, xs=None, length=None, *args, **kwargs):
        trips = length if length is not None else jax.tree.leaves(xs)[0].shape[0]

        def body(carry, x):
            with accounting.repeated(trips):
                return f(carry, x)

        return original(body, init, xs, length, *args, **kwargs)

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


@dataclasses.dataclass
class CompiledStep:
    """What the train step compiled to: its HLO text, the wire ledger of its trace (scans
    counted by trip count) and the mesh."""

    hlo: str = ""
    ledger: WireLedger = dataclasses.field(default_factory=WireLedger)
    mesh: Mesh | None = None


class _CapturingStep:
    """MaxText's jitted train step, recording its ledger when lowered and its HLO when
    compiled; everything else goes to the step."""

    def __init__(self, step: Any, captured: CompiledStep) -> None:
        self._step, self._captured = step, captured

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with record_wire() as ledger, counting_scans():
            lowered = self._step.lower(*args, **kwargs)
        self._captured.ledger = ledger
        captured = self._captured

        class Lowered:
            def __getattr__(self, name: str) -> Any:
                return getattr(lowered, name)

            def compile(self, *args: Any, **kwargs: Any) -> Any:
                compiled = lowered.compile(*args, **kwargs)
                captured.hlo = compiled.as_text()
                return compiled

        return Lowered()


@contextlib.contextmanager
def capturing_train_step() -> Iterator[CompiledStep]:
    """Inside the block, the train step MaxText's pre-training main compiles is captured
    (`CompiledStep`)."""
    train_utils = _maxtext_module("maxtext.utils.train_utils")
    original = train_utils.jit_train_and_eval_step
    captured = CompiledStep()

    def jit_train_and_eval_step(config, model, mesh, *args, **kwargs):
        train_step, eval_step = original(config, model, mesh, *args, **kwargs)
        captured.mesh = mesh
        return _CapturingStep(train_step, captured), eval_step

    train_utils.jit_train_and_eval_step = jit_train_and_eval_step
    try:
        yield captured
    finally:
        train_utils.jit_train_and_eval_step = original


def wire_summary(captured: CompiledStep, preset: str, layout: str, axis_name: str = "tensor") -> dict[str, Any]:
    """The `taco_wire.json` record of a compiled train step: bytes sent per step and
    device, from its HLO by mesh axes and element type (all of them, and those the
    rematerialisation recomputes), and the wire ledger of taco's own messages."""
    assert captured.mesh is not None
    by_axis = bytes_by_axis(captured.hlo, captured.mesh)
    axes = tuple(captured.mesh.axis_names)
    return {
        "maxtext": MAXTEXT_VERSION,
        "taco": preset,
        "layout": layout,
        "mesh": {name: int(size) for name, size in captured.mesh.shape.items() if size > 1},
        "hlo_bytes_by_axis": by_axis,
        "hlo_recomputed_bytes_by_axis": bytes_by_axis(captured.hlo, captured.mesh, recomputed=True),
        "tensor_bytes": sum(by_axis.get(axis_name, {}).values()),
        "tensor_bytes_f32_as_bf16": f32_as_bf16(by_axis.get(axis_name, {})),
        "ledger_tensor_bytes": captured.ledger.by_axis(axes).get(axis_name, 0),
        "ledger_tensor_bytes_bf16": captured.ledger.by_axis(axes, bf16=True).get(axis_name, 0),
        "ledger_by_site": captured.ledger.by_site(),
    }


def summary_line(summary: dict[str, Any], axis_name: str = "tensor") -> str:
    """One line: the tensor axis's bytes per step and device, its compressed messages
    against the same messages in bf16, and the other axes."""
    sent, bf16 = summary["ledger_tensor_bytes"], summary["ledger_tensor_bytes_bf16"]
    others = ", ".join(
        f"{axes} {sum(row.values()) / 1e6:.2f} MB"
        for axes, row in sorted(summary["hlo_bytes_by_axis"].items())
        if axes != axis_name
    )
    share = f"{100 * sent / bf16:.1f}% of their {bf16 / 1e6:.2f} MB in bf16" if bf16 else "none compressed"
    return (
        f"taco_jax: {axis_name} axis {summary['tensor_bytes'] / 1e6:.2f} MB per step and device "
        f"({summary['taco']}, layout {summary['layout']}); taco's messages {sent / 1e6:.2f} MB, {share}"
        + (f"; other axes {others}" if others else "")
    )


# ----------------------------------------------------------------------------- command line


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one `error:` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m taco_jax.integrations.maxtext",
        description="MaxText's pre-training main with taco_jax compressing the tensor axis's communication. "
        "Arguments other than ours are MaxText's own (key=value overrides, optionally a config .yml first).",
    )
    parser.add_argument("--taco", default="taco+", help=f"compression preset, one of {sorted(PRESETS)} (default taco+)")
    parser.add_argument(
        "--taco-layout", default="auto", help=f"activation layout, one of {list(LAYOUTS)} (default auto)"
    )
    parser.add_argument(
        "--taco-min-bytes",
        type=int,
        default=None,
        help="compress messages of at least this many bytes (default: the preset's, 8 MiB; 0 compresses all)",
    )
    parser.add_argument(
        "--calibrate-only",
        action="store_true",
        help=f"observe the first step's messages and write the per-site plan ({CALIBRATION_FILE}) into the run directory",
    )
    return parser


def _maxtext_config(maxtext_args: list[str]) -> Any:
    pyconfig = _maxtext_module("maxtext.configs.pyconfig")
    return pyconfig.initialize(["train", *maxtext_args])


def run_directory(config: Any) -> str:
    """MaxText's run directory: base_output_directory/run_name."""
    return os.path.join(config.base_output_directory, config.run_name)


def main(argv: list[str] | None = None) -> int:
    """Run MaxText's pre-training main with taco installed; print the wire summary and
    write `taco_wire.json` into the run directory."""
    args, maxtext_args = _parser().parse_known_args(argv)
    if args.taco not in PRESETS:
        print(f"error: unknown --taco preset {args.taco!r}; expected one of {sorted(PRESETS)}", file=sys.stderr)
        return 2
    if args.taco_layout not in LAYOUTS:
        print(f"error: unknown --taco-layout {args.taco_layout!r}; expected one of {list(LAYOUTS)}", file=sys.stderr)
        return 2
    quantization = [a.split("=", 1)[1] for a in maxtext_args if a.startswith("quantization=")]
    if quantization and quantization[-1]:
        print(f"error: {_both(quantization[-1])}", file=sys.stderr)
        return 2
    try:
        config = _maxtext_config(maxtext_args)
        check_config(config)
    except ValueError as error:  # MaxText's config errors span lines: one line here
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    run_dir = run_directory(config)
    calibration = _load_calibration(run_dir) if not args.calibrate_only else None
    overrides = {} if args.taco_min_bytes is None else {"min_bytes": args.taco_min_bytes}
    summary = run(
        maxtext_args,
        taco=TacoConfig.preset(args.taco, **overrides),
        preset=args.taco,
        layout=args.taco_layout,
        calibration=calibration,
        calibrate_only=args.calibrate_only,
    )
    print(summary_line(summary), file=sys.stderr)
    return 0


def _both(quantization: str) -> str:
    return (
        f"MaxText quantization={quantization!r} and taco both replace MaxText's matmuls: drop "
        "quantization= to run taco, or run MaxText's own train main for its quantization"
    )


def run(
    maxtext_args: Sequence[str],
    *,
    taco: TacoConfig | str | None = "taco+",
    layout: str = "auto",
    calibration: Calibration | None = None,
    calibrate_only: bool = False,
    preset: str | None = None,
) -> dict[str, Any]:
    """Run MaxText's pre-training main on `maxtext_args` with taco installed (`taco=None`:
    plain MaxText), capture the compiled train step, and write its wire summary to
    `taco_wire.json` in the run directory (with `calibrate_only`, the per-site plan to
    `taco_calibration.json` instead of training past the first step).

    Returns:
      The wire summary (`wire_summary`).
    """
    train = _maxtext_module("maxtext.trainers.pre_train.train")
    argv = ["train", *maxtext_args]
    preset = preset or (taco if isinstance(taco, str) else "custom" if taco is not None else "plain")
    if taco is not None:
        install(taco, layout=layout, calibration=calibration)
    from absl import logging as absl_logging  # MaxText's dependency

    absl_logging.set_verbosity(absl_logging.INFO)  # MaxText's progress lines, as under its own main
    try:
        with capturing_train_step() as captured, _observing(calibrate_only) as collector:
            train.main([*argv, "steps=1", "enable_checkpointing=false"] if calibrate_only else argv)
    finally:
        uninstall()
    config = _maxtext_config(list(maxtext_args))
    run_dir = run_directory(config)
    os.makedirs(run_dir, exist_ok=True)
    summary = wire_summary(captured, preset, _layout_of(layout, captured.mesh, config))
    summary["calibrated_sites"] = sorted({site for site, _, _ in calibration.plans}) if calibration else []
    if calibrate_only:
        assert isinstance(taco, (TacoConfig, str))
        _write_calibration(collector, TacoConfig.preset(taco) if isinstance(taco, str) else taco, run_dir)
    with open(os.path.join(run_dir, WIRE_FILE), "w") as file:
        file.write(strict_json.dumps(summary, indent=1))
    return summary


def _layout_of(layout: str, mesh: Mesh | None, config: Any) -> str:
    if mesh is None or "tensor" not in mesh.axis_names:
        return layout
    return TacoQuantization("off", mesh=mesh, layout=layout, rules=config.logical_axis_rules).resolved_layout()


# ----------------------------------------------------------------------------- calibration


@contextlib.contextmanager
def _observing(active: bool) -> Iterator[Collector | None]:
    if not active:
        yield None
        return
    collector = Collector()
    with observing(collector):
        yield collector


def _write_calibration(collector: Collector | None, config: TacoConfig, run_dir: str) -> str:
    """Decide the per-site plans from what was observed and write them beside MaxText's
    checkpoints, in the run directory."""
    assert collector is not None
    jax.effects_barrier()
    calibration, _ = calibrate(collector, config)
    path = os.path.join(run_dir, CALIBRATION_FILE)
    with open(path, "w") as file:
        file.write(strict_json.dumps(calibration.to_json(), indent=1))
    return path


def _load_calibration(run_dir: str) -> Calibration | None:
    """The run directory's per-site plan, if `--calibrate-only` wrote one."""
    path = os.path.join(run_dir, CALIBRATION_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return Calibration.from_json(json.load(file))


if __name__ == "__main__":
    sys.exit(main())
