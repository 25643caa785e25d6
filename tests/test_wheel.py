"""The wheel as a user gets it: built with setuptools' own build backend (what ``python -m build`` runs) from
a copy of the source tree, without a warning about the bundled fixtures; installed into a fresh virtual
environment (``--no-deps``; the dependencies installed for the tests are seen through a path file, so no
network); and run from outside the clone: ``--help``, ``dsfix check`` and ``apply`` on a bundled fixture, and
every module and file the demo reads found in it (the demo itself runs from the clone: tests/test_cli_model.py)."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build, a virtual environment

REPO = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                              ".hypothesis", ".dsfix")
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
ENV["NO_COLOR"] = "1"


def run(cmd, cwd, timeout=300):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's bin folder, a folder outside the clone, the build's output) with dsfix's wheel installed."""
    pytest.importorskip("setuptools")
    base = tmp_path_factory.mktemp("wheel")
    src = shutil.copytree(REPO, base / "src", ignore=SKIP)
    dist = base / "dist"
    build = run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                 "print('built', b.build_wheel(sys.argv[1]))", dist], cwd=src)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("dsfix-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / "bin"
    # the dependencies already installed here (typer, libcst, torch, ...), seen after the venv's own packages;
    # a path line, not a site folder, so an editable install of dsfix here is not seen
    site_dir = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base)
    (Path(site_dir.stdout.strip()) / "test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps", "--no-index",
               "-q", wheel], cwd=base)
    assert pip.returncode == 0, pip.stderr[-3000:]
    outside = base / "user"
    outside.mkdir()
    return bin_dir, outside, build.stdout + build.stderr


def test_the_build_says_nothing_about_the_fixtures(installed):
    _, _, log = installed
    assert "built dsfix-" in log
    assert not re.search(r"would be ignored|absent from the .packages. configuration|Warning", log), log[-3000:]


def test_the_installed_package_is_the_wheels_with_its_fixtures(installed):
    bin_dir, outside, _ = installed
    # what check and apply read, and what the demo's smoke reads: the full Qwen3-0.6B config and the tiny model's
    # helper
    probe = run([bin_dir / "python", "-c", "import patcher; from patcher.resources import resource_path as r; "
                 "print(patcher.__file__); print(r('fixtures', 'checkouts/package/README.md')); "
                 "print(r('templates', 'dsfix_safetensors.py')); "
                 "from patcher.resources import BUNDLED_CONFIG; print(r('fixtures', BUNDLED_CONFIG)); "
                 "print(r('fixtures', 'step1_trainer/tiny_qwen3.py')); "
                 "import patcher.templates.dsfix_safetensors as m; print(m.__file__)"], cwd=outside)
    assert probe.returncode == 0, probe.stderr
    venv_root = bin_dir.parent.resolve()
    assert all(Path(line).resolve().is_relative_to(venv_root) for line in probe.stdout.split()), probe.stdout
    # every module of the source tree, as pyproject.toml lists the packages one by one: the commands' lazy
    # imports (smoke's worker, convert's readers) are all there, as test_cli_model's demo finds them in the clone
    installed = Path(probe.stdout.split()[0]).parent
    modules = {p.relative_to(REPO / "patcher").as_posix() for p in (REPO / "patcher").rglob("*.py")}
    assert modules - {p.relative_to(installed).as_posix() for p in installed.rglob("*.py")} == set()


@pytest.mark.parametrize("command", [[], ["check"], ["apply"], ["revert"], ["smoke"], ["verify"], ["convert"],
                                     ["demo"]])
def test_help_texts_point_to_nothing_a_wheel_lacks(installed, command):
    bin_dir, outside, _ = installed
    p = run([bin_dir / "dsfix", *command, "--help"], cwd=outside)
    assert p.returncode == 0, p.stderr
    assert not re.search(r"README|CONTRIBUTING|docs/|\.md\b", p.stdout), p.stdout


def test_check_and_apply_on_a_bundled_fixture_from_outside_the_clone(installed):
    bin_dir, outside, _ = installed
    where = run([bin_dir / "python", "-c", "from patcher.demo import demo_checkout_source as s; print(s())"],
                cwd=outside)
    co = shutil.copytree(where.stdout.strip(), outside / "DeepSpeed-Chat")
    check = run([bin_dir / "dsfix", "check", co], cwd=outside)
    assert check.returncode == 1, check.stderr
    assert "+def save_hf_format_safetensors(" in check.stdout
    assert run([bin_dir / "dsfix", "apply", co], cwd=outside).returncode == 0
    assert run([bin_dir / "dsfix", "check", co], cwd=outside).returncode == 0
    assert run([bin_dir / "dsfix", "revert", co], cwd=outside).returncode == 0
