"""The trainer on simulated CPU devices: mesh equivalence, pipeline gradients, resume,
signals, NaN steps, errors, and two processes through jax.distributed."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import taco_jax as tj
from taco_jax import models, strict_json
from taco_jax.hlo import dtype_bytes
from taco_jax.train import calibrate, compression, metrics, optimizer, run_state, signals, trainer
from taco_jax.train import data as data_lib
from taco_jax.train.checkpoint import Checkpointer
from taco_jax.train.config import TrainConfig, apply_overrides, parse_key_values
from taco_jax.train.data import TokenData, batch, load
from taco_jax.train.errors import TrainingError
from tests.conftest import cpu_env

ROOT = Path(__file__).resolve().parent.parent
# A corpus of byte tokens long enough for any split (for setup checks).
BYTES = TokenData(np.zeros(1000, np.int32), np.zeros(1000, np.int32), 256, "bytes")
SMALL = dict(model="gpt2-tiny", taco="off", steps=3, batch_size=8, seq_len=32, eval_every=1000, warmup_steps=1)


def _cfg(tmp_path, name, **overrides):
    return TrainConfig.from_keys(**{**SMALL, "out": str(tmp_path / name), **overrides})


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _cli(args, devices, env_extra=None, **kwargs):
    env = {**cpu_env(devices), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "taco_jax.train", "--no-progress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def _cli_args(cfg_overrides):
    return [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in cfg_overrides.items()]


def test_meshes_match_the_single_device_run(tmp_path):
    single = _cli(["--mesh", "1,1,1", "--out", str(tmp_path / "single"), *_cli_args({**SMALL, "microbatches": 2})], 1)
    assert single.returncode == 0, single.stderr[-2000:]
    reference = _losses(tmp_path / "single")
    for mesh in [(2, 2, 2), (1, 2, 4), (8, 1, 1)]:
        cfg = _cfg(
            tmp_path,
            "x".join(map(str, mesh)),
            mesh=mesh,
            microbatches=2 if mesh[0] < 8 else 1,
            batch_size=8 if mesh[0] < 8 else 16,
        )
        if mesh[0] == 8:  # a dp8 step over 16 sequences is two single-device steps' worth: compare loss per sequence
            cfg = _cfg(tmp_path, "dp8", mesh=mesh, batch_size=8)
        trainer.train(cfg, progress=False)
        np.testing.assert_allclose(_losses(cfg.out), reference, rtol=2e-5, err_msg=str(mesh))


@pytest.mark.parametrize("mesh", [(1, 2, 4), (1, 4, 2)], ids=["dp1_pp2_tp4", "dp1_pp4_tp2"])
def test_pipeline_gradients_equal_the_sequential_model(mesh):
    config = models.GPT2Config(n_layers=4)
    cfg = TrainConfig.from_keys(model="gpt2-tiny", mesh=mesh, taco="off", batch_size=8, seq_len=32, microbatches=4)
    params = models.init_params(config, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (8, 33)), jnp.int32)
    pipe_mesh = tj.make_mesh(*mesh)
    loss, grads, _ = jax.jit(trainer.make_grads_fn(cfg, config, pipe_mesh))(
        models.shard_params(params, config, pipe_mesh), tokens, {}
    )
    ref_loss, ref_grads = models.loss_and_grads(
        config, params, tokens, mesh=tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_resume_continues_bit_exactly(tmp_path):
    # Calibrated after step 2, before the interruption: the checkpoint carries it.
    calibrated = dict(taco="taco", calibration_steps=2, checkpoint_every=3)
    straight = _cfg(tmp_path, "straight", steps=6, **calibrated)
    assert trainer.train(straight, progress=False)["calibrated_sites"] == 6
    first = _cfg(tmp_path, "resumed", steps=3, decay_steps=6, **calibrated)
    trainer.train(first, progress=False)
    decided = json.loads((Path(first.out) / "calibration.json").read_text())["calibration"]
    (Path(first.out) / "calibration.json").unlink()
    summary = trainer.train(_cfg(tmp_path, "resumed", steps=6, **calibrated), resume=True, progress=False)
    assert summary["steps"] == 6 and summary["calibrated_sites"] == 6
    assert not (Path(first.out) / "calibration.json").exists()  # restored, not recalibrated
    assert _losses(first.out) == _losses(straight.out)
    restored = Checkpointer(Path(first.out) / "checkpoints", 3)
    assert restored.meta(6)["calibration"] == decided
    restored.close()
    again = trainer.train(
        _cfg(tmp_path, "resumed", steps=7, **{**calibrated, "calibration_steps": 1}, recalibrate=True),
        resume=True,
        progress=False,
    )
    assert again["calibrated_sites"] == 6 and (Path(first.out) / "calibration.json").exists()
    with pytest.raises(ValueError, match="already holds checkpoints"):
        trainer.train(first, progress=False)


def test_sigterm_saves_a_restorable_checkpoint(tmp_path):
    out = tmp_path / "signal"
    env = cpu_env(8)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "taco_jax.train",
            "--no-progress",
            "--out",
            str(out),
            "--steps",
            "500",
            *_cli_args({k: v for k, v in SMALL.items() if k != "steps"}),
            "checkpoint_every=1000",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads(stdout[stdout.index("{") :])
    assert summary["stopped_by"] == "SIGTERM" and 3 <= summary["steps"] < 500
    steps_done = summary["steps"]
    resumed = trainer.train(
        _cfg(tmp_path, "signal", steps=steps_done + 2, checkpoint_every=1000), resume=True, progress=False
    )
    assert resumed["steps"] == steps_done + 2 and len(_losses(out)) == steps_done + 2


def test_nan_steps_are_skipped_then_stop(tmp_path):
    cfg = _cfg(tmp_path, "nan", steps=5, debug_nan_steps=(1, 2), checkpoint_every=1, keep_checkpoints=5)
    summary = trainer.train(cfg, progress=False)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["finite"] for r in rows] == [True, False, False, True, True]
    assert summary["skipped_steps"] == 2
    # A skipped step leaves parameters and optimizer state exactly as they were.
    checkpoints = Checkpointer(Path(cfg.out) / "checkpoints", keep=5)
    states = [
        checkpoints.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
        for step in (1, 2, 3, 4)
    ]
    for skipped in states[1:3]:
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), states[0], skipped)
    assert not np.array_equal(
        np.asarray(states[3]["params"]["final"]["norm_scale"]), np.asarray(states[0]["params"]["final"]["norm_scale"])
    )
    checkpoints.close()
    with pytest.raises(TrainingError, match="3 consecutive non-finite steps"):
        trainer.train(_cfg(tmp_path, "nan_stop", steps=6, debug_nan_steps=(1, 2, 3), max_bad_steps=3), progress=False)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="= 6 devices, but 8"):
        trainer.train(_cfg(tmp_path, "mesh", mesh=(1, 2, 3)), progress=False)
    with pytest.raises(ValueError, match="unknown config keys"):
        apply_overrides(TrainConfig(), {"learning_rate": "1"})
    with pytest.raises(ValueError, match="batch_size 9 is not divisible"):
        TrainConfig.from_keys(batch_size=9)
    with pytest.raises(ValueError, match="steps: expected an integer"):
        apply_overrides(TrainConfig(), parse_key_values(["steps=many"]))
    with pytest.raises(ValueError, match="3 layers do not split into pipe=2"):
        run_state.check_setup(TrainConfig.from_keys(mesh=(1, 2, 4)), models.GPT2Config(n_layers=3), BYTES)
    with pytest.raises(ValueError, match="sample_tokens 4000 must be >= 0 and, after a 32-token prompt, within"):
        run_state.check_setup(TrainConfig.from_keys(sample_tokens=4000), models.preset("gpt2-tiny"), BYTES)
    cfg = _cfg(tmp_path, "corrupt", steps=2, checkpoint_every=2)
    trainer.train(cfg, progress=False)
    for path in (Path(cfg.out) / "checkpoints" / "2").rglob("*"):
        if path.is_file() and "state" in str(path):
            path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="checkpoint at step 2 .* cannot be restored"):
        trainer.train(_cfg(tmp_path, "corrupt", steps=4), resume=True, progress=False)
    with pytest.raises(ValueError, match="no checkpoint"):
        trainer.train(_cfg(tmp_path, "empty"), resume=True, progress=False)
    failed = _cli(["--steps", "1", "--out", str(tmp_path / "cli"), "lr"], 8)
    assert failed.returncode != 0 and "not key=value" in failed.stderr
    not_taco = _cli(["--calibrate-only", "--taco", "fp8", "--out", str(tmp_path / "cli_fp8")], 8)
    assert not_taco.returncode == 2 and "needs a taco preset" in not_taco.stderr
    bad_spec = _cli(["--steps", "1", "--out", str(tmp_path / "cli_spec"), "taco_forward=int8:128:yes:bf16"], 8)
    assert bad_spec.returncode == 2 and "is not fmt:group_size:H|-:scales" in bad_spec.stderr
    with pytest.raises(ValueError, match="calibration_strategy must be one of"):
        TrainConfig.from_keys(calibration_strategy="sorted")
    with pytest.raises(ValueError, match="taco_pipe must be a TACO preset.*'tacoo'"):
        TrainConfig.from_keys(taco_pipe="tacoo")
    with pytest.raises(ValueError, match="taco_data must be a TACO preset"):
        apply_overrides(TrainConfig(), {"taco_data": "8bit"})
    with pytest.raises(ValueError, match="taco_data_backward: .*not fmt:group_size"):
        TrainConfig.from_keys(taco_data_backward="int4")


def test_data_order_is_a_function_of_seed_and_position(tmp_path):
    corpus = load("shakespeare", val_fraction=0.05)
    assert corpus.vocab_size == 256 and len(corpus.train) > 4_000_000
    a = batch(corpus.train, seed=1, position=7, batch_size=4, seq_len=16)
    np.testing.assert_array_equal(a, batch(corpus.train, seed=1, position=7, batch_size=4, seq_len=16))
    assert not np.array_equal(a, batch(corpus.train, seed=1, position=8, batch_size=4, seq_len=16))
    tokens = np.arange(1000, dtype=np.uint16) % 50
    tokens.tofile(tmp_path / "tokens.bin")
    np.save(tmp_path / "tokens.npy", tokens.astype(np.uint32))
    for name in ("tokens.bin", "tokens.npy"):
        data = load(str(tmp_path / name), val_fraction=0.1)
        assert data.vocab_size == 50 and len(data.train) == 900
    with pytest.raises(ValueError, match="does not exist"):
        load(str(tmp_path / "missing.npy"), val_fraction=0.1)
    with pytest.raises(ValueError, match="text file with tokenizer=FOLDER"):
        (tmp_path / "corpus.txt").write_text("to be or not to be " * 100)
        load(str(tmp_path / "corpus.txt"), val_fraction=0.1)


def test_text_with_a_local_huggingface_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("to be or not to be " * 100)
    data = load(str(tmp_path / "corpus.txt"), val_fraction=0.1, tokenizer=str(tmp_path / "tok"))
    assert data.vocab_size == 5 and list(data.train[:6]) == [1, 2, 3, 4, 1, 2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_on_a_cross_process_mesh(tmp_path):
    port = _free_port()
    env = cpu_env(4)
    args = [
        "--no-progress",
        "--mesh",
        "2,1,4",
        "--out",
        str(tmp_path / "mp"),
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        *_cli_args({**SMALL, "taco": "taco", "calibration_steps": 2}),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "taco_jax.train", *args, "--process-id", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # a hung worker ignores SIGTERM
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    summary = json.loads(outputs[0][0][outputs[0][0].index("{") :])
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    assert len(_losses(tmp_path / "mp")) == 3 and summary["calibrated_sites"] == 6


def test_default_yaml_matches_the_dataclass_defaults():
    from taco_jax.train.config import load_yaml

    assert apply_overrides(TrainConfig(), load_yaml("default")) == TrainConfig()


def test_simulated_mesh_reproduces_the_device_mesh(tmp_path):
    """The same run as named vmaps on one device (quality studies on one GPU)."""
    run = dict(mesh=(2, 2, 2), taco="taco", sequence_parallel=True, calibration_steps=2)
    real = _cfg(tmp_path, "real", **run)
    simulated = _cfg(tmp_path, "simulated", **run, simulate_mesh=True)
    assert trainer.train(simulated, progress=False)["calibrated_sites"] == 12
    trainer.train(real, progress=False)
    np.testing.assert_allclose(_losses(simulated.out), _losses(real.out), rtol=1e-4)


def test_simulated_shard_map_splits_and_merges_by_spec():
    from jax.sharding import PartitionSpec as P

    x = np.arange(24.0).reshape(4, 6)
    fn = tj.simulated_shard_map(
        lambda a: (jax.lax.psum(a, "tensor"), a * jax.lax.axis_index("tensor")),
        {"data": 2, "tensor": 3},
        (P("data", "tensor"),),
        (P("data"), P("data", "tensor")),
    )
    total, scaled = fn(jnp.asarray(x))
    np.testing.assert_array_equal(total, x.reshape(4, 3, 2).sum(1))
    np.testing.assert_array_equal(scaled, x * np.repeat(np.arange(3), 2))
    with pytest.raises(ValueError, match="not divisible by mesh axis tensor=4"):
        tj.simulated_shard_map(lambda a: a, {"tensor": 4}, (P("tensor"),), P("tensor"))(jnp.ones(6))


def test_standalone_calibration_feeds_other_runs(tmp_path):
    """With taco+mixed, calibration also picks each site's format (fewer bits where the
    error fits), and the run that loads it sends fewer bytes than taco+'s 8 bits."""
    observing = _cfg(tmp_path, "calibrate", taco="taco+mixed", calibration_steps=2)
    summary = trainer.calibrate_only(observing)
    assert summary["calibrated_sites"] == 6 and summary["step"] == 0
    assert sum(summary["sites_with_fewer_bits"].values()) >= 1
    assert not (Path(observing.out) / "metrics.jsonl").exists()  # nothing was trained
    decided = calibrate.load_calibration(summary["file"])
    run = _cfg(tmp_path, "uses_it", taco="taco+mixed", steps=2, calibration_file=summary["file"])
    loop = trainer.setup_train_loop(run)
    try:
        trainer.train_loop(loop, signals.StopFlag())
        reported, compiled, _ = _loop_bytes(loop)
    finally:
        loop.run.close()
    assert loop.run.calibration == decided and reported == compiled
    row = _rows(run.out)[-1]
    assert row["wire_bytes_by_axis"] == compiled
    assert 0 < row["wire_bytes_by_axis"]["tensor"] < 0.5 * row["wire_bytes_bf16_by_axis"]["tensor"]
    assert not (Path(run.out) / "calibration.json").exists()  # loaded, not observed
    checkpoint = Checkpointer(Path(run.out) / "checkpoints", 3)
    assert tj.calibration.Calibration.from_json(checkpoint.meta(2)["calibration"]) == decided
    checkpoint.close()
    _resume_keeps_the_checkpoints_calibration(run, observing, decided)
    with pytest.raises(ValueError, match="needs a taco preset"):
        trainer.calibrate_only(_cfg(tmp_path, "fp8", taco="fp8"))
    with pytest.raises(ValueError, match="cannot be read"):
        trainer.train(
            _cfg(tmp_path, "missing", taco="taco", calibration_file=str(tmp_path / "nope.json")), progress=False
        )


def _resume_keeps_the_checkpoints_calibration(run, observing, decided):
    """A resume takes the calibration its checkpoint holds: the calibration_file changed
    or gone since the run started is an error naming it (before anything compiles), and
    --force resumes with the checkpoint's calibration; --calibrate-only does not
    overwrite a calibration.json without --force."""
    from taco_jax.train import cli

    file = Path(run.calibration_file)
    more = run.with_keys(steps=3)
    changed = decided.to_json()
    changed["plans"][0]["hadamard"] = not changed["plans"][0]["hadamard"]
    file.write_text(json.dumps({"calibration": changed}))
    with pytest.raises(ValueError, match=f"--resume: calibration_file {file} has changed since the run started"):
        trainer.train(more, resume=True, progress=False)
    file.unlink()
    with pytest.raises(ValueError, match=f"--resume: calibration_file {file} cannot be read"):
        trainer.train(more, resume=True, progress=False)
    loop = trainer.setup_train_loop(more, resume=True, force=True)
    loop.run.close()
    assert loop.run.calibration == decided and loop.run.step == 2
    file.write_text(json.dumps({"calibration": decided.to_json()}))
    args = ["--no-progress", "--calibrate-only", "--out", observing.out, *_cli_args({**SMALL, "taco": "taco+mixed"})]
    assert cli.main(args) == 2 and cli.main([*args, "--resume"]) == 2
    assert calibrate.load_calibration(Path(observing.out) / "calibration.json") == decided


ALL_AXES_COMPRESSED = dict(taco="taco+", taco_pipe="taco+", taco_data="taco+", calibration_steps=0)


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_pipe_and_data_compression_with_error_feedback_resumes_bit_exactly(tmp_path):
    base = dict(mesh=(2, 2, 2), microbatches=2, steps=4, checkpoint_every=2)
    off = _cfg(tmp_path, "off", **base)
    trainer.train(off, progress=False)
    straight = _cfg(tmp_path, "straight", **base, **ALL_AXES_COMPRESSED)
    trainer.train(straight, progress=False)
    # Every non-scalar collective of the compiled step (the same program: a cache hit),
    # attributed to its mesh axis by its replica groups, against what the run reported
    # (several layers per stage: tests/test_models.py, test_wire_ledger_counts_every_layer_both_ways).
    loop = trainer.setup_train_loop(dataclasses.replace(straight, out=str(tmp_path / "hlo")))
    try:
        reported, compiled, counted = _loop_bytes(loop)
    finally:
        loop.run.close()
    assert reported == compiled == counted == _rows(straight.out)[0]["wire_bytes_by_axis"] and all(compiled.values())
    off_losses, losses = np.array(_losses(off.out)), np.array(_losses(straight.out))
    assert np.all(np.abs(losses / off_losses - 1) < 0.01) and np.all(losses != off_losses)
    off_row, row = _rows(off.out)[0], _rows(straight.out)[0]
    for r in (off_row, row):
        assert set(r["wire_bytes_by_axis"]) == set(r["wire_bytes_bf16_by_axis"]) == {"tensor", "pipe", "data"}
    assert off_row["wire_bytes_bf16_by_axis"] == row["wire_bytes_bf16_by_axis"]
    # float32 gradients in mode off; one bucket of 8-bit codes and scales when compressed.
    assert off_row["wire_bytes_by_axis"]["data"] == 2 * off_row["wire_bytes_bf16_by_axis"]["data"]
    assert 0.45 < row["wire_bytes_by_axis"]["data"] / row["wire_bytes_bf16_by_axis"]["data"] < 0.55
    assert row["wire_bytes_by_axis"]["pipe"] < off_row["wire_bytes_by_axis"]["pipe"]

    first = _cfg(tmp_path, "resumed", **{**base, "steps": 2, "decay_steps": 4}, **ALL_AXES_COMPRESSED)
    trainer.train(first, progress=False)
    trainer.train(
        _cfg(tmp_path, "resumed", **{**base, "decay_steps": 4}, **ALL_AXES_COMPRESSED), resume=True, progress=False
    )
    assert _losses(first.out) == _losses(straight.out)
    saved = []
    for run in (straight, first):
        checkpoints = Checkpointer(Path(run.out) / "checkpoints", 3)
        assert checkpoints.meta(4)["error_feedback"] is True
        saved.append(checkpoints.manager.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"])
        checkpoints.close()
    residuals = [jax.tree.leaves(s["error_feedback"]) for s in saved]
    assert any(np.abs(np.asarray(r)).max() > 0 for r in residuals[0])
    for a, b in zip(*residuals):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Turning the data-parallel compression off on resume drops the residuals.
    plain = straight.with_keys(steps=5, decay_steps=4, taco_data="off")
    assert trainer.train(plain, resume=True, progress=False)["steps"] == 5


def _compiled_bytes_by_axis(train_step, state, tokens, mesh) -> dict[str, int]:
    """What each rank sends per step on each mesh axis, read from the compiled step's
    non-scalar collectives (loops counted by their trip counts), each attributed to its axis
    by its replica groups."""
    hlo = train_step.lower(*state, tokens, jnp.bool_(False)).compile().as_text()
    compiled = {"tensor": 0, "pipe": 0, "data": 0}
    for collective, times, _ in tj.hlo.collectives_with_counts(hlo):
        arrays = [int(np.prod(shape)) * dtype_bytes(dtype) for dtype, shape in collective.parts if shape]
        if not arrays or not collective.sent_bytes:
            continue  # scalars (the loss, the gradient norm); a sum over one device sends nothing
        (axis,) = collective.mesh_axes(mesh)
        compiled[axis] += times * collective.sent_bytes * sum(arrays) // collective.result_bytes
    return compiled


def _loop_bytes(loop) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """What the loop reports one step sends, what its compiled step sends, and what
    `wire_bytes_per_step` counts once the step is compiled, per axis."""
    run = loop.run
    state, tokens = (run.params, run.opt_state, run.feedback), loop.batch_of(run.corpus.train, 0, run.cfg.batch_size)
    compiled = _compiled_bytes_by_axis(loop.train_step, state, tokens, run.mesh)
    return loop.wire.sent, compiled, metrics.wire_bytes_per_step(loop.train_step, state, tokens).sent


def test_reported_wire_bytes_are_those_of_the_compiled_step_after_calibration(tmp_path):
    """The bytes in the metrics rows and the summary are those of the step that trains:
    off and taco4 report their compiled steps, also when the step was traced before the
    count, with scanned layers rematerialized (recomputing a layer sends nothing again)
    and sequence parallelism (its parameter-gradient sums counted); taco+mixed calibrated
    in the run reports, from the calibrated step on, what the calibrated step sends
    (taco+ on every axis: `test_pipe_and_data_compression_with_error_feedback_resumes_bit_exactly`; taco+mixed
    from a file: `test_standalone_calibration_feeds_other_runs`)."""
    layouts = dict(sequence_parallel=True, scan_layers=True, calibration_steps=0)
    for preset, remat in (("off", "block"), ("taco4", "dots")):
        loop = trainer.setup_train_loop(_cfg(tmp_path, preset, taco=preset, remat=remat, **layouts))
        try:
            reported, compiled, counted_after_compiling = _loop_bytes(loop)
        finally:
            loop.run.close()
        assert reported == compiled == counted_after_compiling and compiled["tensor"] > 0
    in_run = _cfg(tmp_path, "in_run", taco="taco+mixed", steps=2, calibration_steps=1)
    loop = trainer.setup_train_loop(in_run)
    try:
        trainer.train_loop(loop, signals.StopFlag())
        reported, compiled, _ = _loop_bytes(loop)
        summary = metrics.summary(loop.run, _rows(in_run.out), loop.wire, None, 0.0)
    finally:
        loop.run.close()
    before, after = (row["wire_bytes_by_axis"] for row in _rows(in_run.out))
    assert reported == compiled == after == summary["wire_bytes_by_axis"]
    assert after["tensor"] < 0.9 * before["tensor"] and sum(summary["sites_with_fewer_bits"].values()) >= 1


def test_resume_refuses_a_changed_run_and_keeps_its_config(tmp_path):
    """A taco+ run resumed as the fp8 baseline on another mesh and seed is an error naming
    every changed key; config.json stays the run's own."""
    run = _cfg(tmp_path, "changed", taco="taco+", steps=2, checkpoint_every=2, calibration_steps=1)
    trainer.train(run, progress=False)
    config_json = (Path(run.out) / "config.json").read_text()
    changed = run.with_keys(taco="fp8", mesh=(4, 1, 2), seed=7, steps=3)
    with pytest.raises(ValueError, match=r"mesh: \[2, 1, 4\] -> \[4, 1, 2\]; seed: 0 -> 7; taco: 'taco\+' -> 'fp8'"):
        trainer.train(changed, resume=True, progress=False)
    with pytest.raises(ValueError, match="decay_steps: the schedule decays over 2 steps -> 9"):
        trainer.train(dataclasses.replace(run, steps=3, decay_steps=9), resume=True, progress=False)
    assert (Path(run.out) / "config.json").read_text() == config_json
    failed = _cli(["--resume", "--out", run.out, *_cli_args({**SMALL, "taco": "fp8", "steps": 3})], 8)
    assert failed.returncode == 2 and failed.stderr.count("error:") == 1 and "taco: 'taco+' -> 'fp8'" in failed.stderr


def test_resume_to_more_steps_keeps_the_learning_rate_schedule(tmp_path, capsys):
    """steps=3 then resumed to 6: the cosine decay stays where the run put it (the lr at
    its floor from step 3 on), instead of jumping back up to a schedule re-derived for 6
    steps."""
    run = _cfg(tmp_path, "schedule", steps=3, checkpoint_every=3)
    trainer.train(run, progress=False)
    trainer.train(dataclasses.replace(run, steps=6), resume=True, progress=False)
    assert "keeps the schedule the run started with" in capsys.readouterr().err
    lrs = [row["lr"] for row in _rows(run.out)]
    _, rederived = optimizer.make_optimizer(dataclasses.replace(run, steps=6), models.preset(run.model))
    assert lrs[3:] == pytest.approx([run.lr * run.min_lr_ratio] * 3)
    assert float(rederived(3)) > 2 * lrs[3]


def _corrupt(checkpoint_dir: Path, item: str) -> None:
    for path in checkpoint_dir.rglob("*"):
        if path.is_file() and item in str(path.relative_to(checkpoint_dir)):
            path.write_bytes(b"garbage")


def test_resume_falls_back_from_a_corrupt_latest_checkpoint(tmp_path, capsys):
    run = _cfg(tmp_path, "fallback", steps=3, checkpoint_every=1)
    trainer.train(run, progress=False)
    _corrupt(Path(run.out) / "checkpoints" / "3", "state")
    with (Path(run.out) / "metrics.jsonl").open("a") as log:
        log.write('{"step": 4, "lo')  # a crash mid-append
    summary = trainer.train(dataclasses.replace(run, steps=4), resume=True, progress=False)
    err = capsys.readouterr().err
    assert "resuming from step 2: the newer checkpoint(s) cannot be restored (checkpoint at step 3" in err
    assert "1 unreadable line(s) dropped" in err
    assert summary["steps"] == 4 and [row["step"] for row in _rows(run.out)] == [1, 2, 3, 4]


def test_resume_without_readable_metadata_is_a_clear_error(tmp_path):
    run = _cfg(tmp_path, "meta", steps=1)
    trainer.train(run, progress=False)
    _corrupt(Path(run.out) / "checkpoints" / "1", "meta")
    with pytest.raises(ValueError, match="checkpoint at step 1 in .* has no readable metadata"):
        trainer.train(dataclasses.replace(run, steps=2), resume=True, progress=False)


@pytest.mark.parametrize(
    "args, key",
    [
        (["--mesh", "0,1,4"], "mesh must be three positive degrees"),
        (["--mesh", "2,4"], "mesh must be three positive degrees DATA,PIPE,TENSOR, got (2, 4)"),
        (["microbatches=0"], "microbatches must be >= 1"),
        (["grad_accum=0"], "grad_accum must be >= 1"),
        (["batch_size=0"], "batch_size must be >= 1"),
        (["max_bad_steps=0"], "max_bad_steps must be >= 1"),
        (["eval_batches=0"], "eval_batches must be >= 1"),
    ],
)
def test_bad_cli_values_are_one_error_line(args, key, capsys):
    from taco_jax.train import cli

    assert cli.main(["--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: bad training config: ") and key in err


def test_json_outputs_write_non_finite_numbers_as_null():
    text = strict_json.dumps({"loss": float("nan"), "rows": [1.0, float("inf")], "ok": True})
    assert json.loads(text) == {"loss": None, "rows": [1.0, None], "ok": True}


def test_every_process_stops_at_the_step_any_of_them_is_signalled(monkeypatch):
    """A preemption signal on one host stops all hosts together (a host collective of
    the flags), so none waits in a collective for a host that stopped."""
    from jax.experimental import multihost_utils

    flag = signals.StopFlag()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    seen = []
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: seen.append(int(x)) or np.array([0, 1]))
    assert flag.agree() == "a signal to another process" and seen == [0]
    flag(signal.SIGTERM, None)
    assert flag.agree() == "a signal to another process"  # decided once, the same everywhere
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([0, 0]))
    quiet = signals.StopFlag()
    assert quiet.agree() is None


def test_an_installed_package_finds_its_presets(tmp_path):
    """`pip install .` (not editable) ships the preset configs as package data: the
    entry point's --help runs and the presets load from outside the checkout."""
    import importlib.util

    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(target), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"}
    code = (
        "import taco_jax.train.config as c; print(c.__file__); print(c.preset_names()); "
        "print(c.load_yaml('gpt2-small')['model'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0].startswith(str(target)) and "gpt2-small" in out[1] and out[2] == "gpt2-small"
    helped = subprocess.run(
        [sys.executable, "-m", "taco_jax.train", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0 and "--resume" in helped.stdout
    generate = subprocess.run(
        [sys.executable, "-m", "taco_jax.generate", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert generate.returncode == 0 and "--max-new-tokens" in generate.stdout


def test_compression_groups_come_from_the_flat_keys_and_go_back_to_them():
    """The flat keys (YAML, key=value, config.json) fill one group per mesh axis and a
    named mesh shape; `to_dict` writes the same flat keys back."""
    from taco_jax.train.config import AxisCompression, MeshShape, to_dict

    cfg = TrainConfig.from_keys(
        mesh="2,2,2",
        microbatches=2,
        taco="fp8",
        taco_pipe="taco+",
        taco_pipe_forward="int8:64:H:bf16",
        taco_data="taco",
        taco_data_backward="int4:128:H:bf16",
    )
    assert cfg.mesh == MeshShape(data=2, pipe=2, tensor=2) and cfg.mesh.pipe == 2
    assert cfg.compression.tensor == AxisCompression("fp8")
    assert cfg.compression.of("pipe") == AxisCompression("taco+", forward="int8:64:H:bf16")
    assert cfg.compression.data == AxisCompression("taco", backward="int4:128:H:bf16")
    flat = to_dict(cfg)
    assert flat["mesh"] == [2, 2, 2] and flat["taco_pipe_forward"] == "int8:64:H:bf16" and "compression" not in flat
    assert TrainConfig.from_keys(**flat) == cfg and cfg.with_keys(taco="off").compression.pipe == cfg.compression.pipe
    pipe = compression.taco_config(cfg, "pipe")
    assert (
        pipe.forward == tj.QuantSpec.parse("int8:64:H:bf16") and pipe.backward == tj.TacoConfig.preset("taco+").backward
    )
    with pytest.raises(ValueError, match="three positive degrees"):
        TrainConfig.from_keys(mesh="2,2")


def test_the_simulated_mesh_is_visible_to_what_it_traces():
    """Layers choose implementations whose batching rules fit the vmaps by
    `taco_jax.mesh.simulating()`: True inside `simulated_shard_map`, False after."""
    from jax.sharding import PartitionSpec as P

    seen = []

    def body(a):
        seen.append(tj.mesh.simulating())
        return a

    tj.simulated_shard_map(body, {"tensor": 2}, (P("tensor"),), P("tensor"))(jnp.ones(4))
    assert seen == [True] and not tj.mesh.simulating()


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
def test_tp_overlap_trains_as_the_collective_path_does(tmp_path, sequence_parallel):
    """tp_overlap=on runs every tensor-parallel matmul and its collective as a collective
    matmul (the sequence-parallel gather and reduce-scatter, or the all-reduces; a list
    of sites overlaps those only):
    uncompressed, the losses of the collective path to float rounding, with the same
    wire bytes (without sequence parallelism the all-reduces are two-shot, as the
    uncompressed ring all-reduce counts them)."""
    runs = {}
    # Without sequence parallelism, the four layer sites only (the head keeps its collective).
    on = "on" if sequence_parallel else "layers.attn.in,layers.attn.out,layers.mlp.in,layers.mlp.out"
    for overlap, setting in (("off", "off"), ("on", on)):
        cfg = _cfg(tmp_path, f"overlap_{overlap}", sequence_parallel=sequence_parallel, tp_overlap=setting)
        runs[overlap] = trainer.train(cfg, progress=False), _rows(cfg.out)
    (off, off_rows), (on, on_rows) = runs["off"], runs["on"]
    np.testing.assert_allclose([r["loss"] for r in on_rows], [r["loss"] for r in off_rows], rtol=1e-5)
    assert on["wire_bytes_by_axis"] == off["wire_bytes_by_axis"] and on["wire_bytes_by_axis"]["tensor"] > 0
    # Uncompressed float32 messages are twice the size of the same traffic in bf16, and
    # exactly what the same collectives send uncompressed.
    assert off["wire_fraction_by_axis"] == {"tensor": 2.0, "data": 2.0}
    assert off["wire_fraction_of_uncompressed_by_axis"] == {"tensor": 1.0, "data": 1.0}


def test_generate_command_continues_prompts_with_a_runs_checkpoint(tmp_path, capsys):
    """`python -m taco_jax.generate --run DIR` restores the run's newest parameters and
    prints each prompt with its greedy continuation (the shipped byte-level tokens); the
    trainer's own sample at the last evaluation (`sample_tokens`) is the same
    continuation of the validation split's first 32 tokens."""
    from taco_jax.train import sample

    cfg = _cfg(tmp_path, "sampled", steps=3, checkpoint_every=1, sample_tokens=4)
    trainer.train(cfg, progress=False)
    restored_cfg, model_config, params, step = run_state.restore_params(cfg.out)
    assert step == 3 and restored_cfg.model == cfg.model
    prompt = [int(t) for t in data_lib.load("shakespeare", val_fraction=cfg.val_fraction).val[:32]]
    continued = tj.models.generate(model_config, params, [prompt], mesh=tj.make_mesh(*cfg.mesh), max_new_tokens=4)[0]
    assert _rows(cfg.out)[-1]["sample"] == bytes(prompt + continued).decode("utf-8", errors="replace")
    assert "sample" not in _rows(cfg.out)[0]
    args = ["--run", cfg.out, "--prompt", "ROMEO:", "--prompt", "To be", "--max-new-tokens", "5", "--mesh", "1,1,2"]
    assert sample.main(args) == 0
    printed = capsys.readouterr()
    want = tj.models.generate(
        model_config,
        params,
        [list(b"ROMEO:"), list(b"To be")],
        mesh=tj.make_mesh(1, 1, 2, devices=jax.devices()[:2]),
        max_new_tokens=5,
    )
    lines = printed.out.split("-" * 40 + "\n")
    assert lines[0] == "ROMEO:" + bytes(want[0]).decode("utf-8", errors="replace") + "\n"
    assert "10 tokens" in printed.err
    assert sample.main(["--run", cfg.out]) == 2 and "error: give at least one --prompt" in capsys.readouterr().err
    assert sample.main(["--run", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a trainer run directory" in capsys.readouterr().err
    missing = ["--run", cfg.out, "--prompt-file", str(tmp_path / "none.txt")]
    assert sample.main(missing) == 2 and "error: --prompt-file" in capsys.readouterr().err
    # The newest checkpoint unreadable: the one before it, as a resume falls back.
    _corrupt(Path(cfg.out) / "checkpoints" / "3", "state")
    assert sample.main(args) == 0
    assert "using step 2: the newer checkpoint(s) cannot be restored" in capsys.readouterr().err
    for step in (1, 2):
        _corrupt(Path(cfg.out) / "checkpoints" / str(step), "state")
    assert sample.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint at step 3") and "step 1" in err


def test_the_default_demo_says_it_sends_fewer_bytes_than_bf16(tmp_path, capsys):
    """The embedded default (8 CPU devices, tensor=4, taco+) ends with one line giving each
    axis's bytes as a share of what the same collectives send uncompressed, with the
    axis's preset: with no link to measure, the all-reduces take the algorithm that sends
    fewer bytes, so 8-bit tensor traffic is about a quarter of the float32 it replaces
    (half of bf16's); the data axis is plain."""
    from taco_jax.train import cli

    out = tmp_path / "demo"
    args = ["--no-progress", "--steps", "2", "--out", str(out), "eval_every=2", "eval_batches=1", "checkpoint_every=2"]
    assert cli.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    fractions = summary["wire_fraction_of_uncompressed_by_axis"]
    assert 0.2 < fractions["tensor"] < 0.3 and fractions["data"] == 1.0
    assert 0.4 < summary["wire_fraction_by_axis"]["tensor"] < 0.6
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == cli.wire_fraction_line(summary)
    assert f"tensor {100 * fractions['tensor']:.0f}% (taco+)" in line and "data 100% (off)" in line


def test_every_trainer_key_is_described_for_the_configuration_reference():
    """The docs' configuration reference is generated from `TrainConfig`'s docstring:
    every flat key has an entry of its own there, and no two keys share one."""
    from taco_jax.train.config import flat_keys, key_descriptions

    descriptions = key_descriptions()
    assert list(descriptions) == flat_keys()
    assert len(set(descriptions.values())) == len(descriptions)
    assert "AdamW" in descriptions["beta1"] and "second-moment" in descriptions["beta2"]
    assert descriptions["taco_data_backward"].startswith("replace taco_data's quantizer")
