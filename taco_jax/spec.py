"""Quantizer specifications and the TACO configuration with named presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from taco_jax.kernels.formats import SCALE_ENCODINGS, WIRE_FORMATS
from taco_jax.policy import LinkProfile

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
        below 8 bits, packed and run by the jnp path (no kernel yet): "int4" (two per
        byte), the OCP MX floats "e2m3" and "e3m2" (6 bits, four per three bytes) and
        "e2m1" (4 bits).
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
        (`pallas_kernels.elementwise.dither`: reproducible, the same jitted and eager, new
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
