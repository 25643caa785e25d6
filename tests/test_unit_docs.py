"""The documents hold together: the README stays short, every relative link leads to a file, and the PyPI
description (which a wheel user reads away from the clone) links only to the project's own addresses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short():
    assert len((REPO / "README.md").read_bytes()) <= 12 * 1024


def test_readme_quotes_the_error_and_names_the_fast_tier():
    text = (REPO / "README.md").read_text()
    assert ("Some tensors share memory, this will lead to duplicate memory on disk and potential differences "
            "when loading them again") in text
    assert 'python -m pytest -m "not slow"' in text


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "pypi.md"], ids=lambda d: d.name)
def test_relative_links_lead_to_files(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert broken == []


def test_the_pypi_description_links_only_to_the_projects_own_addresses():
    """No address that is not true: docs/pypi.md links only below pyproject's project URLs (none while dsfix has
    no public address), and never relatively (a wheel user reads it away from the clone)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["readme"] == {"file": "docs/pypi.md", "content-type": "text/markdown"}
    urls = [u.rstrip("/") for u in (meta.get("urls") or {}).values()]
    links = LINK.findall((REPO / "docs" / "pypi.md").read_text())
    assert all(any(link == u or link.startswith(u + "/") for u in urls) for link in links), links
    assert "http" not in (REPO / "docs" / "pypi.md").read_text() or urls


def test_every_package_of_patcher_is_in_the_wheel():
    """pyproject.toml lists the packages the wheel holds: a new sub-folder of patcher/ must be named there, or
    the installed dsfix lacks it (the tests, run from the clone, would not notice)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "patcher").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_the_checks_run_first_in_ci_pinned_and_named_in_contributing():
    """`.ci/lint` (ruff and mypy) is what CONTRIBUTING gives to run before a commit, and CI's first check: started
    in the background with the installs, before the main environment is made, and waited for (a finding ends
    the run) before any test runs; the installs still running are then ended, since the run's exit ends their
    process groups. Its own environment's packages are pinned."""
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    first_install = min(i for i, line in enumerate(steps) if "pip install" in line)
    first_test = min(i for i, line in enumerate(steps) if "pytest" in line or line.startswith("test_env "))
    background = [line for line in steps[:first_install] if "envs.sh" in line or ".ci/lint" in line]
    assert any(".ci/lint" in line for line in background), steps[:first_install]
    assert all(line.startswith("setsid ") and line.endswith("&") for line in background), background
    assert any(line.startswith("trap ") and 'kill -- "-$pid"' in line for line in steps[:first_install])
    waited = [i for i, line in enumerate(steps) if line.startswith("wait ") and "lint_pid" in line]
    assert waited and waited[0] < first_test, "lint's result is known before any test runs"
    assert any(line.startswith("exit ") and "lint" in line for line in steps[waited[0]:first_test])
    assert any(line.startswith(".ci/lint ") for line in (REPO / "CONTRIBUTING.md").read_text().splitlines())
    pins = [line for line in (REPO / ".ci" / "lint.txt").read_text().splitlines() if line and line[0] != "#"]
    assert pins and all(re.fullmatch(r"[a-z]+==[0-9.]+", p) for p in pins), pins
