"""Routes of compressed messages: pipelined chunks change nothing but the schedule, the
link profile decides deterministically, the collectives obey it, and the trainer
resolves taco_policy."""

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.message import chunk_bounds
from taco_jax.policy import LinkProfile, Route, Timing, route_for
from taco_jax.probe import Message, probe_link
from taco_jax.train import compression, link_policy, optimizer, run_state, trainer
from taco_jax.train import config as config_lib
from taco_jax.train import data as data_lib
from taco_jax.train.config import TrainConfig

OPS = {
    "all_gather": lambda c: lambda v: tj.all_gather(v, "tensor", c),
    "reduce_scatter": lambda c: lambda v: tj.reduce_scatter(v, "tensor", c),
    "one_shot": lambda c: lambda v: tj.all_reduce(v, "tensor", c, algorithm="one_shot"),
    "two_shot": lambda c: lambda v: tj.all_reduce(v, "tensor", c, algorithm="two_shot"),
}


def _compiled(mesh, body, x):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
    return fn, fn.lower(x).compile().as_text()


def _rank_coded(ranks, rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ranks, rows, cols)) * (1 + np.arange(ranks))[:, None, None]
    return jnp.asarray(x.reshape(ranks * rows, cols), jnp.float32)


def test_chunk_bounds_cover_the_rows_in_aligned_pieces():
    assert chunk_bounds(384, 3) == [(0, 128), (128, 256), (256, 384)]
    assert chunk_bounds(100, 4) == [(0, 64), (64, 100)]  # too few rows for four aligned pieces
    assert chunk_bounds(5, 1) == [(0, 5)]
    for groups, chunks in [(1000, 4), (65, 2), (64, 8)]:
        bounds = chunk_bounds(groups, chunks)
        assert bounds[0][0] == 0 and bounds[-1][1] == groups and len(bounds) <= chunks
        assert all(a % 64 == 0 and a < b for a, b in bounds)


@pytest.mark.parametrize("op", list(OPS))
def test_chunked_collectives_equal_unchunked_bit_for_bit(op):
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    x = jax.device_put(_rank_coded(4, 96, 512), NamedSharding(mesh, P("tensor")))  # 384 groups per rank
    config = tj.TacoConfig.preset("taco+", min_bytes=0)
    whole, whole_hlo = _compiled(mesh, OPS[op](config), x)
    piped, piped_hlo = _compiled(mesh, OPS[op](dataclasses.replace(config, chunks=3)), x)
    np.testing.assert_array_equal(
        np.asarray(jax.block_until_ready(piped(x))), np.asarray(jax.block_until_ready(whole(x)))
    )
    whole_ops, piped_ops = tj.collectives_in_hlo(whole_hlo), tj.collectives_in_hlo(piped_hlo)
    assert {c.dtype for c in piped_ops} == {"u8"}  # only 8-bit messages cross the wire
    assert len(piped_ops) > len(whole_ops)  # the pieces travel separately
    assert sum(c.operand_bytes for c in piped_ops) == pytest.approx(sum(c.operand_bytes for c in whole_ops), rel=0.01)


def _profile(rows, margin=0.05):
    return LinkProfile(tuple(Timing(op, 2, nbytes, route, ms) for op, nbytes, route, ms in rows), margin=margin)


FAST_LINK = [("all_reduce", 32 << 20, Route(False), 0.20), ("all_reduce", 32 << 20, Route(True, "one_shot", 1), 0.25)]
SLOW_LINK = [
    ("all_reduce", 32 << 20, Route(False), 1.20),
    ("all_reduce", 32 << 20, Route(True, "one_shot", 1), 0.80),
    ("all_reduce", 32 << 20, Route(True, "one_shot", 4), 0.80),
    ("all_reduce", 32 << 20, Route(True, "two_shot", 1), 0.85),
    ("all_reduce", 1 << 20, Route(False), 0.05),
    ("all_reduce", 1 << 20, Route(True, "one_shot", 1), 0.049),
]


def test_profile_decides_by_measured_time_deterministically():
    fast, slow = _profile(FAST_LINK), _profile(SLOW_LINK)
    assert fast.route("all_reduce", 2, 32 << 20) == Route(False)  # compression measured slower
    assert slow.route("all_reduce", 2, 32 << 20) == Route(True, "one_shot", 1)  # tie on time: fewer chunks
    assert slow.route("all_reduce", 2, 48 << 20) == Route(True, "one_shot", 1)  # nearest measured size
    assert slow.route("all_reduce", 2, 1 << 20) == Route(False)  # 2% faster is inside the 5% margin
    assert _profile(SLOW_LINK, margin=0.0).route("all_reduce", 2, 1 << 20) == Route(True, "one_shot", 1)
    assert slow.route("all_gather", 2, 32 << 20) is None and slow.route("all_reduce", 4, 32 << 20) is None
    for seed in range(5):  # the order of the measurements does not matter
        shuffled = list(SLOW_LINK)
        random.Random(seed).shuffle(shuffled)
        assert _profile(shuffled).route("all_reduce", 2, 32 << 20) == Route(True, "one_shot", 1)
    assert LinkProfile.from_json(json.loads(json.dumps(slow.to_json()))) == slow
    assert [d["route"] for d in slow.decisions()] == ["plain", "one_shot/1"]


def test_route_for_falls_back_and_honors_an_explicit_algorithm():
    slow = _profile(SLOW_LINK)
    common = dict(link=slow, chunks=2, algorithm="auto")
    assert route_for("all_reduce", 2, 32 << 20, compresses=False, **common) == Route(False)
    assert route_for("all_gather", 4, 32 << 20, compresses=True, **common) == Route(True, "one_shot", 2)
    assert route_for("all_reduce", 8, 32 << 20, compresses=True, **common) == Route(True, "two_shot", 2)
    explicit = dict(common, algorithm="two_shot")
    assert route_for("all_reduce", 2, 32 << 20, compresses=True, **explicit) == Route(True, "two_shot", 1)


def test_bad_profiles_and_routes_are_clear_errors():
    with pytest.raises(ValueError, match="algorithm"):
        Route(True, "three_shot")
    with pytest.raises(ValueError, match="chunks"):
        Route(True, "one_shot", 0)
    with pytest.raises(ValueError, match="bad timing"):
        _profile([("all_reduce", 1, Route(False), float("nan"))])
    with pytest.raises(ValueError, match="malformed"):
        LinkProfile.from_json({"timings": [{"op": "all_reduce"}]})
    with pytest.raises(ValueError, match="chunks"):
        tj.TacoConfig.preset("taco", chunks=0)
    with pytest.raises(ValueError, match="LinkProfile"):
        tj.TacoConfig.preset("taco", link={"timings": []})


def test_collectives_follow_the_link_profile():
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    x = jax.device_put(_rank_coded(2, 64, 1024), NamedSharding(mesh, P("tensor")))  # 256 KiB per rank
    nbytes = 64 * 1024 * 4
    for timings, dtypes in [
        ([("all_reduce", nbytes, Route(False), 0.1), ("all_reduce", nbytes, Route(True), 0.2)], {"f32"}),
        ([("all_reduce", nbytes, Route(False), 0.3), ("all_reduce", nbytes, Route(True), 0.2)], {"u8"}),
    ]:
        config = tj.TacoConfig.preset("taco", min_bytes=0, link=_profile(timings))
        fn, hlo = _compiled(mesh, lambda v: tj.all_reduce(v, "tensor", config), x)
        assert {c.dtype for c in tj.collectives_in_hlo(hlo)} == dtypes
        plain = np.asarray(jax.block_until_ready(_compiled(mesh, lambda v: lax.psum(v, "tensor"), x)[0](x)))
        error = np.linalg.norm(np.asarray(jax.block_until_ready(fn(x))) - plain) / np.linalg.norm(plain)
        assert error == 0.0 if dtypes == {"f32"} else 1e-3 < error < 0.06


def test_probe_times_every_candidate_route():
    mesh = tj.make_mesh(2, 1, 2, devices=jax.devices()[:4])
    messages = [
        Message("all_reduce", (8, 256), "bfloat16"),
        Message("reduce_scatter", (8, 256), "float32"),
        Message("all_reduce", (8, 256), "bfloat16"),
    ]
    lines = []
    profile = probe_link(
        mesh, messages, tj.TacoConfig.preset("taco"), chunk_counts=(1, 2), trials=1, calls=1, log=lines.append
    )
    assert len(lines) == 2  # the duplicate message is timed once
    assert sorted((t.op, t.route.name) for t in profile.timings) == sorted(
        [(op, name) for op in ("all_reduce", "reduce_scatter") for name in ("plain", "one_shot/1", "one_shot/2")]
    )
    assert all(t.ranks == 2 and t.ms > 0 for t in profile.timings)
    assert profile.route("all_reduce", 2, 8 * 256 * 2) in {t.route for t in profile.timings}
    with pytest.raises(ValueError, match="does not split"):
        probe_link(mesh, [Message("reduce_scatter", (3, 256), "float32")], tj.TacoConfig.preset("taco"))


def test_trainer_resolves_taco_policy(tmp_path):
    with pytest.raises(ValueError, match="taco_policy"):
        TrainConfig.from_keys(taco_policy="sometimes")
    cfg = TrainConfig.from_keys(mesh=(1, 1, 2), out=str(tmp_path))
    resolved = link_policy.choose(cfg, "taco", None, lambda: [], tmp_path, log=lambda line: None)
    assert resolved.taco_policy == "always"  # on CPU there is no link to measure
    assert compression.taco_config(resolved).link is None
    path = tmp_path / "link_profile.json"
    path.write_text(json.dumps({"profile": _profile(FAST_LINK).to_json()}))
    reused = dataclasses.replace(cfg, taco_policy=str(path))
    assert compression.taco_config(reused).link == _profile(FAST_LINK)
    with pytest.raises(ValueError, match="cannot be read"):
        compression.taco_config(dataclasses.replace(cfg, taco_policy=str(tmp_path / "missing.json")))


def test_tp_overlap_auto_takes_the_faster_measured_step(tmp_path, monkeypatch):
    """tp_overlap=auto: off where there is nothing to measure (CPU, no tensor axis);
    where there is, the step's gradients are timed without collective matmuls, with them
    everywhere and at each site alone, the gaining sites together, and the fastest
    setting is used and written down."""
    lines = []
    cfg = TrainConfig.from_keys(
        model="gpt2-tiny",
        mesh=(2, 1, 4),
        batch_size=8,
        seq_len=32,
        out=str(tmp_path),
        tp_overlap="auto",
        sequence_parallel=True,
        taco_policy="always",
    )
    assert link_policy.choose_overlap(cfg, lambda s: 1.0, tmp_path, lines.append).tp_overlap == "off"
    assert lines == ["tp_overlap=auto: off (no link to measure on CPU)"]
    gaining = "layers.attn.in,layers.mlp.in,head.in"
    times = {
        "off": 2.0,
        "on": 1.9,
        "layers.attn.in": 1.8,
        "layers.attn.out": 2.1,
        "layers.mlp.in": 1.7,
        "layers.mlp.out": 2.2,
        "head.in": 1.95,
        gaining: 1.5,
    }
    timed = []
    chosen = link_policy.choose_overlap(
        cfg, lambda s: timed.append(s) or times[s], tmp_path, lines.append, measure=True
    )
    assert timed == list(times) and chosen.tp_overlap == gaining and lines[-1] == f"tp_overlap=auto: -> {gaining}"
    assert json.loads((tmp_path / "overlap_probe.json").read_text()) == {"seconds": times, "chosen": gaining}
    # Where every site or none gains alone, the settings already timed decide.
    times.update({"head.in": 2.5, "layers.attn.in": 2.5, "layers.mlp.in": 2.5})
    assert link_policy.choose_overlap(cfg, times.__getitem__, None, lines.append, measure=True).tp_overlap == "on"
    with pytest.raises(ValueError, match="tp_overlap must be on, off, auto or a comma-separated list of sites"):
        cfg.with_keys(tp_overlap="sometimes")
    with pytest.raises(ValueError, match=r"unknown sites \['layers.attn'\]"):
        cfg.with_keys(tp_overlap="layers.attn,head.in")
    assert config_lib.overlap_sites(" head.in, layers.mlp.out ") == frozenset({"head.in", "layers.mlp.out"})

    # The trainer's own timer, on the CPU mesh (the decision itself is the machine's): two
    # of the sites, one timed call per setting and uncompressed messages keep the
    # compiles few and small.
    cfg = cfg.with_keys(taco="off")
    monkeypatch.setattr(link_policy, "_why_not_time_overlap", lambda cfg: None)
    monkeypatch.setattr(link_policy, "OVERLAP_SITES", ("layers.attn.in", "head.in"))
    monkeypatch.setattr(link_policy, "OVERLAP_PROBE_STEPS", 1)
    model_config = tj.models.preset(cfg.model)
    mesh = run_state.device_mesh(cfg)
    tx, _ = optimizer.make_optimizer(cfg, model_config)
    params, _ = optimizer.init_state(model_config, 0, mesh, tx)
    feedback = compression.init_error_feedback(cfg, model_config, params, mesh)
    tokens = data_lib.batch_maker(cfg, mesh)(np.arange(4096) % 64, 0, cfg.batch_size)
    resolved = trainer.resolve_link_choices(cfg, model_config, mesh, (params, tokens, feedback), tmp_path)
    probe = json.loads((tmp_path / "overlap_probe.json").read_text())
    assert resolved.tp_overlap == probe["chosen"] and all(t > 0 for t in probe["seconds"].values())


def test_without_a_profile_bytes_decide_off_gpu_and_latency_on_gpu(monkeypatch):
    """With no link to measure (CPU), "auto" takes the all-reduce that sends fewer bytes:
    two-shot beyond two ranks (2 (k-1)/k compressed messages per rank against one-shot's
    k - 1), one-shot at two (the same bytes, one quantization). On GPUs small messages
    take one-shot (one exchange's latency)."""
    from taco_jax import policy

    small, large = 64 << 10, 4 << 20
    assert [policy.default_algorithm(k, small) for k in (2, 4, 8)] == ["one_shot", "two_shot", "two_shot"]
    assert policy.default_algorithm(4, large) == "two_shot"
    monkeypatch.setattr(policy.jax, "default_backend", lambda: "gpu")
    assert [policy.default_algorithm(k, small) for k in (2, 4)] == ["one_shot", "one_shot"]
    assert policy.default_algorithm(4, large) == "two_shot"
    assert route_for("all_reduce", 4, small, compresses=True, link=None, chunks=1, algorithm="auto").algorithm == (
        "one_shot"
    )
