"""Test configuration: 8 simulated CPU devices (set before jax is imported) and markers.

On a GPU, several pytest workers (`-n 4`) share it: each allocates what it needs instead
of JAX's default 75% of the memory up front.

Compiles dominate the suite's time, and many tests (the trainer's runs, its CLI
subprocesses, restarts after a kill) compile the same programs again: JAX's persistent
compilation cache, shared by the workers and their subprocesses through the environment,
compiles each once. Its entries are keyed by the program and the jax/XLA versions."""

import os
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / "build" / "jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (a fixed seed, no example database).
settings.register_profile("fixed_seed", derandomize=True, database=None)
settings.load_profile("fixed_seed")


def cpu_env(devices: int) -> dict[str, str]:
    """The environment of a subprocess on `devices` simulated CPU devices that compiles
    as this process does: the leg's XLA flags, with the device count replaced."""
    flags = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
    return {
        **os.environ,
        "XLA_FLAGS": " ".join([f"--xla_force_host_platform_device_count={devices}", *flags]),
        "JAX_PLATFORMS": "cpu",
    }


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _fast_compiles() -> bool:
    """Whether XLA compiles without its backend optimizations (both legs of `make test`):
    two separately compiled programs may then round float8 casts differently, and an
    interpreted kernel's sums drift (`production_compiler`)."""
    return "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]


def pytest_collection_modifyitems(config, items):
    _cover_products(items)
    if _fast_compiles():
        skip = pytest.mark.skip(reason="needs the production compiler's numerics: runs with it on the newest leg")
        for item in items:
            if "production_compiler" in item.keywords:
                item.add_marker(skip)
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _cover_products(items) -> None:
    """Of a test marked `cover`, the cases that bring no parameter value its earlier cases
    did not are marked `slow`: `make test` runs a covering set (every value of every
    parameter at least once), `make test-slow` the rest of the product."""
    cases = defaultdict(list)
    for item in items:
        if item.get_closest_marker("cover") is not None:
            cases[(item.path, item.originalname)].append(item)
    for group in cases.values():
        seen: set[tuple[str, str]] = set()
        for item in group:
            values = {(name, repr(value)) for name, value in item.callspec.params.items()}
            if values <= seen:
                item.add_marker(pytest.mark.slow)
            seen |= values
