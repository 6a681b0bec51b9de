"""No lost work: the real trainer (tiny GPT, CPU) under faults. A corrupt newest
checkpoint, a crash mid-save, a second trainer on the same run directory, a save that is
not written, an update that makes the parameters non-finite, and SIGKILL at random
points of 20 runs, after which a resume ends bit-exact with an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from taco_jax.train import cli, run_dir, run_state, trainer
from taco_jax.train.checkpoint import SET_ASIDE_FOLDER, Checkpointer
from taco_jax.train.errors import CheckpointError, TrainingError
from tests.conftest import cpu_env
from tests.test_train import ROOT, SMALL, _cfg, _cli_args, _rows


def _strict_rows(run: Path) -> list[dict]:
    """metrics.jsonl's rows, parsed as strict JSON (NaN or Infinity tokens refused)."""

    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _restored_state(run: Path, step: int) -> dict:
    checkpoints = Checkpointer(run / "checkpoints", 3, writer=False)
    try:
        return checkpoints.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    finally:
        checkpoints.close()


def test_a_corrupt_newest_checkpoint_and_a_crash_mid_save_lose_no_step(tmp_path, capsys):
    """The newest checkpoint loses its array files, a save was cut short (orbax's
    temporary folder left behind) and metrics.jsonl holds a step twice and a cut line:
    the resume falls back to the older step, sets the broken one aside, trains it again
    and saves it for real (orbax declined an existing step silently before), removes
    the temporary folder and keeps one row per step."""
    run = _cfg(tmp_path, "run", steps=3, checkpoint_every=1)
    trainer.train(run, progress=False)
    out = Path(run.out)
    shutil.rmtree(out / "checkpoints" / "3" / "state" / "d")
    partial = out / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([*lines, lines[1], '{"step": 4, "lo']))
    summary = trainer.train(_cfg(tmp_path, "run", steps=3, checkpoint_every=1), resume=True, progress=False)
    err = capsys.readouterr().err
    assert "resuming from step 2: the newer checkpoint(s) cannot be restored (checkpoint at step 3" in err
    assert summary["steps"] == 3 and not partial.exists()
    (aside,) = (out / SET_ASIDE_FOLDER).iterdir()
    assert aside.name.startswith("step_3_")
    checkpoints = Checkpointer(out / "checkpoints", 3)
    assert checkpoints.steps() == [3, 2, 1] and checkpoints.meta(3)["step"] == 3
    checkpoints.close()
    assert [row["step"] for row in _strict_rows(out)] == [1, 2, 3]
    assert run_state.restore_params(out)[3] == 3


def test_a_declined_or_unreadable_save_is_an_error(tmp_path):
    """orbax's save of a step that exists returns False: the checkpointer raises, and a
    checkpoint that does not hold what was saved fails its read-back."""
    state = {"params": {"w": jnp.ones((4, 8))}, "opt_state": (jnp.zeros((), jnp.int32),)}
    checkpoints = Checkpointer(tmp_path / "checkpoints", 3)
    try:
        checkpoints.save(1, state, {"step": 1})
        with pytest.raises(CheckpointError, match="checkpoint at step 1 was not written"):
            checkpoints.save(1, state, {"step": 1})
        other = {"params": {"w": jnp.ones((4, 9))}, "opt_state": (jnp.zeros((), jnp.int32),)}
        with pytest.raises(CheckpointError, match="does not hold what was saved"):
            checkpoints.verify(1, other)
    finally:
        checkpoints.close()


def test_a_second_trainer_on_a_run_directory_is_one_line_before_compiling(tmp_path, capsys, monkeypatch):
    """While a trainer holds the run directory, another gets one `error:` line (exit 2)
    before it builds any state, and the first's files are untouched."""
    out = tmp_path / "busy"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    held = run_dir.RunLock(out)

    def compiled(*args, **kwargs):
        raise AssertionError("the second trainer built its state")

    monkeypatch.setattr(run_state, "_fresh_run", compiled)
    try:
        assert cli.main(["--no-progress", "--out", str(out), *_cli_args(SMALL)]) == 2
    finally:
        held.release()
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and f"the run directory {out} is in use by another trainer (process {os.getpid()})" in err
    )
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_parameters_made_non_finite_are_never_saved(tmp_path, monkeypatch):
    """Finite loss and gradients, but an update that overflows the parameters (here an
    optimizer scaled to Inf): the run stops with an error naming the step before its
    checkpoint, so the newest checkpoint stays the last finite state."""
    infinite = optax.chain(optax.scale(1e30), optax.scale(1e30))  # finite gradients, Inf updates
    make_optimizer = run_state.make_optimizer
    monkeypatch.setattr(run_state, "make_optimizer", lambda cfg, config: (infinite, make_optimizer(cfg, config)[1]))
    cfg = _cfg(tmp_path, "overflow", steps=3, checkpoint_every=1)
    with pytest.raises(TrainingError, match="at step 1 are not finite although every step's loss"):
        trainer.train(cfg, progress=False)
    rows = _strict_rows(Path(cfg.out))
    assert rows[0]["finite"] and np.isfinite(rows[0]["grad_norm"])
    checkpoints = Checkpointer(Path(cfg.out) / "checkpoints", 3)
    assert checkpoints.steps() == []
    checkpoints.close()


# The fault-injection run: enough steps, each with a checkpoint, that random kills land
# in start-up, compiling, steps, saves and the summary alike.
FAULT_STEPS = 40


def _trainer(out: Path, resume: bool, cache: Path) -> subprocess.Popen:
    env = {
        **cpu_env(1),
        # Compiled programs shared by the runs: each restart then spends its time in
        # start-up and training, where the kills should land.
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    settings = {**SMALL, "steps": FAULT_STEPS, "checkpoint_every": 1, "keep_checkpoints": 2}
    args = ["--no-progress", "--mesh", "1,1,1", "--out", str(out), *_cli_args(settings), *(["--resume"] * resume)]
    return subprocess.Popen(
        [sys.executable, "-m", "taco_jax.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> None:
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]


def _has_checkpoint(out: Path) -> bool:
    folder = out / "checkpoints"
    return folder.is_dir() and any(path.name.isdigit() for path in folder.iterdir())


def _logged_steps(out: Path) -> int:
    log = out / "metrics.jsonl"
    return log.read_text().count("\n") if log.exists() else 0


def _kill_at_random(proc: subprocess.Popen, out: Path, rng: np.random.Generator, during_training: bool) -> None:
    """SIGKILL `proc` at a random time: anywhere in its life, or (`during_training`)
    within a few steps after it logs its next ones, so that kills land in steps and
    checkpoint saves too, however long start-up takes."""
    if during_training:
        target, deadline = _logged_steps(out) + int(rng.integers(1, 6)), time.time() + 120
        while proc.poll() is None and _logged_steps(out) < target and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.06))
    else:
        time.sleep(rng.uniform(0.2, 6.0))
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


@pytest.mark.parametrize("kills", [4, pytest.param(20, marks=pytest.mark.slow)])
def test_random_kills_then_resume_end_bit_exact(tmp_path, kills):
    """SIGKILL at a random time in each of `kills` runs of the trainer CLI (each resuming
    the last where a checkpoint exists; half the kills anywhere, half among the steps and
    their saves): the final resume's metrics (one row per step, strict JSON) and
    parameters equal an uninterrupted run's bit for bit, and every kill left the run
    directory resumable (no run exits non-zero). `make test` kills 4 runs, `make
    test-slow` 20."""
    cache = tmp_path / "compiled"
    _finish(_trainer(tmp_path / "straight", False, cache))
    out = tmp_path / "killed"
    rng = np.random.default_rng(20261204)
    for kill in range(kills):
        proc = _trainer(out, _has_checkpoint(out), cache)
        _kill_at_random(proc, out, rng, during_training=kill % 2 == 1)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGKILL), stderr[-3000:]
    _finish(_trainer(out, _has_checkpoint(out), cache))
    want, got = _strict_rows(tmp_path / "straight"), _strict_rows(out)
    assert [row["step"] for row in got] == list(range(1, FAULT_STEPS + 1))
    assert [row["loss"] for row in got] == [row["loss"] for row in want]
    straight, resumed = _restored_state(tmp_path / "straight", FAULT_STEPS), _restored_state(out, FAULT_STEPS)
    jax.tree.map(np.testing.assert_array_equal, resumed["params"], straight["params"])
    assert _rows(out)[-1]["step"] == FAULT_STEPS
