"""The layout holds for the real imports: `pallas_kernels` <- `taco_jax` <- `models` <-
`train`, with the integrations (`taco_jax/integrations`) above the library and using
only its public names, each module within its size (700 lines; the trainer 500), and a
compressed collective's code in a few modules (at most 8)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cpu_env

ROOT = Path(__file__).resolve().parent.parent
# Each folder, the package it installs as, and the packages it must not import.
LAYERS = {
    "pallas_kernels": ("taco_jax.kernels", ("taco_jax",)),
    "taco_jax": ("taco_jax", ("taco_jax.models", "taco_jax.train", "taco_jax.integrations")),
    "taco_jax/integrations": ("taco_jax.integrations", ("taco_jax.models", "taco_jax.train")),
    "models": ("taco_jax.models", ("taco_jax.train",)),
    "train": ("taco_jax.train", ()),
}
MAX_LINES = 700
MAX_TRAINER_LINES = 500


def _modules(folder: str) -> list[Path]:
    """The folder's own .py files (not those reached through taco_jax's links)."""
    return sorted(path for path in (ROOT / folder).glob("*.py") if not path.is_symlink())


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("folder", list(LAYERS))
def test_imports_point_one_way(folder):
    package, forbidden = LAYERS[folder]
    allowed = package if folder == "pallas_kernels" else None
    for path in _modules(folder):
        wrong = {
            name
            for name in _imports(path, package)
            for banned in forbidden
            if (name == banned or name.startswith(banned + ".")) and not (allowed and name.startswith(allowed))
        }
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_integrations_use_the_public_api():
    for path in _modules("taco_jax/integrations"):
        private = {
            name
            for name in _imports(path, "taco_jax.integrations")
            if name.startswith("taco_jax.") and any(part.startswith("_") for part in name.split("."))
        }
        assert not private, f"{path.relative_to(ROOT)} imports private names {sorted(private)}"


def test_modules_stay_within_their_size():
    sizes = {path: len(path.read_text().splitlines()) for folder in LAYERS for path in _modules(folder)}
    too_long = {str(path.relative_to(ROOT)): lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
    assert sizes[ROOT / "train" / "trainer.py"] <= MAX_TRAINER_LINES


# A fresh process lowers one compressed all-gather (taco+, every message compressed) on 4
# CPU devices and prints the library modules whose functions ran while it was traced.
MODULES_RUN = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import taco_jax as tj

mesh = jax.make_mesh((4,), ("tensor",))
config = tj.TacoConfig.preset("taco+", min_bytes=0)
gather = jax.jit(jax.shard_map(lambda v: tj.all_gather(v, "tensor", config), mesh=mesh, in_specs=P("tensor"),
                               out_specs=P("tensor")))
x = jax.device_put(jnp.ones((256, 256), jnp.bfloat16), NamedSharding(mesh, P("tensor")))
ran = set()

def profile(frame, event, arg):
    name = frame.f_globals.get("__name__") or ""
    if event == "call" and name.startswith("taco_jax"):
        ran.add(name)

sys.setprofile(profile)
gather.lower(x)
sys.setprofile(None)
print(json.dumps(sorted(ran)))
"""
MAX_MODULES_RUN = 8


def test_a_compressed_all_gather_runs_in_few_modules():
    """Adding to the data path touches few files: plan and calls (`collectives`), the
    message (`message`), the config and route (`policy`), the ledger (`accounting`), and
    in the kernels the formats, the wire message, the backend table and the platform."""
    env = cpu_env(4)
    out = subprocess.run([sys.executable, "-c", MODULES_RUN], env=env, capture_output=True, text=True, check=True)
    modules = json.loads(out.stdout.splitlines()[-1])
    assert "taco_jax.message" in modules and "taco_jax.kernels.wire" in modules, modules  # the codec ran
    assert len(modules) <= MAX_MODULES_RUN, f"{len(modules)} modules run a compressed all-gather: {modules}"
