"""The version floor (.ci/floor.txt) agrees with pyproject.toml, and dsfix passes the dtype keyword that the
installed transformers reads."""
from __future__ import annotations

import re

import pytest

from patcher.checkpoint.check.load import dtype_kwarg
from smokekit import REPO


def _floor() -> dict:
    pins = {}
    for line in (REPO / ".ci" / "floor.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def _lower_bound(name: str) -> str:
    found = set(re.findall(r'"%s>=([0-9.]+)[,"]' % re.escape(name), (REPO / "pyproject.toml").read_text()))
    assert len(found) == 1, f"pyproject.toml should state one lower bound for {name}: {found}"
    return found.pop()


@pytest.mark.parametrize("name", ["torch", "transformers", "safetensors", "deepspeed"])
def test_pyproject_states_the_tested_floor(name):
    """The lower bound is the floor CI tests, given to as many places as pyproject.toml writes: torch>=2.1
    holds 2.1.2, and not 2.10."""
    bound = _lower_bound(name).split(".")
    assert _floor()[name].split(".")[:len(bound)] == bound


def test_the_floor_runs_numpy_2():
    """The floor env proves the save needs no numpy: torch before 2.3 cannot use numpy 2."""
    assert _floor()["numpy"].startswith("2.")
    assert tuple(int(x) for x in _floor()["torch"].split(".")[:2]) < (2, 3)


@pytest.mark.parametrize("version,keyword", [
    ("4.51.0", "torch_dtype"),
    ("4.55.4", "torch_dtype"),
    ("4.56.0", "dtype"),
    ("4.57.1", "dtype"),
    ("4.57.0.dev0", "dtype"),
    ("5.0.0", "dtype"),
    ("5.25.0", "dtype"),
])
def test_dtype_keyword_by_version(version, keyword):
    assert dtype_kwarg(version) == keyword


@pytest.mark.slow
def test_the_installed_transformers_reads_the_keyword(tiny_qwen3_helper):
    """The keyword chosen for this transformers is the one it honours: the model comes out in that dtype."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    config = tiny_qwen3_helper.tiny_qwen3_config(num_hidden_layers=1)
    model = AutoModelForCausalLM.from_config(config, **{dtype_kwarg(): torch.float16})
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_the_save_module_states_the_tested_floor():
    """The module `dsfix apply` copies beside the user's utils.py says which versions it runs with: CI's floor."""
    import ast

    source = (REPO / "templates" / "dsfix_safetensors.py").read_text(encoding="utf-8")
    doc = " ".join(ast.get_docstring(ast.parse(source)).split())
    pins = _floor()
    torch, transformers = (pins[name].rsplit(".", 1)[0] for name in ("torch", "transformers"))
    floor = (f"Python 3.9+, torch {torch}+, transformers {transformers}+, safetensors {pins['safetensors']}+, "
             f"DeepSpeed {pins['deepspeed']}+")
    assert floor in doc


def test_every_verb_reads_its_annotated_options():
    """typer reads `Annotated[..., typer.Argument(...)]` from each verb's signature; under postponed annotations
    (`from __future__ import annotations`) typer on Python 3.9 sees only strings and turns every argument into an
    option named after it, so that `dsfix apply PATH` fails with "unexpected extra argument". Run in every CI
    environment, the floor's Python 3.9 included."""
    import typer.main

    from patcher.cli import app

    group = typer.main.get_command(app)
    positional = {name: [p.name for p in cmd.params if p.param_type_name == "argument"]
                  for name, cmd in group.commands.items()}
    assert positional == {"check": ["repo"], "apply": ["repo"], "revert": ["repo"], "verify": ["folder"],
                          "convert": ["folder"], "smoke": ["repo"], "demo": []}
    options = {p.opts[0] for p in group.commands["convert"].params if p.param_type_name == "option"}
    assert {"--output", "--base", "--merge", "--json"} <= options
