"""mkdocs hooks: the generated configuration reference, and a build that fails on an
undocumented public name of the API pages (`mkdocs build --strict` turns every warning,
a broken link or a missing reference included, into a failure too)."""

from __future__ import annotations

import importlib
import inspect
import json

from mkdocs.exceptions import PluginError

# The modules of the API reference (docs/reference/): every public class and function in
# them, and every public method of those classes, must carry a docstring.
API_MODULES = (
    "taco_jax",
    "taco_jax.tp",
    "taco_jax.flax",
    "taco_jax.models",
    "taco_jax.models.flax_modules",
    "taco_jax.calibration",
    "taco_jax.policy",
    "taco_jax.probe",
    "taco_jax.data_parallel",
    "taco_jax.collective_matmul",
)
CONFIG_MARKER = "<!-- train-config-reference -->"


def undocumented(module_name: str) -> list[str]:
    """Public classes, functions and methods of `module_name` without a docstring."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    missing = []
    for name in names:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not obj.__module__.startswith("taco_jax"):
            continue
        if "__all__" not in vars(module) and obj.__module__ != module_name:
            continue  # imported here for its own use, documented where it is defined
        if not inspect.getdoc(obj):
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if not attr.startswith("_") and inspect.isfunction(function) and not inspect.getdoc(function):
                    missing.append(f"{module_name}.{name}.{attr}")
    return missing


def config_reference() -> str:
    """A Markdown table of every trainer key: name, default, description."""
    from taco_jax.train.config import TrainConfig, key_descriptions, to_dict

    defaults = to_dict(TrainConfig())
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, text in key_descriptions().items():
        default = json.dumps(defaults[key]).replace("|", "\\|")
        rows.append(f"| `{key}` | `{default}` | {text.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def on_pre_build(config) -> None:
    missing = [name for module in API_MODULES for name in undocumented(module)]
    if missing:
        raise PluginError(f"public API without a docstring: {', '.join(missing)}")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CONFIG_MARKER in markdown:
        return markdown.replace(CONFIG_MARKER, config_reference())
    return markdown
