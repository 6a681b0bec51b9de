"""Data-driven reshaping: per-site channel permutations and the transform decision,
from statistics of the tensors each compressed collective actually sends.

A permutation reorders the channels (last axis) before grouping, so that each group of G
channels is well conditioned for the codec. Strategies, from per-channel RMS:

| strategy | order |
|---|---|
| `identity` | no reordering (the state before calibration) |
| `cluster` | channels sorted by RMS: each group holds channels of similar magnitude |
| `interleave` | sorted channels dealt round-robin over the groups: each group gets a mix of high- and low-energy channels |

How it runs: inside `with observing(collector):` every compressed collective traced
reports, per call site and direction, the per-channel sum of squares of what it would
send and a strided sample of its rows (a host callback; the values are reduced over all
local devices and, in multi-process runs, over processes). `calibrate` turns that into a
`Calibration`: for each site and direction the permutation and whether the Walsh-Hadamard
transform is on, chosen by the measured codec error on the site's own samples, and, where
the config names formats with fewer bits (`TacoConfig.fewer_bits`), the fewest-bit one
whose error fits the budget. Pass it
to the collectives / `taco_jax.tp` mappings (`calibration=`) or to the models
(`Parallelism.calibration`); it is static (part of the compiled program), saved with
checkpoints as JSON (`to_json` / `from_json`), and the empty `Calibration()` means
identity permutations and the config's own transform setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from taco_jax import accounting
from taco_jax.codec import check_permutation, compress, decompress
from taco_jax.policy import FewerBits, QuantSpec, TacoConfig

STRATEGIES = ("identity", "cluster", "interleave")
METRICS = ("channel_median", "rel_rmse")
DIRECTIONS = ("forward", "backward")
# A permutation must cut the codec error by this fraction to be worth its two gathers.
DEFAULT_MIN_GAIN = 0.1
SAMPLE_ROWS = 64  # rows sampled per observed message
MAX_SAMPLE_ROWS = 4096  # rows kept per site and direction for the codec-error decision


# ----------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class ChannelPlan:
    """What calibration decided for one call site and direction.

    Attributes:
      perm: channel permutation applied before grouping (`x[..., perm]`).
      hadamard: whether the Walsh-Hadamard transform is on for this site.
      quant: the site's own quantizer (fewer bits: one of the config's
        `TacoConfig.fewer_bits` candidates), held with its transform set by `hadamard`
        (so `quant.text` is what the site sends); None: the config's.
    """

    perm: tuple[int, ...]
    hadamard: bool
    quant: QuantSpec | None = None

    def __post_init__(self) -> None:
        if sorted(self.perm) != list(range(len(self.perm))):
            raise ValueError(f"ChannelPlan.perm is not a permutation of range({len(self.perm)})")
        if self.quant is not None and not isinstance(self.quant, QuantSpec):
            raise ValueError(f"ChannelPlan.quant must be a QuantSpec or None, got {self.quant!r}")
        if self.quant is not None and self.quant.hadamard != self.hadamard:
            object.__setattr__(self, "quant", dataclasses.replace(self.quant, hadamard=self.hadamard))

    @functools.cached_property
    def is_identity(self) -> bool:
        """Whether the permutation leaves the channels in place (no gather needed)."""
        return self.perm == tuple(range(len(self.perm)))

    @functools.cached_property
    def indices(self) -> np.ndarray:
        """The permutation as an int32 array."""
        return np.asarray(self.perm, np.int32)

    @functools.cached_property
    def inverse(self) -> np.ndarray:
        """The inverse permutation as an int32 array."""
        return np.argsort(self.indices).astype(np.int32)

    def spec(self, spec: QuantSpec) -> QuantSpec:
        """The site's quantizer: its own (`quant`) or `spec`, with this plan's transform
        decision."""
        return dataclasses.replace(self.quant or spec, hadamard=self.hadamard)


def candidate_of(quant: QuantSpec, fewer_bits: FewerBits | None) -> QuantSpec | None:
    """The candidate of `fewer_bits` that `quant` is (the transform aside: calibration
    decides it per site), or None where `fewer_bits` lists no such format."""
    candidates = fewer_bits.candidates if fewer_bits is not None else ()
    return next((c for c in candidates if dataclasses.replace(quant, hadamard=c.hadamard) == c), None)


def format_conflict(plan: ChannelPlan, config: TacoConfig) -> str | None:
    """Why `config` does not allow `plan`'s own format, or None where it does (no own
    format, or one the config's `fewer_bits` lists): the mode and preset decide what a
    message may be sent as, a calibration only chooses among that."""
    if plan.quant is None or candidate_of(plan.quant, config.fewer_bits) is not None:
        return None
    allowed = [c.text for c in config.fewer_bits.candidates] if config.fewer_bits is not None else []
    return f"format {plan.quant.text}, which the config does not allow (its fewer-bits formats: {allowed or 'none'})"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-site, per-direction `ChannelPlan`s. Empty = identity everywhere.

    A pytree without array leaves: it can sit in a training-state pytree and passes
    through `jax.jit` as static data (the permutations are compile-time constants).

    Attributes:
      plans: ((site, direction, ChannelPlan), ...), direction "forward" or "backward".
    """

    plans: tuple[tuple[str, str, ChannelPlan], ...] = ()

    def __post_init__(self) -> None:
        seen = set()
        for site, direction, plan in self.plans:
            if direction not in DIRECTIONS or not isinstance(plan, ChannelPlan):
                raise ValueError(f"bad calibration entry for site {site!r}: direction {direction!r}, plan {plan!r}")
            if (site, direction) in seen:
                raise ValueError(f"calibration has two plans for site {site!r}, direction {direction!r}")
            seen.add((site, direction))

    def plan(self, site: str | None, direction: str) -> ChannelPlan | None:
        """The plan of `site` in `direction`, or None (identity, config's transform)."""
        return self._table.get((site, direction))

    @functools.cached_property
    def _table(self) -> dict:
        return {(site, direction): plan for site, direction, plan in self.plans}

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self.plans)

    def to_json(self) -> dict:
        """A JSON-serializable form (for checkpoints)."""
        return {
            "plans": [
                {
                    "site": s,
                    "direction": d,
                    "perm": list(p.perm),
                    "hadamard": p.hadamard,
                    **({"quant": p.quant.text} if p.quant is not None else {}),
                }
                for s, d, p in self.plans
            ]
        }

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        """Inverse of `to_json`: every entry has a string "site", a "direction", a "perm"
        of integers, a JSON boolean "hadamard" and, for a site with its own format, a
        "quant" spec text (no "quant": the config's format).

        Raises:
          ValueError: malformed data (naming the entry's site), or two plans for one
            site and direction.
        """
        if not isinstance(data, dict) or not isinstance(data.get("plans"), list):
            raise ValueError('malformed calibration data: expected {"plans": [...]}')
        return cls(tuple(_entry_from_json(entry) for entry in data["plans"]))

    def conflicts(self, config: TacoConfig) -> list[str]:
        """What in this calibration `config` does not allow, one phrase per plan (empty:
        none): a calibration refines mode "taco" only, and a site's own format must be
        one of `config.fewer_bits`."""
        if self.plans and config.mode != "taco":
            return [f"mode {config.mode!r} takes no calibration (only mode 'taco' is calibrated)"]
        return [
            f"site {site!r} ({direction}): {conflict}"
            for site, direction, plan in self.plans
            if (conflict := format_conflict(plan, config)) is not None
        ]


def _entry_from_json(entry: Any) -> tuple[str, str, ChannelPlan]:
    """One (site, direction, plan) of `Calibration.from_json`.

    Raises:
      ValueError: a field missing or of the wrong type, naming the site.
    """
    if not isinstance(entry, dict) or not isinstance(entry.get("site"), str):
        raise ValueError(f"malformed calibration entry {entry!r:.200}: expected an object with a string 'site'")
    where = f"calibration of site {entry['site']!r}"
    direction, perm, hadamard = entry.get("direction"), entry.get("perm"), entry.get("hadamard")
    if direction not in DIRECTIONS:
        raise ValueError(f"{where}: 'direction' must be one of {list(DIRECTIONS)}, got {direction!r}")
    if not isinstance(perm, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in perm):
        raise ValueError(f"{where}: 'perm' must be a list of integers, got {perm!r:.200}")
    if not isinstance(hadamard, bool):
        raise ValueError(f"{where}: 'hadamard' must be true or false, got {hadamard!r}")
    quant = entry.get("quant")
    if "quant" in entry and not isinstance(quant, str):
        raise ValueError(
            f"{where}: 'quant' must be a spec such as 'e2m3:128:H:bf16' (omit it for the config's format), got {quant!r}"
        )
    try:
        return (
            entry["site"],
            direction,
            ChannelPlan(tuple(perm), hadamard, QuantSpec.parse(quant) if quant is not None else None),
        )
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


# ----------------------------------------------------------------------------- collection


class Collector:
    """Thread-safe host accumulator of what each compressed collective sends.

    Per (site, direction): per-channel sum of squares (float64), row count, and the
    latest `MAX_SAMPLE_ROWS` (or a few more) sampled rows.

    The host callback only queues what it is given (`add`); the arrays are read when the
    statistics are (`keys`, `rms`, `sample`), after the step. A callback that waited for
    its arguments would deadlock a program on several CPU devices: JAX copies every
    callback's arguments to CPU device 0, whose thread is itself inside the program.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[tuple[tuple[str, str], Any, Any, Any]] = []
        self.sum_squares: dict[tuple[str, str], np.ndarray] = {}
        self.rows: dict[tuple[str, str], int] = {}
        self.samples: dict[tuple[str, str], list[np.ndarray]] = {}

    def add(self, key: tuple[str, str], sum_squares, rows, sample) -> None:
        """Queue one observed message (called from the host callback; nothing is read here)."""
        with self._lock:
            self._queued.append((key, sum_squares, rows, sample))

    @contextlib.contextmanager
    def _settled(self) -> Iterator[None]:
        """The statistics with every queued message folded in, under the lock."""
        with self._lock:
            queued, self._queued = self._queued, []
            for key, sum_squares, rows, sample in queued:
                self.sum_squares[key] = self.sum_squares.get(key, 0.0) + np.asarray(sum_squares, np.float64)
                self.rows[key] = self.rows.get(key, 0) + int(rows)
                kept = self.samples.setdefault(key, [])
                kept.append(np.asarray(sample, np.float32))
                while sum(len(s) for s in kept) - len(kept[0]) >= MAX_SAMPLE_ROWS:
                    kept.pop(0)  # keep the latest rows: the tensors closest to the decision
            yield

    def keys(self) -> list[tuple[str, str]]:
        """The observed (site, direction) pairs, sorted."""
        with self._settled():
            return sorted(self.sum_squares)

    def rms(self, key: tuple[str, str]) -> np.ndarray:
        """Per-channel RMS of everything observed at `key`, over all processes."""
        with self._settled():
            sums, rows = self.sum_squares[key], self.rows[key]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            gathered = multihost_utils.process_allgather(np.append(sums, rows))
            sums, rows = gathered[:, :-1].sum(0), gathered[:, -1].sum()
        return np.sqrt(sums / max(rows, 1))

    def sample(self, key: tuple[str, str]) -> np.ndarray:
        """The latest sampled rows of `key` (this process)."""
        with self._settled():
            return np.concatenate(self.samples[key])[-MAX_SAMPLE_ROWS:]


@contextlib.contextmanager
def observing(collector: Collector) -> Iterator[Collector]:
    """Compressed collectives traced inside the block report to `collector`.

    Like `record_wire`, this acts at trace time: trace (or jit) the step inside the block,
    then run it; every execution adds its statistics.
    """
    with accounting.observed_by(functools.partial(_report, collector)):
        yield collector


def _report(collector: Collector, x: jax.Array, site: str, direction: str) -> None:
    """Send `collector` the statistics of `x` (..., C), about to be compressed at `site`,
    each time the traced program runs."""
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    stride = max(1, rows.shape[0] // SAMPLE_ROWS)
    sample = rows[::stride][:SAMPLE_ROWS]
    jax.debug.callback(
        functools.partial(collector.add, (site, direction)), jnp.sum(jnp.square(rows), axis=0), rows.shape[0], sample
    )


# ----------------------------------------------------------------------------- decision


def channel_rms(x: ArrayLike) -> np.ndarray:
    """float64 RMS of each channel (last axis) over all other axes."""
    values = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    return np.sqrt(np.mean(np.square(values), axis=0))


def permutation(rms: np.ndarray, group_size: int, strategy: str) -> np.ndarray:
    """A channel permutation from per-channel RMS.

    Args:
      rms: (C,) per-channel RMS.
      group_size: G; C must be divisible by it.
      strategy: "identity", "cluster" or "interleave".

    Returns:
      int32 (C,) permutation.

    Raises:
      ValueError: unknown strategy, or C not divisible by G.
    """
    channels = len(rms)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown permutation strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    if channels % group_size:
        raise ValueError(f"{channels} channels are not divisible by group_size {group_size}")
    order = np.argsort(rms, kind="stable").astype(np.int32)
    if strategy == "identity":
        return np.arange(channels, dtype=np.int32)
    if strategy == "cluster":
        return order
    return order.reshape(group_size, channels // group_size).T.reshape(-1)


@functools.partial(jax.jit, static_argnames="spec")
def _round_trip(x: jax.Array, spec: QuantSpec, perm: jax.Array) -> jax.Array:
    # One program per spec and shape (the permutation is an argument): calibration tries
    # every candidate on every site, which op by op costs a dispatch per codec step.
    return decompress(compress(x, spec, perm=perm), perm=perm)


def codec_error(x: ArrayLike, spec: QuantSpec, perm: np.ndarray) -> dict[str, float]:
    """Relative RMSE and median per-channel relative error of one round trip."""
    x64 = np.asarray(x, np.float64)
    checked = check_permutation(perm, x64.shape[-1])  # checked here: the program sees only its shape
    y = np.asarray(_round_trip(jnp.asarray(x), spec, checked), np.float64)
    err = (y - x64).reshape(-1, x64.shape[-1])
    norms = np.linalg.norm(x64.reshape(-1, x64.shape[-1]), axis=0)
    live = norms > 0
    return {
        "rel_rmse": float(np.linalg.norm(err) / max(float(np.linalg.norm(x64)), 1e-300)),
        "channel_median": float(np.median(np.linalg.norm(err, axis=0)[live] / norms[live])) if live.any() else 0.0,
    }


def calibrate_site(
    samples: ArrayLike,
    spec: QuantSpec,
    *,
    rms: np.ndarray | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    metric: str = "channel_median",
    min_gain: float = DEFAULT_MIN_GAIN,
) -> tuple[ChannelPlan, list[dict]]:
    """Choose a site's permutation and transform by measured codec error on its tensors.

    Every strategy is tried with the transform on and off; the lowest `metric` wins (the
    other metric breaks ties), except that a permutation must beat the best unpermuted
    candidate by `min_gain` (relative) to be chosen: applying one costs a gather on
    both sides of the collective (`benchmarks/permutation_cost.py`).

    Args:
      samples: the site's tensors (..., C) as they would be sent.
      spec: the site's `QuantSpec` (its `hadamard` field is what is being decided).
      rms: per-channel RMS to build permutations from (default: that of `samples`).
      strategies: permutation strategies to try.
      metric: "channel_median" or "rel_rmse".
      min_gain: relative error reduction a permutation must bring over the identity.

    Returns:
      (the chosen `ChannelPlan`, one report row per candidate, "best" on the chosen one's).

    Raises:
      ValueError: unknown metric or strategy, or channels not divisible by the group size.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown calibration metric {metric!r}; expected one of {list(METRICS)}")
    rms = channel_rms(samples) if rms is None else rms
    other = METRICS[1 - METRICS.index(metric)]
    report: list[dict[str, Any]] = []
    for strategy in strategies:
        perm = permutation(rms, spec.group_size, strategy)
        for hadamard in (False, True):
            error = codec_error(samples, dataclasses.replace(spec, hadamard=hadamard), perm)
            report.append({"strategy": strategy, "hadamard": hadamard, **error, "perm": perm})
    rank = lambda row: (row[metric], row[other])
    best = min(report, key=rank)
    unpermuted = [row for row in report if row["strategy"] == "identity"]
    if unpermuted and best["strategy"] != "identity":
        fallback = min(unpermuted, key=rank)
        if best[metric] > (1 - min_gain) * fallback[metric]:
            best = fallback
    chosen = ChannelPlan(tuple(int(i) for i in best["perm"]), bool(best["hadamard"]))
    return chosen, [{**{k: v for k, v in row.items() if k != "perm"}, "best": row is best} for row in report]


def fewest_bits(
    samples: ArrayLike,
    fallback: ChannelPlan,
    fewer_bits: FewerBits,
    *,
    rms: np.ndarray,
    direction: str = "forward",
    **site_options: Any,
) -> tuple[ChannelPlan, list[dict]]:
    """The plan of the candidate with the fewest wire bits per element whose relative RMS
    error on `samples` (with its own best permutation and transform) is at most
    `fewer_bits.tolerance_for(direction)` times the reference spec's; `fallback` where
    none fits.

    Args:
      samples: the site's tensors (..., C) as they would be sent.
      fallback: the site's plan with the config's spec.
      fewer_bits: the candidates and the budget.
      rms: per-channel RMS to build permutations from.
      direction: "forward" or "backward": whose tolerance sets the budget.
      **site_options: `calibrate_site`'s strategies, metric and min_gain.

    Returns:
      (the chosen plan, report rows of the reference and of each candidate tried, each
      with its "spec", its "role" ("reference" or "candidate") and "best": whether the
      row is the plan `calibrate_site` chose for that spec).
    """
    channels = len(rms)
    tolerance = fewer_bits.tolerance_for(direction)

    def measured(spec: QuantSpec, role: str) -> tuple[ChannelPlan, float, list[dict]]:
        plan, rows = calibrate_site(samples, spec, rms=rms, **site_options)
        error = codec_error(samples, plan.spec(spec), plan.indices)["rel_rmse"]
        return plan, error, [{**row, "spec": spec.text, "role": role} for row in rows]

    _, reference_error, report = measured(fewer_bits.reference, "reference")
    for candidate in sorted(fewer_bits.candidates, key=lambda spec: spec.bits_per_element):
        if channels % candidate.group_size:
            continue
        plan, error, rows = measured(candidate, "candidate")
        report += rows
        if error <= tolerance * reference_error:
            return ChannelPlan(plan.perm, plan.hadamard, candidate), report
    return fallback, report


def calibrate(
    collector: Collector,
    config: TacoConfig,
    *,
    strategies: tuple[str, ...] = STRATEGIES,
    metric: str = "channel_median",
    min_gain: float = DEFAULT_MIN_GAIN,
) -> tuple[Calibration, list[dict]]:
    """Decide every observed site's permutation and transform, and with
    `config.fewer_bits` its format (`fewest_bits`, each direction within its own
    tolerance).

    Only mode "taco" is calibrated ("fp8" is the no-reshaping baseline by definition,
    "off" compresses nothing): the result is then empty. Sites whose channel count does
    not divide by the group size keep the identity. In multi-process runs the RMS is
    reduced over processes and process 0's decisions are broadcast, so every rank holds
    the same `Calibration`.

    Args:
      collector: what `observing` collected.
      config: the `TacoConfig` the sites compress with.
      strategies: permutation strategies to choose from.
      metric: "channel_median" or "rel_rmse".
      min_gain: see `calibrate_site`.

    Returns:
      (the `Calibration`, one report row per site, direction, candidate, permutation
      strategy and transform, each with its "spec", "role" ("config", "reference" or
      "candidate") and "chosen": true on the one row per site and direction that the
      site sends, which also holds the spec "sent" (with the site's transform) and, with
      `config.fewer_bits`, the "reference", its "reference_rel_rmse", the "error_ratio"
      of the two and the direction's "tolerance"; `choices` lists those rows).
    """
    if config.mode != "taco":
        return Calibration(), []
    plans, report = [], []
    options: dict[str, Any] = dict(strategies=strategies, metric=metric, min_gain=min_gain)
    for site, direction in collector.keys():
        spec = config.spec(direction)
        rms, samples = collector.rms((site, direction)), collector.sample((site, direction))
        if len(rms) % spec.group_size:
            continue
        plan, rows = calibrate_site(samples, spec, rms=rms, **options)
        rows = [{**row, "spec": spec.text, "role": "config"} for row in rows]
        if config.fewer_bits is not None:
            plan, more = fewest_bits(samples, plan, config.fewer_bits, rms=rms, direction=direction, **options)
            rows += more
        rows = _mark_chosen(rows, plan, spec, config.fewer_bits, direction)
        plans.append((site, direction, plan))
        report += [{"site": site, "direction": direction, **row} for row in rows]
    return _agreed(Calibration(tuple(plans)), config.fewer_bits), report


def _mark_chosen(
    rows: list[dict], plan: ChannelPlan, spec: QuantSpec, fewer_bits: FewerBits | None, direction: str
) -> list[dict]:
    """`rows` (one site and direction) with "chosen" set on the row of the plan the site
    sends, which also gets what it sends and its error against the reference's."""
    if plan.quant is None:
        role, text = "config", spec.text
    else:  # the candidate as listed (its rows' "spec"), the transform aside
        role, text = "candidate", (candidate_of(plan.quant, fewer_bits) or plan.quant).text
    chosen = next(i for i, row in enumerate(rows) if row["role"] == role and row["spec"] == text and row["best"])
    marked = [{**row, "chosen": i == chosen} for i, row in enumerate(rows)]
    marked[chosen]["sent"] = plan.spec(spec).text
    if fewer_bits is not None:
        reference = next(row for row in rows if row["role"] == "reference" and row["best"])["rel_rmse"]
        marked[chosen] |= {
            "reference": fewer_bits.reference.text,
            "reference_rel_rmse": reference,
            "error_ratio": marked[chosen]["rel_rmse"] / reference if reference > 0 else None,
            "tolerance": fewer_bits.tolerance_for(direction),
        }
    return marked


def choices(report: list[dict]) -> list[dict]:
    """The rows of a `calibrate` report that the sites send, one per site and direction:
    "site", "direction", the spec "sent", its "rel_rmse" and, where the config has fewer
    bits, the "reference", "reference_rel_rmse", "error_ratio" and "tolerance"."""
    keys = ("site", "direction", "sent", "rel_rmse", "reference", "reference_rel_rmse", "error_ratio", "tolerance")
    return [{key: row[key] for key in keys if key in row} for row in report if row.get("chosen")]


def _agreed(calibration: Calibration, fewer_bits: FewerBits | None) -> Calibration:
    """Process 0's calibration on every process (each plan's spec sent as its index in
    None + the candidates)."""
    if jax.process_count() == 1:
        return calibration
    from jax.experimental import multihost_utils

    choices = (None, *(fewer_bits.candidates if fewer_bits is not None else ()))
    flags = np.array([plan.hadamard for _, _, plan in calibration.plans], np.int32)
    quants = np.array(
        [choices.index(plan.quant and candidate_of(plan.quant, fewer_bits)) for _, _, plan in calibration.plans],
        np.int32,
    )
    perms = tuple(plan.indices for _, _, plan in calibration.plans)
    flags, quants, perms = multihost_utils.broadcast_one_to_all((flags, quants, perms))
    return Calibration(
        tuple(
            (s, d, ChannelPlan(tuple(int(i) for i in p), bool(f), choices[int(q)]))
            for (s, d, _), p, f, q in zip(calibration.plans, np.asarray(perms), np.asarray(flags), np.asarray(quants))
        )
    )
