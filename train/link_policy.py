"""The run's compression policy (`taco_policy`): where compressing the tensor-parallel
messages pays on the link at hand.

  "auto"    on GPUs with a tensor axis > 1: probe the link at start-up (each TP message
            shape of the model, plain vs compressed, `taco_jax.probe`), write the
            measured profile to OUT/link_profile.json and compress only the messages
            where compression was measured faster. On CPU or a simulated mesh there is
            no link to measure: every message is compressed (the codec runs, as the
            tests and the default CPU run expect).
  "always"  compress every message of at least taco_min_bytes.
  a path    a link_profile.json of an earlier probe on the same machine: reuse it.

`tp_overlap=auto` is decided by measurement too (`choose_overlap`), per site: on GPUs
with a tensor axis > 1 the step's gradients are timed with the collectives, with
collective matmuls at every site, and with them at each site alone; the sites that
alone beat the collectives are timed together, and the fastest of these settings is
used. Every time goes to OUT/overlap_probe.json. Elsewhere there is nothing to measure
and the collectives run as they are ("off").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import numpy as np

import taco_jax as tj
from taco_jax import strict_json
from taco_jax.mesh import TENSOR_AXIS
from taco_jax.models.layers import OVERLAP_SITES
from taco_jax.policy import LinkProfile
from taco_jax.probe import Message, probe_link

from .config import TrainConfig

PROFILE_FILE = "link_profile.json"
OVERLAP_FILE = "overlap_probe.json"
# Timed calls per setting of the tp_overlap=auto probe (after one to compile).
OVERLAP_PROBE_STEPS = 3
# Profiles measured by this process, by the path they are (or, off process 0, would be)
# written to: every process routes by the same profile without reading a shared file.
_measured: dict[str, LinkProfile] = {}


def load(path: str) -> LinkProfile:
    """The `LinkProfile` measured in this process for `path`, else read from that
    link_profile.json (cached: every step builder asks).

    Raises:
      ValueError: missing or malformed file.
    """
    if path in _measured:
        return _measured[path]
    return _read(path)


@functools.lru_cache(maxsize=8)
def _read(path: str) -> LinkProfile:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"taco_policy file {path} cannot be read: {error}") from None
    return LinkProfile.from_json(data.get("profile", data))


def link_for(cfg: TrainConfig) -> LinkProfile | None:
    """The profile the run's collectives route by (None: compress every message)."""
    return load(cfg.taco_policy) if cfg.taco_policy not in ("auto", "always") else None


def _why_not_probe(cfg: TrainConfig, mode: str) -> str | None:
    if mode == "off":
        return "compression is off"
    if cfg.mesh.tensor == 1:
        return "no tensor axis to compress"
    if cfg.simulate_mesh or jax.default_backend() != "gpu":
        return f"no link to measure on {'a simulated mesh' if cfg.simulate_mesh else jax.default_backend().upper()}"
    return None


def _why_not_time_overlap(cfg: TrainConfig) -> str | None:
    if cfg.mesh.tensor == 1:
        return "no tensor axis"
    if cfg.simulate_mesh or jax.default_backend() != "gpu":
        return f"no link to measure on {'a simulated mesh' if cfg.simulate_mesh else jax.default_backend().upper()}"
    return None


def choose_overlap(
    cfg: TrainConfig,
    time_step: Callable[[str], float],
    out: Path | None,
    log: Callable[[str], None] = print,
    *,
    measure: bool | None = None,
) -> TrainConfig:
    """Resolve tp_overlap="auto" into "off", "on" or the sites that gain.

    Args:
      cfg: the run's configuration.
      time_step: tp_overlap value -> seconds of the step's gradients run that way (the
        same on every process).
      out: run directory for overlap_probe.json (None: a process that writes nothing).
      log: one line per timing and the decision.
      measure: time even where `_why_not_time_overlap` finds nothing to measure (tests).

    Returns:
      `cfg` with tp_overlap "off", "on" or a comma-separated list of sites.
    """
    if cfg.tp_overlap != "auto":
        return cfg
    reason = _why_not_time_overlap(cfg)
    if reason is not None and not measure:
        log(f"tp_overlap=auto: off ({reason})")
        return cfg.with_keys(tp_overlap="off")
    times: dict[str, float] = {}

    def timed(setting: str) -> float:
        times[setting] = time_step(setting)
        log(f"tp_overlap=auto: {setting}: {1e3 * times[setting]:.2f} ms")
        return times[setting]

    plain = timed("off")
    timed("on")
    gaining = [site for site in OVERLAP_SITES if timed(site) < plain]
    if 1 < len(gaining) < len(OVERLAP_SITES):
        timed(",".join(gaining))
    chosen = min(times, key=times.__getitem__)
    log(f"tp_overlap=auto: -> {chosen}")
    if out is not None:
        (out / OVERLAP_FILE).write_text(strict_json.dumps({"seconds": times, "chosen": chosen}, indent=1))
    return cfg.with_keys(tp_overlap=chosen)


def choose(
    cfg: TrainConfig,
    mode: str,
    mesh,
    messages: Callable[[], Iterable[Message]],
    out: Path | None,
    log: Callable[[str], None] = print,
) -> TrainConfig:
    """Resolve taco_policy="auto" into "always" or a measured profile file.

    Args:
      cfg: the run's configuration.
      mode: the TACO mode of the run's preset.
      mesh: the device mesh.
      messages: returns the TP message shapes of one step (traced only when probing).
      out: run directory for link_profile.json (None: a process that writes nothing).
      log: progress and decision lines.

    Returns:
      `cfg` with taco_policy "always" or the profile's path.
    """
    if cfg.taco_policy != "auto":
        return cfg
    reason = _why_not_probe(cfg, mode)
    if reason is not None:
        log(f"taco_policy=auto: every message compressed ({reason})")
        return dataclasses.replace(cfg, taco_policy="always")
    config = tj.TacoConfig.preset(cfg.compression.tensor.preset)
    profile = probe_link(mesh, messages(), config, log=log)
    decisions = profile.decisions()
    for row in decisions:
        log(
            f"taco_policy=auto: {row['op']} {row['mib_per_rank']:.1f} MiB/rank: plain {row['plain_ms']:.3f} ms, "
            f"compressed {row['best_compressed_ms']:.3f} ms -> {row['route']}"
        )
    path = str(Path(cfg.out) / PROFILE_FILE)
    _measured[path] = profile
    if out is not None:
        Path(path).write_text(strict_json.dumps({"profile": profile.to_json(), "decisions": decisions}, indent=1))
    return dataclasses.replace(cfg, taco_policy=path)


def tp_messages(grads: Callable, args: tuple) -> list[Message]:
    """The compressed tensor-parallel message shapes `grads(*args)` sends (traced, not
    run): what the link probe times."""
    with tj.record_wire() as ledger:
        jax.jit(grads).lower(*args)
    return [
        Message(r.op.removesuffix("_one_shot").removesuffix("_two_shot"), r.shape, r.dtype)
        for r in ledger.records
        if r.compressed and r.axis == TENSOR_AXIS
    ]


def step_seconds(grads: Callable, args: tuple) -> float:
    """Median seconds of `grads(*args)` over `OVERLAP_PROBE_STEPS` calls after one that
    compiles; the slowest process's, so every process decides alike."""
    jitted = jax.jit(grads)
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(OVERLAP_PROBE_STEPS):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))
