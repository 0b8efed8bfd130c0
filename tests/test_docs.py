"""The README and docs/ pages: every local link resolves, the README stays a product page, and
the test command it gives is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_local_link_resolves(page: Path):
    missing = [
        target
        for target in LINK.findall(page.read_text(encoding="utf-8"))
        if not target.startswith(("http://", "https://", "mailto:"))
        and not (page.parent / target).exists()
    ]
    assert missing == [], f"{page.name} links to missing files: {missing}"


#: a results file named in prose or code spans: ``evals/results/NAME``, or a bare
#: ``NAME_h200_<commit>.json`` in backticks (a name that ends in ``*`` or ``<`` is a pattern)
RESULT = re.compile(
    r"(?:evals/results/([\w.\-/]+\w)|`([\w\-]+_(?:h[12]00(?:x2)?|cpu)(?:_[0-9a-f]{7})?\.(?:json|md)))"
    r"(?![\w*<])"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_results_file_a_page_names_exists(page: Path):
    names = {a or b for a, b in RESULT.findall(page.read_text(encoding="utf-8"))}
    missing = sorted(n for n in names if not (REPO / "evals" / "results" / n).exists())
    assert missing == [], (
        f"{page.name} names results files that are not in evals/results: {missing}"
    )


def test_the_results_pattern_skips_globs_and_placeholders():
    text = ("`evals/results/a_h200.json`, `b_cpu.json`, evals/results/throughput_* and "
            "`gpu_tests_h200_<commit>.json`; `c_h100_abc1234.json`.")  # fmt: skip
    assert {a or b for a, b in RESULT.findall(text)} == {
        "a_h200.json", "b_cpu.json", "c_h100_abc1234.json"}  # fmt: skip


def test_the_link_pattern_finds_links_and_drops_anchors():
    text = "see [a](docs/A.md#part), [b](https://x.org/y) and [c](evals/results/c.json)"
    assert LINK.findall(text) == ["docs/A.md", "https://x.org/y", "evals/results/c.json"]


def test_readme_is_a_product_page_and_names_the_ci_test_command():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert 'python -m pytest -m "slow or not slow"' in ci
    assert "python -m pytest" in readme and "python -m pytest -m slow" in readme


def test_readme_recipe_snippet_resolves_from_the_repository_root(tmp_path: Path):
    """The quick-start's ``my-run.yaml`` says it sits in the repository root: its ``base`` paths
    name files there (not ``../recipes/...``), and the file validates from there (here a copy
    beside a link to ``recipes/``, so nothing is written into the checkout)."""
    import yaml

    from poetxq.training.recipe_files import load_recipe

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", readme, flags=re.S)
    snippet = next(b for b in blocks if b.startswith("# my-run.yaml"))
    bases = yaml.safe_load(snippet)["base"]
    assert bases and all((REPO / b).is_file() for b in bases), bases
    (tmp_path / "recipes").symlink_to(REPO / "recipes", target_is_directory=True)
    (tmp_path / "my-run.yaml").write_text(snippet, encoding="utf-8")
    recipe = load_recipe(tmp_path / "my-run.yaml")
    assert recipe.name == "llama-350m" and recipe.model.hidden_size == 1024
    assert recipe.optim.poet_lr == 1e-3 and recipe.train.max_steps == 20000


def test_the_python_api_example_runs(capsys):
    """docs/API.md's example is the documented way in from Python: it runs as written (its own
    asserts: the loss falls over six steps with two merges)."""
    text = (REPO / "docs" / "API.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/API.md", "exec"), {"__name__": "docs_api_example"})
    out = capsys.readouterr().out
    assert "14 layers converted, W0 at 8 bits" in out and "spectrum moved by" in out
