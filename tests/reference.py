"""Independent float64 numpy implementation of the codec math, for tests."""

import numpy as np

FORMATS = {  # name: (max, mantissa bits, min normal exponent, integer)
    "e4m3": (448.0, 3, -6, False),
    "e5m2": (57344.0, 2, -14, False),
    "int8": (127.0, 0, 0, True),
    "int4": (7.0, 0, 0, True),
    # The OCP MX sub-byte floats (no Inf or NaN codes).
    "e2m3": (7.5, 3, 0, False),
    "e3m2": (28.0, 2, -2, False),
    "e2m1": (6.0, 1, 0, False),
}


def hadamard(size):
    h = np.array([[1.0]])
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(size)


def round_to_grid(v, fmt):
    """Clip to +-max, then round to nearest even on the format's grid (float64)."""
    fmax, mbits, emin, integer = FORMATS[fmt]
    v = np.clip(v, -fmax, fmax)
    if integer:
        return np.round(v)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.abs(v)))
    exponent = np.maximum(np.where(np.isfinite(exponent), exponent, emin), emin)
    quantum = 2.0 ** (exponent - mbits)
    return np.round(v / quantum) * quantum


def compress(x, fmt, group_size, hadamard_on, scales):
    """Returns (codes as float64 values, a, s, dequant multiplier) per group."""
    fmax = FORMATS[fmt][0]
    g = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, group_size)
    rms = np.sqrt(np.mean(g**2, axis=-1, keepdims=True))
    with np.errstate(divide="ignore"):
        a = np.clip(fmax / rms, 2.0**-100, 2.0**100)
    y = a * g
    if hadamard_on:
        y = y @ hadamard(group_size)
    s = np.maximum(np.max(np.abs(y), axis=-1, keepdims=True) / fmax, 2.0**-126)
    if scales == "e8m0":
        multiplier = 2.0 ** np.clip(np.ceil(np.log2(s / a)), -126, 127)
        divisor = a * multiplier
    elif scales == "bf16":
        quantum = 2.0 ** (np.floor(np.log2(s / a)) - 7)
        multiplier = np.ceil(s / a / quantum) * quantum
        divisor = a * multiplier
    else:
        multiplier, divisor = s / a, s
    codes = round_to_grid(y / divisor, fmt)
    return codes, a, s, multiplier


def decompress(codes, multiplier, hadamard_on, group_size):
    v = codes @ hadamard(group_size) if hadamard_on else codes
    return v * multiplier


def as_float64(x):
    """Any array (bf16, fp8, int8 included) as float64 numpy."""
    return np.asarray(x).astype(np.float64)
