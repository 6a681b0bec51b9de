"""The compression policy: what each message is sent as, and where compression pays.

What: a `QuantSpec` per direction (format, group size, transform, scales, rounding)
in a `TacoConfig`, with named presets (`PRESETS`).

Where: how each message travels (compressed or not, which all-reduce algorithm, how
many pipelined chunks), decided from measured times on the link at hand. Without a
`LinkProfile` the collectives compress every message of at least
`TacoConfig.min_bytes` with the static defaults below. With one (`TacoConfig.link`,
measured by `taco_jax.probe.probe_link` on the mesh itself), each message takes the
fastest measured route for its op at the nearest measured size, and stays uncompressed
unless compression was measured at least `margin` faster than the plain collective: on
a fast link (NVLink) the codec can cost more than the bytes it saves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from taco_jax.accounting import Op
from taco_jax.kernels.formats import SCALE_ENCODINGS, WIRE_FORMATS

MODES = ("off", "fp8", "taco")
# Where the codec runs. "gpu": the GPU kernels (Gluon where they take the work, Pallas
# elsewhere); "interpret": the Pallas kernels in the Pallas interpreter (CPU tests);
# "jnp": the plain jnp path; "auto": "gpu" where the program is lowered for a CUDA GPU,
# "jnp" elsewhere. Work no kernel takes runs the jnp path in every mode.
KERNEL_MODES = ("auto", "gpu", "interpret", "jnp")
# How a value is rounded onto the wire grid: to nearest (ties to even), or stochastically
# (unbiased; the integer grids and the sub-byte floats, on the jnp path).
ROUNDINGS = ("nearest", "stochastic")
DEFAULT_MIN_BYTES = 8 << 20  # the authors' threshold: smaller messages stay uncompressed
# Group sizes a spec takes (`QuantSpec`): below 16 the scales cost more than a quarter of
# the payload's bits in the dual format; above 1024 nothing is left to save (bf16 scales
# are 0.2% of an 8-bit payload at 1024), the transform's cost keeps growing with G, and
# the 8-bit formats' scales would need headroom to hold float32's largest values.
MIN_GROUP_SIZE = 16
MAX_GROUP_SIZE = 1024


def check_kernel_mode(kernel_mode: str) -> None:
    """Raise ValueError unless `kernel_mode` is one of `KERNEL_MODES` (naming the mode that
    replaced an old one)."""
    if kernel_mode not in KERNEL_MODES:
        hint = '; "pallas" is now "gpu" (Gluon where it takes the work, else Pallas)' if kernel_mode == "pallas" else ""
        raise ValueError(f"unknown kernel mode {kernel_mode!r}; expected one of {list(KERNEL_MODES)}{hint}")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one direction of a tensor-parallel collective is quantized.

    Attributes:
      fmt: element format on the wire, a key of `WIRE_FORMATS` (defining a
        `pallas_kernels.formats.WireFormat` class adds one): "e4m3", "e5m2" or "int8";
        below 8 bits, packed: "int5", "int4" (two per byte), the OCP MX floats "e2m3"
        and "e3m2" (6 bits, four per three bytes) and "e2m1" (4 bits), on the Gluon
        kernels on a GPU where a group's codes fill whole 32-bit words, else the jnp path.
      group_size: G, contiguous elements of the last axis sharing one scale; a power of
        two (the Hadamard transform needs one) from `MIN_GROUP_SIZE` (16: below it the
        scales cost more than a quarter of the payload's bits) to `MAX_GROUP_SIZE` (1024:
        the scales are 0.2% of an 8-bit payload there, while the transform's cost keeps
        growing with G), and at most the channels of the tensors it meets
        (`check_channels`: a larger group pads every row up to G).
      hadamard: apply the adaptive-scale Walsh-Hadamard transform per group.
      scales: per-group scale encoding, a key of `SCALE_ENCODINGS`: "dual" (the
        authors' FP32 pre-scale and quantization scale, 8 bytes/group), "single" (one
        FP32 s/a, 4 bytes), "bf16" (s/a rounded up to bfloat16, 2 bytes) or "e8m0" (one
        byte, a power-of-two scale).
      rounding: "nearest" (ties to even) or "stochastic": up or down with the
        probabilities that make the expected code the value, from a hash of each value's
        bits, its position and the vmap slice and shard_map device it is on
        (`pallas_kernels.wire.dither`: reproducible, the same jitted and eager, new
        each step as the tensors are, independent across slices and devices), for
        gradient messages in the formats that take it (`WireFormat.stochastic_rounding`:
        the integer and sub-byte float formats); it runs the jnp path.
    """

    fmt: str = "e4m3"
    group_size: int = 128
    hadamard: bool = True
    scales: str = "dual"
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.fmt not in WIRE_FORMATS:
            raise ValueError(f"unknown format {self.fmt!r}; expected one of {sorted(WIRE_FORMATS)}")
        if self.scales not in SCALE_ENCODINGS:
            raise ValueError(f"unknown scale format {self.scales!r}; expected one of {sorted(SCALE_ENCODINGS)}")
        size = self.group_size
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not MIN_GROUP_SIZE <= size <= MAX_GROUP_SIZE
            or size & (size - 1)
        ):
            raise ValueError(
                f"group_size must be a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, got {size!r}"
            )
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard must be a bool, got {self.hadamard!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}; expected one of {list(ROUNDINGS)}")
        if self.stochastic and not WIRE_FORMATS[self.fmt].stochastic_rounding:
            raise ValueError(
                f"stochastic rounding takes the integer and sub-byte float formats, not {self.fmt!r} "
                "(its cast rounds to nearest)"
            )

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """A spec from "fmt:group_size:H|-:scales[:sr]", e.g. "int8:128:H:bf16" (":sr":
        stochastic rounding).

        Raises:
          ValueError: not a string, malformed text (a group size in anything but ASCII
            digits included) or an invalid field.

        Examples:
          >>> spec = QuantSpec.parse("int8:128:H:bf16")
          >>> spec.fmt, spec.group_size, spec.hadamard, spec.scales
          ('int8', 128, True, 'bf16')
          >>> spec.bits_per_element
          8.125
        """
        if not isinstance(text, str):
            raise ValueError(f"quantizer spec must be a string fmt:group_size:H|-:scales[:sr], got {text!r}")
        parts = text.split(":")
        if (
            len(parts) not in (4, 5)
            or parts[2] not in ("H", "-")
            or not (parts[1].isascii() and parts[1].isdigit())  # int() reads any script's digits
            or parts[4:] not in ([], ["sr"])
        ):
            raise ValueError(f"quantizer spec {text!r} is not fmt:group_size:H|-:scales[:sr] (e.g. int8:128:H:bf16)")
        rounding = "stochastic" if parts[4:] else "nearest"
        return cls(parts[0], int(parts[1]), parts[2] == "H", parts[3], rounding)

    def check_channels(self, channels: int, site: str) -> None:
        """Raise ValueError unless a message with `channels` channels (its last axis) at
        `site` can take this spec's groups: G at most the channels, since every row is
        padded up to whole groups (G = 4096 on 256 channels sends 16 times the payload).

        Args:
          channels: the message's last axis.
          site: the call site, named in the error.

        Raises:
          ValueError: the group size exceeds the channels.

        Examples:
          >>> QuantSpec.parse("int8:128:H:bf16").check_channels(64, "mlp.out")
          Traceback (most recent call last):
          ...
          ValueError: site 'mlp.out': group size 128 (int8:128:H:bf16) exceeds the message's 64 channels ...
        """
        if self.group_size > channels:
            largest = 1 << (channels.bit_length() - 1) if channels > 0 else 0
            fix = (
                f"use a spec with group_size <= {largest} (`TacoConfig.with_group_size`)"
                if largest >= MIN_GROUP_SIZE
                else f"no group size fits (at least {MIN_GROUP_SIZE}): send it plain (a min_bytes above its size, or the lax collective)"
            )
            raise ValueError(
                f"site {site!r}: group size {self.group_size} ({self.text}) exceeds the message's {channels} "
                f"channels (its last axis); {fix}"
            )

    @property
    def text(self) -> str:
        """The spec as `parse` reads it, e.g. "int8:128:H:bf16"."""
        rounding = ":sr" if self.stochastic else ""
        return f"{self.fmt}:{self.group_size}:{'H' if self.hadamard else '-'}:{self.scales}{rounding}"

    @property
    def stochastic(self) -> bool:
        """Whether values are rounded stochastically."""
        return self.rounding == "stochastic"

    @property
    def element_bits(self) -> int:
        """Wire bits per element."""
        return WIRE_FORMATS[self.fmt].bits

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element with the scales: payload bits plus a group's scale bits
        spread over its elements."""
        return self.element_bits + 8 * self.scale_bytes / self.group_size

    @property
    def scale_bytes(self) -> int:
        """Wire bytes of one group's scales."""
        return SCALE_ENCODINGS[self.scales].bytes_per_group


_TACO = QuantSpec(fmt="e4m3", group_size=128, hadamard=True, scales="dual")


def check_fewer_bits(candidates: tuple[QuantSpec, ...], replaced: QuantSpec, what: str) -> None:
    """Raise ValueError unless every candidate sends fewer wire bits per element (scales
    included) than `replaced`, the spec `what` names: a candidate is only ever chosen
    in its place, to save bytes."""
    for candidate in candidates:
        if candidate.bits_per_element >= replaced.bits_per_element:
            raise ValueError(
                f"fewer_bits candidate {candidate.text} sends {candidate.bits_per_element:g} bits per element, "
                f"not fewer than {what} {replaced.text} ({replaced.bits_per_element:g})"
            )


@dataclasses.dataclass(frozen=True)
class FewerBits:
    """Formats below the config's own, chosen per call site and direction by calibration
    (`taco_jax.calibration.calibrate`) from the measured error on the site's tensors.

    Each site and direction takes the candidate with the fewest wire bits per element
    whose relative RMS error on the site's sampled tensors (with its best permutation and
    transform) is at most the direction's tolerance (`tolerance_for`) times
    `reference`'s; where none fits, and before calibration, it keeps the config's spec.
    The directions may differ: activations (forward) need about 6 bits where activation
    gradients (backward) hold at 4 (`benchmarks/results/quality_bits_direction.md`).

    Attributes:
      candidates: the `QuantSpec`s to try, each with fewer wire bits per element than
        `reference` (and than the config's specs they replace, `TacoConfig`).
      reference: the spec whose error sets the budget: by default the authors' 8-bit
        E4M3 codec, which holds validation loss within 0.15% of bf16
        (`benchmarks/RESULTS.md`).
      tolerance: the budget as a multiple of the reference's error, in both directions
        unless one of the two below is set.
      forward_tolerance: the forward messages' budget; None: `tolerance`.
      backward_tolerance: the backward messages' budget; None: `tolerance`.

    Examples:
      >>> fewer = FewerBits((QuantSpec.parse("int4:32:H:bf16"),), backward_tolerance=3.0)
      >>> fewer.tolerance_for("forward"), fewer.tolerance_for("backward")
      (1.5, 3.0)
    """

    candidates: tuple[QuantSpec, ...]
    reference: QuantSpec = _TACO
    tolerance: float = 1.5
    forward_tolerance: float | None = None
    backward_tolerance: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.candidates, tuple) or not self.candidates:
            raise ValueError(f"FewerBits.candidates must be a non-empty tuple of QuantSpecs, got {self.candidates!r}")
        for spec in (*self.candidates, self.reference):
            if not isinstance(spec, QuantSpec):
                raise ValueError(f"FewerBits specs must be QuantSpecs, got {spec!r}")
        for name in ("tolerance", "forward_tolerance", "backward_tolerance"):
            tolerance = getattr(self, name)
            if tolerance is None and name != "tolerance":
                continue
            if (
                isinstance(tolerance, bool)
                or not isinstance(tolerance, int | float)
                or not 0 < tolerance < float("inf")
            ):
                raise ValueError(f"FewerBits.{name} must be a positive finite number, got {tolerance!r}")
        check_fewer_bits(self.candidates, self.reference, "the reference")

    def tolerance_for(self, direction: str) -> float:
        """The budget of `direction` ("forward" or "backward") as a multiple of the
        reference's error.

        Raises:
          ValueError: unknown direction.
        """
        if direction not in ("forward", "backward"):
            raise ValueError(f"unknown direction {direction!r}; expected 'forward' or 'backward'")
        own = self.forward_tolerance if direction == "forward" else self.backward_tolerance
        return self.tolerance if own is None else own


@dataclasses.dataclass(frozen=True)
class TacoConfig:
    """Compression settings for the tensor-parallel collectives of a model.

    Attributes:
      forward: spec for forward-pass messages (activations).
      backward: spec for backward-pass messages (activation gradients); DSQ keeps the
        two separate.
      min_bytes: messages smaller than this (in the input dtype) stay uncompressed.
      mode: "off" (plain collectives), "fp8" (per-group absmax, no transform, no
        reshaping: the naive baseline) or "taco" (transform and calibrated reshaping).
      chunks: pieces a compressed message is split into and pipelined (the codec of
        one piece runs while another is on the wire); used where `link` decides nothing.
      link: measured times of the link (`taco_jax.probe.probe_link`); with it, each
        message takes the fastest measured route and stays uncompressed where
        compression was not measured faster (`taco_jax.policy`). None: compress every
        message of at least `min_bytes`.
      kernel_mode: where the codec runs, one of `KERNEL_MODES`: "auto" (the GPU kernels
        where the program is lowered for a CUDA GPU, the jnp path elsewhere), "gpu" (the
        Gluon kernels where they take the work, else the Pallas ones), "interpret" or
        "jnp". Part of the
        config, so a jitted function compiled with one mode is never reused for another.
      fewer_bits: formats below `forward` / `backward` that calibration may give each
        site and direction (`FewerBits`); None: every site keeps the config's specs.
    """

    forward: QuantSpec = QuantSpec()
    backward: QuantSpec = QuantSpec()
    min_bytes: int = DEFAULT_MIN_BYTES
    mode: str = "taco"
    chunks: int = 1
    link: LinkProfile | None = None
    kernel_mode: str = "auto"
    fewer_bits: FewerBits | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {list(MODES)}")
        for name in ("forward", "backward"):
            if not isinstance(getattr(self, name), QuantSpec):
                raise ValueError(f"TacoConfig.{name} must be a QuantSpec, got {getattr(self, name)!r}")
        if self.mode == "fp8" and (self.forward.hadamard or self.backward.hadamard):
            raise ValueError("mode 'fp8' is the no-transform baseline: set hadamard=False in both specs")
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {self.min_bytes!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {self.chunks!r}")
        check_kernel_mode(self.kernel_mode)
        if self.link is not None and not isinstance(self.link, LinkProfile):
            raise ValueError(f"link must be a taco_jax.policy.LinkProfile or None, got {type(self.link).__name__}")
        if self.fewer_bits is not None and not isinstance(self.fewer_bits, FewerBits):
            raise ValueError(f"fewer_bits must be a taco_jax.FewerBits or None, got {type(self.fewer_bits).__name__}")
        if self.fewer_bits is not None and self.mode != "taco":
            raise ValueError(f"fewer_bits is chosen by calibration, which runs in mode 'taco' only, not {self.mode!r}")
        if self.fewer_bits is not None:
            for name in ("forward", "backward"):
                check_fewer_bits(self.fewer_bits.candidates, getattr(self, name), f"TacoConfig.{name}")

    @property
    def enabled(self) -> bool:
        """Whether any collective is compressed."""
        return self.mode != "off"

    def compresses(self, nbytes: int) -> bool:
        """Whether a message of `nbytes` (input dtype) is sent compressed."""
        return self.enabled and nbytes >= self.min_bytes

    def spec(self, direction: str) -> QuantSpec:
        """The quantizer of `direction`'s messages: `forward` for "forward", else `backward`."""
        return self.forward if direction == "forward" else self.backward

    def with_group_size(self, group_size: int) -> TacoConfig:
        """This configuration with groups of `group_size` in both directions: for models
        whose messages have fewer channels than the preset's groups (`check_channels`).

        Examples:
          >>> TacoConfig.preset("taco+").with_group_size(32).forward.text
          'int8:32:H:bf16'
        """
        return dataclasses.replace(
            self,
            forward=dataclasses.replace(self.forward, group_size=group_size),
            backward=dataclasses.replace(self.backward, group_size=group_size),
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TacoConfig:
        """A named configuration.

        Args:
          name: "off", "fp8", "taco", "taco+", "taco+mixed", "taco6-4" or "taco4" (see
            `PRESETS`).
          **overrides: fields to replace, e.g. `min_bytes=0`.

        Returns:
          The `TacoConfig`.

        Raises:
          ValueError: unknown preset name or field.

        Examples:
          >>> config = TacoConfig.preset("taco+", min_bytes=0)
          >>> config.forward.text, config.backward.text
          ('int8:128:H:bf16', 'int8:128:H:bf16')
          >>> config.compresses(1024), TacoConfig.preset("taco+").compresses(1024)
          (True, False)
        """
        try:
            config = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown TACO preset {name!r}; expected one of {sorted(PRESETS)}") from None
        try:
            return dataclasses.replace(config, **overrides)
        except TypeError as error:
            raise ValueError(f"bad override for preset {name!r}: {error}") from None


_NAIVE_FP8 = QuantSpec(fmt="e4m3", group_size=128, hadamard=False, scales="single")
_INT8_HADAMARD = QuantSpec(fmt="int8", group_size=128, hadamard=True, scales="bf16")
# Round-trip error on Gaussian, heavy-tailed and outlier-channel tensors (2048 x 1024,
# `benchmarks/RESULTS.md`): E2M3 G=128 2.5-2.7% at 38.3% of bf16's bytes, as E4M3's
# 2.6% at 53.1% (on log-normal channel scales 2.6% against E4M3's best 1.9%); INT4 G=32
# 5.1-9.7% at 28.1%, below E2M1's 10.1-12.2% at the same bytes.
_E2M3 = QuantSpec(fmt="e2m3", group_size=128, hadamard=True, scales="bf16")
_INT4_32 = QuantSpec(fmt="int4", group_size=32, hadamard=True, scales="bf16")

PRESETS: dict[str, TacoConfig] = {
    # Plain bf16/f32 collectives.
    "off": TacoConfig(_NAIVE_FP8, _NAIVE_FP8, mode="off"),
    # Per-group absmax E4M3, no transform: the naive baseline.
    "fp8": TacoConfig(_NAIVE_FP8, _NAIVE_FP8, mode="fp8"),
    # The authors' method: E4M3, G=128, adaptive-scale Hadamard, dual FP32 scales.
    "taco": TacoConfig(_TACO, _TACO, mode="taco"),
    # INT8 after the Hadamard transform, one bfloat16 scale per group (50.8% of bf16 bytes):
    # lower error on measured TP tensors (benchmarks/codec_error.py, docs/guides/codec.md).
    "taco+": TacoConfig(_INT8_HADAMARD, _INT8_HADAMARD, mode="taco"),
    # taco+ where calibration measures no fit; elsewhere, per site and direction, the
    # fewest bits within 1.5x the E4M3 codec's error: INT4 G=32 (28.1% of bf16's bytes),
    # else E2M3 G=128 (38.3%; 1.0-1.4x E4M3's error on the tensors measured, INT4 2-5x).
    # Needs calibration (the trainer's calibration_steps).
    "taco+mixed": TacoConfig(
        _INT8_HADAMARD, _INT8_HADAMARD, mode="taco", fewer_bits=FewerBits(candidates=(_INT4_32, _E2M3))
    ),
    # Bits per direction: activations (forward) in 6-bit E2M3 G=128, activation gradients
    # (backward) in INT4 G=32, both with the transform and bfloat16 scales (33.2% of
    # bf16's bytes in a step that sends as much each way). On one H100 (40M GPT-2 and
    # Qwen2, 1600 steps, 4 seeds) its paired val-loss gap to bf16 is within one standard
    # error of zero on Shakespeare; INT4 forward costs 1.5-2% (`benchmarks/results/
    # quality_bits_direction.md`). On Python code it costs about 0.5% (`quality_bits.md`).
    "taco6-4": TacoConfig(_E2M3, _INT4_32, mode="taco"),
    # Every message in 4 bits: INT4, groups of 32, bfloat16 scales (28.1% of bf16's bytes).
    "taco4": TacoConfig(_INT4_32, _INT4_32, mode="taco"),
}


# ----------------------------------------------------------------------------- whether a message may be compressed


def check_algorithm(algorithm: str) -> None:
    """Raise ValueError unless `algorithm` is one of `ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")


def size_or_kind_rules_out(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> str | None:
    """What keeps `x` off the codec under `config` whatever the link, or None: the mode,
    a dtype that is not floating-point, a scalar or an empty array (no channels to group,
    nothing to send) or a size under `min_bytes`."""
    nbytes = x.size * x.dtype.itemsize
    if not config.enabled:
        return "mode off"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return f"{jnp.dtype(x.dtype).name} is not floating-point"
    if x.ndim == 0 or x.size == 0:
        return "scalar or empty: no channels to group"
    if not config.compresses(nbytes):
        return f"under min_bytes ({nbytes:,} < {config.min_bytes:,} B)"
    return None


def plain_reason(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> str:
    """Why `config` sends `x` uncompressed (`plan_message` gave no plan): what rules it
    out (`size_or_kind_rules_out`), else the link profile, which measured the plain
    collective faster."""
    return size_or_kind_rules_out(x, config) or "the link profile measured plain faster"


def compressible(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> bool:
    """Whether `config` compresses `x` where the link does not decide: a non-empty float
    array with at least one axis, of at least `min_bytes`."""
    return size_or_kind_rules_out(x, config) is None


# ----------------------------------------------------------------------------- routes

# The ops a route is chosen for (a link profile times them; `taco_jax.probe`).
OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE)
ALGORITHMS = ("one_shot", "two_shot", "auto")
# On a GPU link, under this size (input bytes per rank) "auto" picks the one-shot
# all-reduce: a single all-gather step costs less latency than the two steps of the
# two-shot algorithm. At two ranks one-shot always wins: it sends the same bytes in one
# step and quantizes once.
ONE_SHOT_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Route:
    """How one message travels.

    Attributes:
      compressed: sent through the codec (else the plain lax collective).
      algorithm: "one_shot" or "two_shot" (all-reduce only).
      chunks: pieces the message is split into, each compressed, sent and decoded in
        turn, so the codec of one piece can run while another is on the wire.
    """

    compressed: bool
    algorithm: str = "one_shot"
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"Route.algorithm must be 'one_shot' or 'two_shot', got {self.algorithm!r}")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"Route.chunks must be a positive int, got {self.chunks!r}")

    @property
    def name(self) -> str:
        """A short label, e.g. "plain" or "one_shot/4"."""
        return f"{self.algorithm}/{self.chunks}" if self.compressed else "plain"


def default_algorithm(ranks: int, nbytes: int) -> str:
    """The all-reduce algorithm "auto" picks without a link profile.

    On GPUs latency decides (`ONE_SHOT_MAX_BYTES`). Elsewhere there is no link whose
    latency could be measured, so bytes decide: per rank, one-shot sends k - 1 compressed
    copies of the message and two-shot 2 (k - 1) / k, fewer for every k > 2 (at 4 ranks
    one-shot would send more than a bf16 ring all-reduce).

    Examples:
      >>> from taco_jax import policy
      >>> policy.default_algorithm(2, 64 << 20)  # two ranks: one exchange, one quantization
      'one_shot'
    """
    if ranks <= 2:
        return "one_shot"
    if jax.default_backend() != "gpu":
        return "two_shot"
    return "one_shot" if nbytes < ONE_SHOT_MAX_BYTES else "two_shot"


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measured route: `ms` for `op` over `ranks` ranks, `nbytes` input bytes per rank."""

    op: str
    ranks: int
    nbytes: int
    route: Route
    ms: float


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """Measured times of the candidate routes on one mesh axis, and the decision rule.

    Attributes:
      timings: the measurements (`taco_jax.probe.probe_link`).
      margin: compress only where the best compressed route was measured at least this
        fraction faster than the plain collective (noise and the interaction with
        computation in a real step eat small gains).
      description: where and how it was measured (device, link), for reports.
    """

    timings: tuple[Timing, ...]
    margin: float = 0.05
    description: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"LinkProfile.margin must be in [0, 1), got {self.margin!r}")
        for t in self.timings:
            if t.op not in OPS or not math.isfinite(t.ms) or t.ms <= 0:
                raise ValueError(
                    f"bad timing {t}: op must be one of {[op.value for op in OPS]} and ms a positive number"
                )

    def route(self, op: str, ranks: int, nbytes: int) -> Route | None:
        """The route for a message, from the timings at the nearest measured size (in
        ratio); None when nothing was measured for this op and axis size.

        Deterministic: ties go to fewer chunks, then to the one-shot algorithm.
        """
        measured = [t for t in self.timings if t.op == op and t.ranks == ranks]
        if not measured:
            return None
        size = min({t.nbytes for t in measured}, key=lambda s: (abs(math.log(s / max(nbytes, 1))), s))
        at_size = [t for t in measured if t.nbytes == size]
        plain = [t.ms for t in at_size if not t.route.compressed]
        compressed = sorted(
            (t for t in at_size if t.route.compressed), key=lambda t: (t.ms, t.route.chunks, t.route.algorithm)
        )
        if not compressed or (plain and compressed[0].ms > min(plain) * (1 - self.margin)):
            return Route(False)
        return compressed[0].route

    def decisions(self) -> list[dict[str, Any]]:
        """Per measured (op, ranks, size): the plain and best compressed times and the
        route taken, for reports."""
        rows = []
        for op, ranks, nbytes in sorted({(t.op, t.ranks, t.nbytes) for t in self.timings}):
            at = [t for t in self.timings if (t.op, t.ranks, t.nbytes) == (op, ranks, nbytes)]
            plain = min((t.ms for t in at if not t.route.compressed), default=None)
            best = min((t for t in at if t.route.compressed), key=lambda t: t.ms, default=None)
            rows.append(
                {
                    "op": op,
                    "ranks": ranks,
                    "mib_per_rank": nbytes / 2**20,
                    "plain_ms": plain,
                    "best_compressed": best.route.name if best else None,
                    "best_compressed_ms": best.ms if best else None,
                    "route": route.name if (route := self.route(op, ranks, nbytes)) else None,
                }
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (`from_json` reads it back)."""
        return {
            "margin": self.margin,
            "description": self.description,
            "timings": [
                {"op": t.op, "ranks": t.ranks, "nbytes": t.nbytes, "ms": t.ms, **dataclasses.asdict(t.route)}
                for t in self.timings
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkProfile:
        """Read `to_json` output.

        Raises:
          ValueError: malformed data.
        """
        try:
            timings = tuple(
                Timing(
                    t["op"],
                    int(t["ranks"]),
                    int(t["nbytes"]),
                    Route(bool(t["compressed"]), t["algorithm"], int(t["chunks"])),
                    float(t["ms"]),
                )
                for t in data["timings"]
            )
            return cls(timings, float(data.get("margin", 0.05)), str(data.get("description", "")))
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed link profile: {error!r}") from None


def route_for(
    op: str, ranks: int, nbytes: int, *, compresses: bool, link: LinkProfile | None, chunks: int, algorithm: str
) -> Route:
    """How a message travels.

    Args:
      op: the `Op` (or its name): all-gather, reduce-scatter, all-reduce or ppermute.
      ranks: size of the mesh axis.
      nbytes: input bytes per rank.
      compresses: whether the config compresses a message of this size at all (mode
        and `min_bytes`).
      link: measured profile of the link, or None for the static defaults.
      chunks: the config's chunk count (used without a profile).
      algorithm: the caller's all-reduce algorithm; "auto" leaves it to the profile or
        `default_algorithm`.

    Returns:
      The `Route`.
    """
    if not compresses:
        return Route(False)
    measured = link.route(op, ranks, nbytes) if link is not None else None
    if measured is None:
        if op != Op.ALL_REDUCE:  # the algorithm only names how an all-reduce travels
            return Route(True, chunks=chunks)
        return Route(True, default_algorithm(ranks, nbytes) if algorithm == "auto" else algorithm, chunks)
    if measured.compressed and algorithm != "auto":
        return dataclasses.replace(measured, algorithm=algorithm)
    return measured
