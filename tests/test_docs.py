"""The documentation runs: every Python block of README.md and docs/ (each page's blocks
in order, as one program, on the 8 simulated devices), the printed output a page shows
after a block, the commands of its shell blocks, every docstring example of the API
modules, and every measured figure comes from a result file (`benchmarks.report`)."""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import io
import pkgutil
import re
import shlex
import tomllib
from pathlib import Path

import pytest

import taco_jax
from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
PAGES = list(report.pages())
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
EXCERPT = "<!-- excerpt -->"
CHECKER = doctest.OutputChecker()
OUTPUT_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Every module of the package: the docstring examples in any of them run.
DOCTEST_MODULES = sorted(
    {"taco_jax"} | {m.name for m in pkgutil.walk_packages(taco_jax.__path__, "taco_jax.") if ".__main__" not in m.name}
)


@dataclasses.dataclass
class Block:
    """One fenced code block of a page."""

    lang: str
    code: str
    line: int  # of the opening fence, from 1
    end: int  # the index of the line after the closing fence
    excerpt: bool
    output: str | None = None


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks; a `text` block right after a Python block is its output."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, start = len(opening["indent"]), index
        index += 1
        body = []
        while not FENCE.match(lines[index]) or FENCE.match(lines[index])["lang"]:
            body.append(lines[index][indent:])
            index += 1
        index += 1
        code = "\n".join(body) + "\n"
        excerpt = start > 0 and lines[start - 1].strip() == EXCERPT
        previous = found[-1] if found else None
        between = lines[previous.end : start] if previous else []
        if opening["lang"] == "text" and previous and previous.lang == "python" and not any(s.strip() for s in between):
            previous.output = code
            continue
        found.append(Block(opening["lang"], code, start + 1, index, excerpt))
    return found


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_blocks_are_tagged():
    """Every block names its language, so the tests below know what to run."""
    untagged = [f"{_id(p)}:{b.line}" for p in PAGES for b in blocks(p) if not b.lang]
    assert not untagged, f"code blocks without a language: {untagged}"


def test_few_excerpts():
    """Blocks that only show part of a program are marked, and kept to a minimum."""
    excerpts = [f"{_id(p)}:{b.line}" for p in PAGES for b in blocks(p) if b.excerpt]
    assert len(excerpts) <= 3, excerpts


PYTHON_PAGES = [p for p in PAGES if any(b.lang == "python" and not b.excerpt for b in blocks(p))]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=[_id(p) for p in PYTHON_PAGES])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    """Each page's Python blocks run in order in one namespace, in a scratch directory,
    and print what the page shows after them."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(page):
        if block.lang != "python" or block.excerpt:
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, f"{_id(page)}:{block.line}", "exec"), namespace)
        if block.output is not None and not CHECKER.check_output(block.output, printed.getvalue(), OUTPUT_FLAGS):
            pytest.fail(
                f"{_id(page)}:{block.line} printed\n{printed.getvalue()}\nwhere the page shows\n{block.output}",
                pytrace=False,
            )


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def check_command(words: list[str]) -> None:
    """Raise AssertionError unless the command names what exists: a Makefile target, the
    project's extras, a benchmark module, or a trainer command line the trainer accepts."""
    if words[0] == "make":
        assert set(words[1:]) <= _make_targets(), f"no such make target: {words}"
    elif words[:2] == ["pip", "install"]:
        extras = re.findall(r"\[([\w,]+)\]", words[2])
        assert all(set(e.split(",")) <= _extras() for e in extras), f"no such extra: {words}"
    elif words[:3] == ["python", "-m", "taco_jax.train"] and "--help" not in words:
        from taco_jax.train import cli

        args = cli.build_parser().parse_args(words[3:])
        if not args.resume:
            cli._config(args)  # raises ValueError on a bad key or value
    elif words[:2] == ["python", "-m"] and words[2].startswith(("benchmarks.", "taco_jax.")):
        assert importlib.util.find_spec(words[2]), f"no module {words[2]}"
    else:
        raise AssertionError(f"a command the docs tests do not know how to check: {words}")


SHELL_PAGES = [p for p in PAGES if any(b.lang == "bash" for b in blocks(p))]


@pytest.mark.parametrize("page", SHELL_PAGES, ids=[_id(p) for p in SHELL_PAGES])
def test_shell_commands_name_what_exists(page):
    for block in blocks(page):
        if block.lang != "bash":
            continue
        for line in block.code.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                check_command(words)


def test_docstring_examples_run():
    """The examples in the API's docstrings run and print what they show."""
    runner = doctest.DocTestRunner(optionflags=OUTPUT_FLAGS)
    examples = 0
    for name in DOCTEST_MODULES:
        for test in doctest.DocTestFinder().find(importlib.import_module(name)):
            runner.run(test)
            examples += len(test.examples)
    assert runner.summarize(verbose=False).failed == 0
    assert examples >= 10, f"only {examples} docstring examples"


def test_tables_come_from_their_result_files():
    """Every generated table equals what its result file gives today."""
    stale = [_id(p) for p in PAGES if report.rendered(p.read_text()) != p.read_text()]
    assert not stale, f"run `python -m benchmarks.report`: {stale}"


def test_no_measurement_typed_by_hand():
    found = {_id(p): report.hand_typed(p.read_text()) for p in PAGES}
    assert not {k: v for k, v in found.items() if v}


def test_hand_typed_detects_measurements():
    """The check itself: it finds a measurement in prose and a table, not in a generated
    block, code or a threshold written out."""
    generated = report.rendered("<!-- results: step_tp2 -->\n<!-- /results -->\n")
    assert report.hand_typed(generated) == []
    assert report.hand_typed("the step took 74.6 ms") and report.hand_typed("| a | 1.20x |")
    assert report.hand_typed("gap +0.02 ± 0.03") and not report.hand_typed("clip to ±fmt_max, `51%`")


def test_the_preset_table_has_every_preset():
    """Each preset but "off" has a quality panel in the README's table, so a new preset
    cannot be left out of it, and each row's cells come from that panel's runs."""
    from taco_jax.policy import PRESETS

    assert set(report.PRESET_PANELS) == set(PRESETS) - {"off"}
    text, _ = report.presets()
    rows = text.splitlines()[2:]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == list(report.PRESET_PANELS)
    assert report._cell_gaps("quality_stable.json", "taco+").keys() == {
        (corpus, model)
        for corpus in ("shakespeare", "python-docs", "python-code")
        for model in ("gpt2-40m", "qwen2-40m")
    }
