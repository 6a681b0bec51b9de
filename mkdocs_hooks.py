"""mkdocs hooks: the generated configuration reference, the measurement tables and
figures rendered from `benchmarks/results/` (`benchmarks.report`), and a build that fails
on an undocumented public name of the API pages, on a page whose tables differ from their
result files, and on a measured figure typed by hand outside them (`mkdocs build --strict`
turns every warning, a broken link or a missing reference included, into a failure too)."""

from __future__ import annotations

import html
import importlib
import inspect
import json
import posixpath
import subprocess
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from benchmarks import report

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
FIGURES_DIR = "figures"


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
        rows.append(
            f'| <code class="key">{key}</code> | <code class="key">{html.escape(default)}</code> | {text.replace("|", chr(92) + "|")} |'
        )
    return "\n".join(rows)


def _repository_url(root: Path) -> str | None:
    """The clone's `origin`, as a web address, where it has one."""
    found = subprocess.run(["git", "remote", "get-url", "origin"], cwd=root, capture_output=True, text=True)
    url = found.stdout.strip().removesuffix(".git")
    if found.returncode or not url:
        return None
    if url.startswith("git@"):
        url = "https://" + url.removeprefix("git@").replace(":", "/", 1)
    return url if url.startswith("https://") else None


def on_config(config):
    # The header links to the repository this clone came from (none for a local one).
    config.repo_url = config.repo_url or _repository_url(Path(config.config_file_path).parent)
    return config


def on_pre_build(config) -> None:
    missing = [name for module in API_MODULES for name in undocumented(module)]
    if missing:
        raise PluginError(f"public API without a docstring: {', '.join(missing)}")
    problems = []
    for page in report.pages():
        text = page.read_text()
        if report.rendered(text) != text:
            problems.append(f"{page.name}: a results table differs from its file (python -m benchmarks.report)")
        problems += [f"{page.name}: measured figure typed by hand: {line}" for line in report.hand_typed(text)]
    if problems:
        raise PluginError("\n".join(problems))


def on_files(files, config):
    # Each figure the pages ask for, drawn from its result file into the site.
    for name, figure in report.FIGURES.items():
        files.append(File.generated(config, f"{FIGURES_DIR}/{name}.png", content=figure.draw()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = markdown.replace(CONFIG_MARKER, config_reference())
    here = posixpath.dirname(page.file.src_uri)
    return report.FIGURE.sub(
        lambda m: report.render_figure(m["name"], posixpath.relpath(f"{FIGURES_DIR}/{m['name']}.png", here or ".")),
        markdown,
    )
