"""Bad input is one `error:` line naming the key, before anything compiles: the trainer's
flags, key=value overrides and YAML files, its run directory and data, and the model
API's token ids (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import models
from taco_jax.train import cli, run_state
from tests.test_train import SMALL, _cli_args


def _one_error_line(args: list[str], capsys) -> str:
    try:
        status = cli.main(["--no-progress", *args])
    except SystemExit as exit:  # argparse's usage errors
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("mesh: [2, 1.9, 4]\n", "mesh: expected an integer, got 1.9"),
        ("steps: 2.7\n", "steps: expected an integer, got 2.7"),
        ("batch_size: true\n", "batch_size: expected an integer, got True"),
        ("out: {a: 1}\n", "out: expected a string, got {'a': 1}"),
        ("lr: .nan\n", "lr must be a finite number > 0, got nan"),
        ("steps: [3\n", "is not valid YAML"),
    ],
)
def test_yaml_values_that_would_be_truncated_are_refused(yaml_text, message, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml_text)
    assert message in _one_error_line(["--config", str(config)], capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "2,1.5,4"], "mesh: expected an integer, got '1.5'"),
        (["--steps", "2.7"], "steps: expected an integer, got '2.7'"),
        (["debug_nan_steps=x"], "debug_nan_steps: expected an integer, got 'x'"),
        (["--seed", str(2**70)], "seed must be in [0, 2**32), got 1180591620717411303424"),
        (["data_seed=4294967296"], "data_seed must be -1 (the seed) or in [0, 2**32)"),
        (["data_dtype=junk"], "data_dtype must be an integer dtype"),
        (["lr=nan"], "lr must be a finite number > 0, got nan"),
        (["lr=-1e-3"], "lr must be a finite number > 0"),
        (["beta2=1.0"], "beta2 must be in [0, 1), got 1.0"),
        (["grad_clip=inf"], "grad_clip must be a finite number > 0"),
        (["min_lr_ratio=2"], "min_lr_ratio must be a finite number >= 0 and <= 1"),
        (["--out", ""], "out must be a non-empty path"),
        (["--steps"], "argument --steps: expected one argument"),
    ],
)
def test_bad_values_name_their_key(args, message, capsys):
    assert message in _one_error_line(args, capsys)


def test_a_run_directory_that_cannot_be_written_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    """--out that is a file, or lies under one: one line, and no state is built."""
    monkeypatch.setattr(run_state, "_fresh_run", lambda *a: pytest.fail("built state for an unusable --out"))
    file = tmp_path / "file"
    file.write_text("x")
    assert f"out: {file} is a file" in _one_error_line(["--out", str(file), *_cli_args(SMALL)], capsys)
    under = file / "run"
    assert f"out: cannot create the run directory {under}" in _one_error_line(
        ["--out", str(under), *_cli_args(SMALL)], capsys
    )


@pytest.mark.parametrize(
    "tokens, extra, message",
    [
        (np.r_[np.arange(5000) % 256, -1], [], "token ids must be >= 0, found -1"),
        (np.zeros(0, np.int32), [], "holds no tokens"),
        (np.arange(5000) % 300, [], "the data has token ids up to 299 but model gpt2-tiny has vocab_size 256"),
        (np.arange(2000) % 256, ["val_fraction=0.01"], "the validation split of"),
        (np.arange(2000) % 256, ["val_fraction=0.99"], "the training split of"),
    ],
    ids=["negative", "empty", "vocabulary", "short_validation", "short_training"],
)
def test_data_that_does_not_fit_is_refused_before_compiling(tokens, extra, message, tmp_path, capsys, monkeypatch):
    """Token ids outside the model's vocabulary (below 0 too), no tokens, or a split too
    short for one sequence: one line at setup, not a failure at the first evaluation."""
    monkeypatch.setattr(run_state, "_fresh_run", lambda *a: pytest.fail("built state for data that does not fit"))
    data = tmp_path / "tokens.npy"
    np.save(data, np.asarray(tokens, np.int32))
    args = ["--out", str(tmp_path / "run"), *_cli_args(SMALL), f"data={data}", *extra]
    assert message in _one_error_line(args, capsys)


@pytest.mark.parametrize("bad", [-1, 256, 10**6])
def test_the_model_api_refuses_token_ids_outside_the_vocabulary(bad):
    config = models.preset("gpt2-tiny")
    params = models.init_params(config, jax.random.key(0))
    tokens = np.ones((2, 9), np.int32)
    tokens[1, 4] = bad
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        models.logits(config, params, tokens[:, :-1])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        models.loss_and_grads(config, params, tokens)
    with pytest.raises(ValueError, match="integer token ids"):
        models.logits(config, params, jnp.ones((2, 8), jnp.float32))
