"""Screenshots of the built documentation site, opened from disk as the README tells
readers to open it: the home page, the Flax guide, a reference page, the configuration
reference, and a search typed into the search box (offline search).

    make docs                                   # builds build/site
    pip install '.[screenshots]'                # playwright; Chromium from the system:
    apt-get install chromium                    # Debian's, at /usr/bin/chromium
    python tools/docs_screenshots.py [--out tools/screenshots] [--chromium /usr/bin/chromium]

Each page is checked as it is taken: its tables rendered (no Markdown pipes left in the
text), its figures loaded, and the search answering; a page that fails a check fails the
script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each page, and what to bring into view before the screenshot (None: the top).
PAGES = {
    "home": ("index.html", "table"),
    "flax_guide": ("guides/flax.html", None),
    "reference_tp": ("reference/tp.html", None),
    "configuration": ("reference/config.html", "table"),
    "quality": ("quality.html", "article img"),
}
SEARCH_QUERY = "min_bytes"
# Chromium as a sandboxed-less root process on a machine without a network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--allow-file-access-from-files",
]


def check_page(page, name: str) -> list[str]:
    """What is wrong with the page as shown: Markdown table pipes in the text, tables
    that did not render, images that did not load."""
    problems = []
    text = page.inner_text("article")
    if "|---|" in text:
        problems.append(f"{name}: a Markdown table left unrendered")
    broken = page.evaluate("[...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)")
    problems += [f"{name}: image not loaded: {src}" for src in broken]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, default=ROOT / "build/site")
    parser.add_argument("--out", type=Path, default=ROOT / "tools/screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    if not (args.site / "index.html").exists():
        print(f"error: no site at {args.site}: run `make docs` first", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name, (path, target) in PAGES.items():
            page.goto((args.site / path).resolve().as_uri())
            page.wait_for_load_state("load")
            problems += check_page(page, name)
            if target:
                page.locator(target).first.scroll_into_view_if_needed()
            page.screenshot(path=args.out / f"{name}.png")
            print(f"{name}: {args.out / f'{name}.png'}")
        page.goto((args.site / "index.html").resolve().as_uri())
        page.click("label.md-search__icon, .md-search__input")
        page.fill(".md-search__input", SEARCH_QUERY)
        page.wait_for_selector(".md-search-result__item", timeout=10_000)
        hits = page.locator(".md-search-result__item").count()
        if not hits:
            problems.append(f"search for {SEARCH_QUERY!r} found nothing")
        page.screenshot(path=args.out / "search.png")
        print(f"search: {hits} results for {SEARCH_QUERY!r}, {args.out / 'search.png'}")
        browser.close()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
