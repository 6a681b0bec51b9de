"""Where compression pays: how each message travels (compressed or not, which all-reduce
algorithm, how many pipelined chunks), decided from measured times on the link at hand.

Without a `LinkProfile` the collectives compress every message of at least
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

from taco_jax.accounting import Op

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
