"""Bad input is one `error:` line naming the key, before anything compiles: the trainer's
flags, key=value overrides and YAML files, its run directory and data, and the model
API's token ids (8 CPU devices)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import models
from taco_jax.train import cli, run_state
from taco_jax.train import config as config_lib
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["taco=off", "taco_forward=int4:32:H:bf16"], "taco_forward='int4:32:H:bf16' given with taco=off"),
        (["taco_data_backward=int4:32:H:bf16"], "taco_data_backward='int4:32:H:bf16' given with taco_data=off"),
        (["taco=fp8", "taco_forward=int4:32:H:bf16"], "taco_forward='int4:32:H:bf16' with taco=fp8: mode 'fp8'"),
        (["taco=fp8", "calibration_file=c.json"], "calibration_file='c.json' given with taco=fp8, whose mode 'fp8'"),
        (["taco=off", "calibration_file=c.json"], "calibration_file='c.json' given with taco=off"),
    ],
)
def test_compression_keys_that_contradict_their_preset_are_refused(args, message, tmp_path, capsys):
    """Quantizers given with a preset that compresses nothing or whose mode cannot take
    them, and a calibration file with a mode that is not calibrated: one line naming the
    keys, and nothing written to --out."""
    out = tmp_path / "run"
    assert message in _one_error_line(["--out", str(out), *_cli_args(SMALL), *args], capsys)
    assert not out.exists()


def test_yaml_off_is_the_off_preset_for_the_preset_keys_only(tmp_path):
    """YAML reads an unquoted `off` as False: the preset keys take it as "off"; other
    string keys still refuse a boolean."""
    config = tmp_path / "run.yaml"
    config.write_text("taco: off\ntaco_pipe: off\ntaco_data: off\n")
    cfg = config_lib.apply_overrides(config_lib.TrainConfig(), config_lib.load_yaml(config))
    assert {group.preset for group in (cfg.compression.tensor, cfg.compression.pipe, cfg.compression.data)} == {"off"}
    with pytest.raises(ValueError, match="model: expected a string, got False"):
        config_lib.TrainConfig.from_keys(model=False)
    with pytest.raises(ValueError, match="taco: expected a string, got True"):
        config_lib.TrainConfig.from_keys(taco=True)


PLAN = {"site": "layers.mlp.out", "direction": "forward", "perm": list(range(128)), "hadamard": True}


@pytest.mark.parametrize(
    "plans, taco, message",
    [
        ([{**PLAN, "hadamard": "false"}], "taco+", "'hadamard' must be true or false, got 'false'"),
        ([PLAN, PLAN], "taco+", "two plans for site 'layers.mlp.out', direction 'forward'"),
        ([{**PLAN, "quant": "e9m9:128:H:bf16"}], "taco+mixed", "calibration of site 'layers.mlp.out': "),
        ([{**PLAN, "quant": None}], "taco+mixed", "'quant' must be a spec such as"),
        ([{**PLAN, "perm": [0.5, 1]}], "taco+", "'perm' must be a list of integers"),
        ([{**PLAN, "quant": "e2m3:128:H:bf16"}], "taco4", "does not fit taco=taco4: site 'layers.mlp.out' (forward)"),
        ([{**PLAN, "quant": "e2m3:128:H:bf16"}], "taco+", "format e2m3:128:H:bf16, which the config does not allow"),
        ([{**PLAN, "quant": "e2m1:32:H:bf16"}], "taco+mixed", "its fewer-bits formats: ['int4:32:H:bf16', 'e2m3"),
    ],
    ids=["string_bool", "duplicate", "bad_quant", "null_quant", "fractional_perm", "taco4", "taco+", "unlisted"],
)
def test_a_calibration_file_is_checked_before_the_run_directory_is_made(plans, taco, message, tmp_path, capsys):
    """A calibration file refines the preset and cannot override it: a malformed entry
    or a format the preset does not list among its fewer-bits formats is one line naming
    the file, before anything is written."""
    file = tmp_path / "calibration.json"
    file.write_text(json.dumps({"calibration": {"plans": plans}}))
    out = tmp_path / "run"
    args = ["--out", str(out), *_cli_args(SMALL), f"taco={taco}", f"calibration_file={file}"]
    err = _one_error_line(args, capsys)
    assert message in err and f"calibration_file {file}" in err
    assert not out.exists()
