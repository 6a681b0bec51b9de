"""Calibration: permutation strategies and the per-site choice by measured codec error."""

import dataclasses
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import calibration, collectives, message
from taco_jax.train import calibrate
from taco_jax.train.config import TrainConfig
from tests.conftest import cpu_env


def test_strategies_are_permutations_with_the_intended_groups():
    rng = np.random.default_rng(0)
    rms = rng.lognormal(0, 2, 512)
    for strategy in calibration.STRATEGIES:
        perm = calibration.permutation(rms, 128, strategy)
        assert perm.dtype == np.int32 and sorted(perm) == list(range(512))
    clustered = rms[calibration.permutation(rms, 128, "cluster")].reshape(4, 128)
    assert np.all(clustered[:-1].max(axis=1) <= clustered[1:].min(axis=1))  # groups ordered by magnitude
    interleaved = rms[calibration.permutation(rms, 128, "interleave")].reshape(4, 128)
    assert np.all(interleaved.max(axis=1) >= np.quantile(rms, 0.99))  # each group gets a top channel
    np.testing.assert_array_equal(calibration.permutation(rms, 128, "identity"), np.arange(512))


def test_calibration_picks_clustering_for_spread_channel_scales():
    rng = np.random.default_rng(3)  # channels of very different magnitude (log-normal, sigma 2)
    x = rng.standard_normal((256, 1024)) * rng.lognormal(0.0, 2.0, 1024)
    spec = tj.QuantSpec("int8", 128, True, "bf16")
    chosen, report = calibration.calibrate_site(x, spec)
    best = min(report, key=lambda r: r["channel_median"])
    assert (best["strategy"], best["hadamard"]) == ("cluster", True)
    identity_h = next(r for r in report if (r["strategy"], r["hadamard"]) == ("identity", True))
    assert best["channel_median"] < 0.25 * identity_h["channel_median"]
    np.testing.assert_array_equal(chosen.indices, calibration.permutation(calibration.channel_rms(x), 128, "cluster"))
    assert chosen.hadamard
    np.testing.assert_array_equal(chosen.indices[chosen.inverse], np.arange(1024))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown permutation strategy"):
        calibration.permutation(np.ones(256), 128, "shuffle")
    with pytest.raises(ValueError, match="not divisible by group_size 128"):
        calibration.permutation(np.ones(200), 128, "cluster")
    with pytest.raises(ValueError, match="unknown calibration metric"):
        calibration.calibrate_site(np.ones((4, 256), np.float32), tj.QuantSpec(), metric="mse")
    with pytest.raises(ValueError, match="not a permutation"):
        calibration.ChannelPlan((0, 0, 1), True)
    with pytest.raises(ValueError, match="direction 'sideways'"):
        calibration.Calibration((("s", "sideways", calibration.ChannelPlan((0, 1), True)),))
    with pytest.raises(ValueError, match="calibration of site 's': 'perm' must be a list of integers"):
        calibration.Calibration.from_json({"plans": [{"site": "s", "direction": "forward"}]})
    with pytest.raises(ValueError, match="calibration of site 's': 'direction' must be one of"):
        calibration.Calibration.from_json({"plans": [{"site": "s"}]})
    with pytest.raises(ValueError, match="malformed calibration data"):
        calibration.Calibration.from_json({"sites": []})


def test_state_round_trips_through_json_and_is_hashable():
    plan = calibration.ChannelPlan(tuple(np.random.default_rng(0).permutation(256).tolist()), False)
    state = calibration.Calibration((("layers.mlp.out", "forward", plan),))
    again = calibration.Calibration.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state and hash(again) == hash(state)
    assert again.plan("layers.mlp.out", "forward") == plan
    assert again.plan("layers.mlp.out", "backward") is None and calibration.Calibration().plan("x", "forward") is None


# ----------------------------------------------------------------------------- in the collectives

RANKS = 4
CHANNELS = 256
TACO = tj.TacoConfig.preset("taco", min_bytes=0)


def _spread_channels(seed=0, rows=16):
    """Rank-coded (RANKS, rows, CHANNELS) f32 with log-normal channel scales."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0, 2, CHANNELS))
    return np.stack([(r + 1) * rng.normal(size=(rows, CHANNELS)) * scales for r in range(RANKS)]).astype(np.float32)


def _sharded(fn):
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))


def _observe_reduce(x):
    collector = calibration.Collector()
    with calibration.observing(collector):
        out = _sharded(lambda v: tj.all_reduce(v[0], "tensor", TACO, site="s")[None])(x)
        jax.block_until_ready(out)
    jax.effects_barrier()
    return collector, np.asarray(out)


def test_collector_sees_every_rank_and_the_statistics_are_exact():
    x = _spread_channels()
    collector, _ = _observe_reduce(x)
    assert collector.keys() == [("s", "forward")]
    expected = np.sqrt(np.mean(np.square(x.astype(np.float64)).reshape(-1, CHANNELS), axis=0))
    np.testing.assert_allclose(collector.rms(("s", "forward")), expected, rtol=1e-5)
    assert collector.sample(("s", "forward")).shape[1] == CHANNELS


# Four CPU devices each run their part of one program that observes a message, then
# gathers it: every device's callback runs while the others wait in the gather (a
# message of 1024 channels: smaller ones did not stall).
OBSERVED_ON_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import taco_jax as tj

mesh = jax.make_mesh((4,), ("tensor",))
config = tj.TacoConfig.preset("taco+", min_bytes=0)
body = lambda x: tj.all_gather(jnp.tanh(x), "tensor", config, site="s") * 2.0
step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor")))
x = jax.device_put(jnp.full((4 * 64, 1024), 0.5, jnp.float32), NamedSharding(mesh, P("tensor")))
collector = tj.calibration.Collector()
with tj.calibration.observing(collector):
    jax.block_until_ready(step(x))
    jax.block_until_ready(step(x))
print(collector.keys(), float(np.max(np.abs(collector.rms(("s", "forward")) - np.tanh(0.5)))))
"""


def test_observing_a_program_on_several_cpu_devices_does_not_stall():
    """The collector's host callback waits on nothing. JAX copies a callback's arguments
    to CPU device 0, whose thread is inside the same program: a callback that read them
    there waited forever on four CPU devices."""
    env = cpu_env(4)
    out = subprocess.run(
        [sys.executable, "-c", OBSERVED_ON_DEVICES], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    keys, error = out.stdout.strip().rsplit(" ", 1)
    assert keys == "[('s', 'forward')]" and float(error) < 1e-6


def test_calibrated_collectives_cut_the_per_channel_error():
    x = _spread_channels()
    collector, identity_out = _observe_reduce(x)
    state, report = calibration.calibrate(collector, TACO)
    ((site, direction, plan),) = state.plans
    assert (site, direction) == ("s", "forward") and {r["site"] for r in report} == {"s"}
    out = np.asarray(_sharded(lambda v: tj.all_reduce(v[0], "tensor", TACO, site="s", calibration=state)[None])(x))
    exact = x.astype(np.float64).sum(0)
    per_channel = lambda y: np.median(np.linalg.norm(y[0] - exact, axis=0) / np.linalg.norm(exact, axis=0))
    assert per_channel(out) < 0.25 * per_channel(identity_out)
    assert per_channel(out) < 0.05
    for r in range(RANKS):  # every rank decodes the same sum
        np.testing.assert_array_equal(out[r], out[0])


@pytest.mark.parametrize("hadamard", [False, True])
def test_gather_with_a_plan_equals_the_codec_round_trip(hadamard):
    x = _spread_channels(1)
    perm = tuple(np.random.default_rng(2).permutation(CHANNELS).tolist())
    plan = calibration.ChannelPlan(perm, hadamard)
    state = calibration.Calibration((("g", "forward", plan),))
    out = _sharded(lambda v: tj.all_gather(v, "tensor", TACO, axis=0, site="g", calibration=state))(x)
    spec = plan.spec(TACO.forward)
    expected = np.concatenate(
        [np.asarray(tj.decompress(tj.compress(x[r], spec, perm=plan.indices), perm=plan.indices)) for r in range(RANKS)]
    )
    # rank 0's result; jit and eager may round the decode's last multiply differently (1 ulp)
    np.testing.assert_allclose(np.asarray(out)[:RANKS], expected.reshape(RANKS, 16, CHANNELS), rtol=1e-6, atol=0)


def test_backward_plan_is_used_for_the_gradient_collective():
    """gather_from_sp's backward reduce-scatter uses the site's backward plan: every rank
    holds the same cotangent 2 * gathered (gathered = the forward codec's round trip),
    so rank r's gradient is 4 decoded copies of its chunk compressed with that plan."""
    x = _spread_channels(3)
    plan = calibration.ChannelPlan(tuple(np.random.default_rng(5).permutation(CHANNELS).tolist()), True)
    state = calibration.Calibration((("g", "backward", plan),))

    def grad(cal):
        loss = lambda v: jnp.sum(tj.tp.gather_from_sp(v, "tensor", TACO, axis=0, site="g", calibration=cal) ** 2)
        return np.asarray(_sharded(jax.grad(loss))(x))

    backward = lambda v: np.asarray(
        tj.decompress(tj.compress(v, plan.spec(TACO.backward), perm=plan.indices), perm=plan.indices)
    )
    forward = lambda v: np.asarray(tj.decompress(tj.compress(v, TACO.forward)))
    expected = np.stack([4 * backward(2 * forward(x[r])) for r in range(RANKS)])
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad(state), expected, rtol=1e-5, atol=1e-6 * scale)
    assert np.abs(grad(None) - expected).max() > 1e-3 * scale  # the plan changed the result


def test_plans_that_do_not_fit_are_errors():
    x = _spread_channels()
    short = calibration.Calibration((("s", "forward", calibration.ChannelPlan(tuple(range(128)), True)),))
    with pytest.raises(ValueError, match="permutes 128 channels, but the message has 256"):
        _sharded(lambda v: tj.all_reduce(v[0], "tensor", TACO, site="s", calibration=short)[None])(x)
    full = calibration.Calibration((("s", "forward", calibration.ChannelPlan(tuple(range(CHANNELS))[::-1], True)),))
    with pytest.raises(ValueError, match="cannot gather or scatter along the last"):
        _sharded(
            lambda v: tj.reduce_scatter(v[0], "tensor", TACO, scatter_dimension=1, site="s", calibration=full)[None]
        )(x)
    with pytest.raises(ValueError, match="calibration must be a taco_jax.calibration.Calibration"):
        _sharded(lambda v: tj.all_reduce(v, "tensor", TACO, calibration={"s": 1}))(x)


def test_fp8_and_off_are_never_calibrated():
    collector, _ = _observe_reduce(_spread_channels())
    for preset in ("fp8", "off"):
        assert calibration.calibrate(collector, tj.TacoConfig.preset(preset)) == (calibration.Calibration(), [])


def test_a_permutation_must_earn_its_gather():
    """Gaussian channels: no permutation helps, so the identity is kept (no gather)."""
    x = np.random.default_rng(6).normal(size=(512, 256)).astype(np.float32)
    plan, report = calibration.calibrate_site(x, tj.QuantSpec("int8", 128, True, "bf16"))
    assert plan.is_identity
    forced, _ = calibration.calibrate_site(x, tj.QuantSpec("int8", 128, True, "bf16"), strategies=("cluster",))
    assert not forced.is_identity  # with no unpermuted candidate, the best permutation stands


def test_collector_keeps_the_latest_rows():
    collector = calibration.Collector()
    for step in range(100):
        collector.add(("s", "forward"), np.ones(8), 64, np.full((64, 8), step, np.float32))
    kept = collector.sample(("s", "forward"))
    assert len(kept) == calibration.MAX_SAMPLE_ROWS and kept.max() == 99 and kept.min() > 0
    assert collector.rms(("s", "forward")).tolist() == [np.sqrt(100 / 6400)] * 8


def test_calibration_is_a_static_pytree():
    plan = calibration.ChannelPlan((1, 0, 3, 2), True)
    state = {"step": jnp.int32(3), "calibration": calibration.Calibration((("s", "forward", plan),))}
    assert len(jax.tree.leaves(state)) == 1  # the calibration holds no array leaves
    out = jax.jit(lambda st: st)(state)
    assert out["calibration"] == state["calibration"]


# ----------------------------------------------------------------------------- fewer bits

MIXED = tj.TacoConfig.preset("taco+mixed", min_bytes=0)


@functools.cache
def _observed_mixed():
    """What the site sends, observed once for the cases below (they only read it)."""
    x = _spread_channels(4, rows=64)
    collector = calibration.Collector()
    with calibration.observing(collector):
        jax.block_until_ready(_sharded(lambda v: tj.all_reduce(v[0], "tensor", MIXED, site="s")[None])(x))
    jax.effects_barrier()
    return x, collector


def _best_error(samples, spec):
    plan, _ = calibration.calibrate_site(samples, spec)
    return calibration.codec_error(samples, plan.spec(spec), plan.indices)["rel_rmse"]


@pytest.mark.parametrize(("tolerance", "chosen"), [(1.5, "e2m3:128:H:bf16"), (100.0, "int4:32:H:bf16"), (0.1, None)])
def test_fewer_bits_take_the_fewest_bits_within_the_budget(tolerance, chosen):
    """Each candidate's error measured here, independently of `fewest_bits`: the site
    takes the candidate with the fewest bits whose error is within tolerance x E4M3's,
    and keeps the config's spec where none is."""
    x, collector = _observed_mixed()
    fewer = tj.FewerBits(candidates=MIXED.fewer_bits.candidates, tolerance=tolerance)
    state, report = calibration.calibrate(collector, dataclasses.replace(MIXED, fewer_bits=fewer))
    ((_, _, plan),) = state.plans
    samples = collector.sample(("s", "forward"))
    budget = tolerance * _best_error(samples, fewer.reference)
    errors = {spec.text: _best_error(samples, spec) for spec in fewer.candidates}
    fitting = [spec for spec in fewer.candidates if errors[spec.text] <= budget]
    want = min(fitting, key=lambda spec: spec.bits_per_element).text if fitting else None
    assert want == chosen
    assert (None if plan.quant is None else plan.quant.text) == chosen
    assert {row["spec"] for row in report} >= {"int8:128:H:bf16", "e4m3:128:H:dual", "int4:32:H:bf16"}
    if chosen is not None:
        # The collective then sends the chosen format: its packed message, decoded within its error.
        fn = lambda v: tj.all_reduce(v[0], "tensor", MIXED, site="s", calibration=state)[None]
        mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
        hlo = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
        sent = tj.collectives_in_hlo(hlo.lower(x).compile().as_text())
        layout = message.message_layout(64 * CHANNELS // plan.quant.group_size // RANKS, plan.spec(MIXED.forward))
        assert {c.dtype for c in sent} == {"u8"} and layout.nbytes in {c.operand_bytes for c in sent}
        out = np.asarray(hlo(x), np.float64)[0]
        exact = x.astype(np.float64).sum(0)
        error = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        assert 0.2 * errors[chosen] < error < 4 * errors[chosen]


def test_fewer_bits_round_trip_through_json_and_are_checked():
    plan = calibration.ChannelPlan((1, 0, 3, 2), True, tj.QuantSpec.parse("e2m3:16:H:e8m0"))
    state = calibration.Calibration((("s", "backward", plan),))
    data = json.loads(json.dumps(state.to_json()))
    assert data["plans"][0]["quant"] == "e2m3:16:H:e8m0"
    assert calibration.Calibration.from_json(data) == state
    assert plan.spec(tj.QuantSpec()) == tj.QuantSpec("e2m3", 16, True, "e8m0")
    with pytest.raises(ValueError, match="non-empty tuple of QuantSpecs"):
        tj.FewerBits(candidates=())
    with pytest.raises(ValueError, match="positive finite number"):
        tj.FewerBits(candidates=(tj.QuantSpec(),), tolerance=float("nan"))
    with pytest.raises(ValueError, match="runs in mode 'taco' only"):
        tj.TacoConfig.preset("fp8", fewer_bits=MIXED.fewer_bits)
    assert tj.TacoConfig.preset("taco4").forward.bits_per_element == 4.5


def test_the_preset_decides_what_a_calibration_may_choose():
    """A calibration refines mode "taco" within the config: the site's permutation and
    transform, and a format only where `fewer_bits` lists it (whatever transform the site
    takes); mode "fp8" takes none; a format the config does not list is refused."""
    e2m3 = tj.QuantSpec.parse("e2m3:128:H:bf16")
    plan = calibration.ChannelPlan((1, 0, 3, 2), False, e2m3)
    state = calibration.Calibration((("s", "forward", plan),))
    spec, permutation = collectives.planned_spec(MIXED, "forward", state, "s", 4)
    assert spec == tj.QuantSpec("e2m3", 128, False, "bf16") and permutation == plan
    fp8 = tj.TacoConfig.preset("fp8")
    assert collectives.planned_spec(fp8, "forward", state, "s", 4) == (fp8.forward, None)
    assert state.conflicts(MIXED) == [] and "mode 'fp8' takes no calibration" in state.conflicts(fp8)[0]
    for preset in ("taco4", "taco+"):
        config = tj.TacoConfig.preset(preset)
        (conflict,) = state.conflicts(config)
        assert "format e2m3:128:-:bf16, which the config does not allow (its fewer-bits formats: none)" in conflict
        with pytest.raises(ValueError, match="calibration of site 's' \\(forward\\) gives format e2m3:128:-:bf16"):
            collectives.planned_spec(config, "forward", state, "s", 4)


def test_a_plan_without_the_transform_is_reported_without_it(capsys, monkeypatch):
    """A plan's format is held and printed with the plan's own transform decision: in
    its JSON, the summary and the calibration message."""
    e2m3 = tj.QuantSpec.parse("e2m3:128:H:bf16")
    state = calibration.Calibration(
        (
            ("a", "forward", calibration.ChannelPlan((0, 1), False, e2m3)),
            ("b", "backward", calibration.ChannelPlan((0, 1), False)),
        )
    )
    assert state.to_json()["plans"][0]["quant"] == "e2m3:128:-:bf16"
    assert calibrate.calibration_summary(state)["sites_with_fewer_bits"] == {"e2m3:128:-:bf16": 1}
    monkeypatch.setattr(tj.calibration, "calibrate", lambda *args, **kwargs: (state, []))
    cfg = TrainConfig.from_keys(taco="taco+mixed")
    assert calibrate.calibrate_run(cfg, calibration.Collector(), None) == state
    assert "a/f: e2m3:128:-:bf16, b/b: int8:128:-:bf16" in capsys.readouterr().err


def _collector_of(samples, directions):
    """A collector that observed `samples` at site "s" in each of `directions`."""
    collector = calibration.Collector()
    for direction in directions:
        collector.add(("s", direction), np.square(samples.astype(np.float64)).sum(0), len(samples), samples)
    return collector


def test_each_direction_takes_the_fewest_bits_within_its_own_tolerance(tmp_path, capsys, monkeypatch):
    """The same tensors sent both ways: a backward tolerance that admits INT4 G32 while
    the forward one (`tolerance`, 1.5x E4M3's error) does not gives INT4 backward and E2M3
    forward. The report, the calibration message and the
    summary show each direction's choice with its error against E4M3's, measured here
    independently."""
    rng = np.random.default_rng(5)  # Gaussian rows, log-normal channel scales (sigma 0.5)
    samples = (rng.standard_normal((4 * 64, CHANNELS)) * rng.lognormal(0, 0.5, CHANNELS)).astype(np.float32)
    only_identity = dict(strategies=("identity",))
    best = lambda spec: calibration.codec_error(
        samples,
        min(
            (dataclasses.replace(spec, hadamard=h) for h in (False, True)),
            key=lambda s: calibration.codec_error(samples, s, np.arange(CHANNELS))["channel_median"],
        ),
        np.arange(CHANNELS),
    )["rel_rmse"]
    int4, e2m3 = MIXED.fewer_bits.candidates
    reference = best(MIXED.fewer_bits.reference)
    ratio = {"int4": best(int4) / reference, "e2m3": best(e2m3) / reference}
    assert ratio["e2m3"] <= 1.5 < ratio["int4"]  # the forward budget admits E2M3 only

    fewer = tj.FewerBits(MIXED.fewer_bits.candidates, backward_tolerance=1.05 * ratio["int4"])
    config = dataclasses.replace(MIXED, fewer_bits=fewer)
    state, report = calibration.calibrate(_collector_of(samples, calibration.DIRECTIONS), config, **only_identity)
    assert calibration.candidate_of(state.plan("s", "forward").quant, fewer) == e2m3
    assert calibration.candidate_of(state.plan("s", "backward").quant, fewer) == int4
    chosen = {row["direction"]: row for row in calibration.choices(report)}
    assert chosen["forward"]["tolerance"] == 1.5 and chosen["backward"]["tolerance"] == fewer.backward_tolerance
    for direction, name in (("forward", "e2m3"), ("backward", "int4")):
        assert chosen[direction]["sent"] == state.plan("s", direction).spec(MIXED.forward).text
        assert chosen[direction]["error_ratio"] == pytest.approx(ratio[name], rel=1e-6)
        assert chosen[direction]["reference_rel_rmse"] == pytest.approx(reference, rel=1e-6)

    # The message, the calibration.json and the summary.
    monkeypatch.setattr(tj.calibration, "calibrate", lambda *args, **kwargs: (state, report))
    calibrate.calibrate_run(TrainConfig.from_keys(taco="taco+mixed"), calibration.Collector(), tmp_path)
    message = capsys.readouterr().err
    assert f"s/b: {chosen['backward']['sent']} ({ratio['int4']:.2f}x e4m3:128:H:dual's error, tolerance" in message
    assert f"s/f: {chosen['forward']['sent']} ({ratio['e2m3']:.2f}x e4m3:128:H:dual's error, tolerance 1.5x)" in message
    recorded = calibrate.recorded_choices(state, tmp_path / "calibration.json")
    assert recorded == calibration.choices(report)
    assert calibrate.recorded_choices(calibration.Calibration(), tmp_path / "calibration.json", None) == []
    summary = calibrate.calibration_summary(state, recorded)
    assert summary["sites_with_fewer_bits_by_direction"] == {
        "forward": {chosen["forward"]["sent"]: 1},
        "backward": {chosen["backward"]["sent"]: 1},
    }
    assert summary["calibration_choices"]["s/backward"]["error_ratio"] == pytest.approx(ratio["int4"], rel=1e-6)


def test_direction_tolerances_are_checked():
    with pytest.raises(ValueError, match="FewerBits.backward_tolerance must be a positive finite number"):
        tj.FewerBits(MIXED.fewer_bits.candidates, backward_tolerance=0.0)
    with pytest.raises(ValueError, match="FewerBits.forward_tolerance must be a positive finite number"):
        tj.FewerBits(MIXED.fewer_bits.candidates, forward_tolerance=True)
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        MIXED.fewer_bits.tolerance_for("sideways")
    single = tj.FewerBits(MIXED.fewer_bits.candidates, tolerance=3.0)  # one tolerance sets both
    assert (single.tolerance_for("forward"), single.tolerance_for("backward")) == (3.0, 3.0)
    forward_only = tj.FewerBits(MIXED.fewer_bits.candidates, tolerance=3.0, forward_tolerance=1.2)
    assert (forward_only.tolerance_for("forward"), forward_only.tolerance_for("backward")) == (1.2, 3.0)
    assert tj.TacoConfig.preset("taco6-4").forward.text == "e2m3:128:H:bf16"
    assert tj.TacoConfig.preset("taco6-4").backward.text == "int4:32:H:bf16"
