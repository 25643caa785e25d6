"""Every argument error of the torch side answers in one line before torch is imported (and a folder with nothing
to convert in the lines of its answer), and no line dsfix prints on these paths is over 200 characters. One real
process runs the whole table through ``patcher.cli.main``, checking after each row that neither torch nor
transformers was imported (a row that imported them would make the rows after it fail too: the first failure
names the culprit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from patchkit import CLEAN_ENV, REPO, copy_fixture, width

pytestmark = pytest.mark.slow  # one real process for the whole table, and three checkout copies: about 6 s

FILE_RULE = "is a file, not a folder; pass the folder that holds it"
UTILS = "dschat/utils/utils.py"

CURE = ("dsfix: error: BINS: no config.json beside pytorch_model.bin, as save_16bit_model writes it: add --config "
        "MODEL_DIR --output OUT")
MODEL_FOLDER = ("nothing to convert in SAFETENSORS: a Hugging Face model folder already (model.safetensors, "
                "config.json)", "check it with: dsfix verify SAFETENSORS")

ROWS = [  # (id, arguments, exit code, the one stderr line, or the lines of a result: placeholders in capitals are
    # paths made below)
    ("verify: no such folder", ["verify", "MISSING"], 2, "dsfix: error: MISSING: no such folder"),
    ("verify: a file", ["verify", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("verify: no weights", ["verify", "EMPTY"], 2,
     "dsfix: error: EMPTY: no model weights (model.safetensors or model.safetensors.index.json) in this folder"),
    ("verify: a .bin folder", ["verify", "BINS"], 2,
     "dsfix: error: BINS: no safetensors weights, only pytorch_model.bin (a pickle save); nothing to verify "
     "(`dsfix convert` turns it into safetensors)"),
    ("verify: no folder given", ["verify"], 2, "dsfix: error: Missing argument 'folder'."),
    ("convert: no such folder", ["convert", "MISSING"], 2, "dsfix: error: MISSING: no such folder"),
    ("convert: a file", ["convert", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("convert: an empty folder", ["convert", "EMPTY"], 2,
     "dsfix: error: EMPTY: no pytorch_model.bin (also not in actor/, critic/, actor_ema/), no latest, no "
     "checkpoint-N/; found an empty folder"),
    ("convert: a .bin alone, --config without config.json", ["convert", "BINS", "--config", "EMPTY", "--output",
                                                              "EMPTY"], 2,
     "dsfix: error: EMPTY: --config: no config.json in this folder"),
    ("convert: --dtype on a .bin folder, no --output", ["convert", "BINCFG", "--dtype", "bf16"], 2,
     "dsfix: error: BINCFG: --dtype goes with --output OUT; without it a .bin folder is converted in place, in its "
     "own dtype"),
    ("convert: --config on a .bin folder, no --output", ["convert", "BINCFG", "--config", "SAFETENSORS"], 2,
     "dsfix: error: BINCFG: --config goes with --output OUT; without it this .bin folder is converted in place, "
     "with its own config.json"),
    ("convert: --remove-bin into --output", ["convert", "BINCFG", "--output", "EMPTY/out", "--remove-bin"], 2,
     "dsfix: error: BINCFG: --remove-bin is for a .bin folder converted in place; into --output it is left as it is"),
    ("convert: --tag on a .bin folder", ["convert", "BINCFG", "--output", "EMPTY/out", "--tag", "global_step1"], 2,
     "dsfix: error: BINCFG: --tag is for DeepSpeed checkpoints (latest, checkpoint-N/), not a .bin folder"),
    ("convert: --output on a step-3 folder", ["convert", "STEP3", "--output", "EMPTY/out"], 2,
     "dsfix: error: STEP3: --output: a step-3 folder's actor/, critic/, actor_ema/ are converted in place, without "
     "options"),
    ("convert: --output on a folder of neither kind", ["convert", "KEPT", "--output", "EMPTY/out"], 2,
     "dsfix: error: KEPT: no pytorch_model.bin (also not in actor/, critic/, actor_ema/), no latest, no "
     "checkpoint-N/; found DeepSpeed-Chat/"),
    ("convert: pytorch_model.bin alone", ["convert", "BINS"], 2, CURE),
    ("convert: pytorch_model.bin alone, --output only", ["convert", "BINS", "--output", "EMPTY/out"], 2, CURE),
    ("convert: pytorch_model.bin alone, --config only", ["convert", "BINS", "--config", "SAFETENSORS"], 2, CURE),
    ("convert: a Hugging Face model folder", ["convert", "SAFETENSORS"], 0, MODEL_FOLDER),
    ("convert: a Hugging Face model folder, --output", ["convert", "SAFETENSORS", "--output", "EMPTY/out"], 0,
     MODEL_FOLDER),
    ("convert: safetensors without config.json", ["convert", "NOCONFIG"], 0,
     "nothing to convert in NOCONFIG: it is already safetensors (model.safetensors)"),
    ("convert: an engine checkpoint without --output", ["convert", "ENGINE"], 2,
     "dsfix: error: ENGINE: a DeepSpeed checkpoint is converted into a new folder: convert needs --output OUT_DIR "
     "(new or empty)"),
    ("convert: an engine checkpoint without config.json", ["convert", "ENGINE", "--output", "EMPTY/out"], 2,
     "dsfix: error: ENGINE: no config.json here (engine.save_checkpoint writes none): convert needs --config "
     "MODEL_DIR, the model's folder"),
    ("convert: accelerate's save_state without --config", ["convert", "ACCEL", "--output", "EMPTY/out"], 2,
     "dsfix: error: ACCEL: no config.json here (accelerate's save_state writes none): convert needs --config "
     "MODEL_DIR, the model's folder (ADAPTER_DIR for PEFT)"),
    ("convert: a Trainer run's last checkpoint without config.json", ["convert", "RUN", "--output", "EMPTY/out"], 2,
     "dsfix: error: RUN/checkpoint-10: no config.json here (this checkpoint-N has none): convert needs --config "
     "MODEL_DIR, the model's folder"),
    ("convert: a Trainer run, --tag a checkpoint it lacks", ["convert", "RUN", "--tag", "checkpoint-9"], 2,
     "dsfix: error: RUN: --tag checkpoint-9: no such checkpoint here; the run saved checkpoint-2, checkpoint-10"),
    ("convert: a Trainer run, --tag a step folder", ["convert", "RUN", "--tag", "global_step2"], 2,
     "dsfix: error: RUN: --tag global_step2: here --tag names a checkpoint-N (checkpoint-2, checkpoint-10); for a "
     "step, give that checkpoint-N"),
    ("convert: a Trainer run without DeepSpeed", ["convert", "PLAINRUN", "--output", "EMPTY/out"], 0, (
        "PLAINRUN: a Trainer run folder",
        "chose checkpoint-3 (the last of checkpoint-3, as transformers' get_last_checkpoint picks it)",
        "nothing to convert in PLAINRUN/checkpoint-3: a Hugging Face model folder already (model.safetensors, "
        "config.json)",
        "check it with: dsfix verify PLAINRUN/checkpoint-3")),
    ("convert: a Trainer run whose last checkpoint holds neither", ["convert", "PARTRUN", "--output", "EMPTY/out"], 2,
     "dsfix: error: PARTRUN: checkpoint-3 holds no DeepSpeed checkpoint (no latest): found model.safetensors, "
     "trainer_state.json"),
    ("convert: --config names a file", ["convert", "ENGINE", "--config", "FILE", "--output", "EMPTY/out"], 2,
     f"dsfix: error: FILE: {FILE_RULE}"),
    ("convert: --remove-bin on an engine checkpoint", ["convert", "ENGINE", "--remove-bin"], 2,
     "dsfix: error: --remove-bin is for .bin output folders; a DeepSpeed checkpoint is left as it is"),
    ("smoke: a file", ["smoke", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("smoke: --config names a folder", ["smoke", "PATCHED", "--config", "EMPTY"], 2,
     "dsfix: error: EMPTY: is a folder; --config names a config.json (--model takes a model folder)"),
    ("check: --main names a folder", ["check", "PATCHED", "--main", "EMPTY"], 2,
     "dsfix: error: EMPTY: --main: is a folder; --main names a script (the step-1 main.py, say)"),
    ("check: a file", ["check", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("apply: a file", ["apply", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("revert: a file", ["revert", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("smoke: no such folder", ["smoke", "MISSING"], 2,
     "dsfix: error: MISSING: no such file or folder; pass a DeepSpeed-Chat checkout or a folder inside it"),
    ("smoke: never patched", ["smoke", "UNPATCHED"], 2,
     f"dsfix: error: UNPATCHED: {UTILS} defines no save_hf_format_safetensors: this checkout was never patched: "
     "run `dsfix apply` first"),
    ("smoke: utils.py does not parse", ["smoke", "BROKEN"], 2, "dsfix: error: PARSE_ERROR"),
    ("smoke: --model is missing", ["smoke", "PATCHED", "--model", "MISSING"], 2,
     "dsfix: error: MISSING: no such folder"),
    ("smoke: --model is a file", ["smoke", "PATCHED", "--model", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("smoke: --model without config.json", ["smoke", "PATCHED", "--model", "EMPTY"], 2,
     "dsfix: error: EMPTY: not a model folder (no config.json)"),
    ("smoke: --config is missing", ["smoke", "PATCHED", "--config", "MISSING"], 2,
     "dsfix: error: MISSING: no such config file"),
    ("smoke: --model and --config", ["smoke", "PATCHED", "--model", "EMPTY", "--config", "FILE"], 2,
     "dsfix: error: give --model or --config, not both"),
    ("smoke: --keep is a file", ["smoke", "PATCHED", "--keep", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("smoke: --keep is not empty", ["smoke", "PATCHED", "--keep", "BINS"], 2,
     "dsfix: error: BINS: --keep folder must be new or empty"),
    ("smoke: a bad option value", ["smoke", "PATCHED", "--zero-stage", "5"], 2,
     "dsfix: error: Invalid value for '--zero-stage': 5 is not in the range 0<=x<=3."),
    ("demo: --keep is a file", ["demo", "--keep", "FILE"], 2, f"dsfix: error: FILE: {FILE_RULE}"),
    ("demo: --keep holds a demo checkout", ["demo", "--keep", "KEPT"], 2,
     "dsfix: error: KEPT/DeepSpeed-Chat already exists; pick an empty --keep folder"),
]

DRIVER = """
import contextlib, io, json, sys
from patcher import cli

rows = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(args)
            code = None
        except SystemExit as e:
            code = e.code
    rows.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(),
                 "imported": [m for m in ("torch", "transformers") if m in sys.modules]})
print(json.dumps(rows))
"""


def _paths(tmp_path) -> dict:
    """The paths the rows name, made here: folders of each kind, a checkout patched and one that does not parse."""
    from patcher.patch import flow

    made = {"MISSING": tmp_path / "no" / "such", "FILE": tmp_path / "notes.txt", "EMPTY": tmp_path / "empty",
            "BINS": tmp_path / "bins", "SAFETENSORS": tmp_path / "st", "ENGINE": tmp_path / "ckpt",
            "KEPT": tmp_path / "kept", "ACCEL": tmp_path / "state", "RUN": tmp_path / "run",
            "PLAINRUN": tmp_path / "plainrun", "BINCFG": tmp_path / "chat", "NOCONFIG": tmp_path / "noconfig",
            "STEP3": tmp_path / "step3", "PARTRUN": tmp_path / "partrun"}
    made["FILE"].write_text("not a folder\n")
    for key in ("EMPTY", "BINS", "SAFETENSORS", "KEPT", "BINCFG", "NOCONFIG"):
        made[key].mkdir()
    (made["BINS"] / "pytorch_model.bin").write_bytes(b"")  # save_16bit_model's: the .bin alone
    (made["BINCFG"] / "pytorch_model.bin").write_bytes(b"")  # DeepSpeed-Chat's: beside config.json
    (made["BINCFG"] / "config.json").write_text("{}")
    (made["SAFETENSORS"] / "model.safetensors").write_bytes(b"")  # save_pretrained's, save_only_model's
    (made["SAFETENSORS"] / "config.json").write_text("{}")
    (made["NOCONFIG"] / "model.safetensors").write_bytes(b"")
    for sub in ("actor", "critic"):  # DeepSpeed-Chat's step 3
        (made["STEP3"] / sub).mkdir(parents=True)
        (made["STEP3"] / sub / "pytorch_model.bin").write_bytes(b"")
        (made["STEP3"] / sub / "config.json").write_text("{}")
    (made["ENGINE"] / "global_step1").mkdir(parents=True)
    (made["ENGINE"] / "latest").write_text("global_step1")
    (made["ENGINE"] / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (made["KEPT"] / "DeepSpeed-Chat").mkdir()
    # accelerate's save_state with a DeepSpeed plugin: latest names pytorch_model/, random_states_R.pkl beside it
    (made["ACCEL"] / "pytorch_model").mkdir(parents=True)
    (made["ACCEL"] / "latest").write_text("pytorch_model")
    (made["ACCEL"] / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (made["ACCEL"] / "random_states_0.pkl").write_bytes(b"")
    for n in (2, 10):  # a Trainer run folder whose checkpoints lack config.json; the last is checkpoint-10, not -2
        step = made["RUN"] / f"checkpoint-{n}" / f"global_step{n}"
        step.mkdir(parents=True)
        (step.parent / "latest").write_text(step.name)
        (step.parent / "trainer_state.json").write_text("{}")
        (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    (made["PLAINRUN"] / "checkpoint-3").mkdir(parents=True)  # a Trainer run without DeepSpeed
    for name in ("config.json", "model.safetensors", "trainer_state.json"):
        (made["PLAINRUN"] / "checkpoint-3" / name).write_text("{}")
    (made["PARTRUN"] / "checkpoint-3").mkdir(parents=True)  # neither a checkpoint nor a model folder
    for name in ("model.safetensors", "trainer_state.json"):
        (made["PARTRUN"] / "checkpoint-3" / name).write_text("{}")
    made["UNPATCHED"] = copy_fixture("package", tmp_path / "unpatched")
    made["PATCHED"] = copy_fixture("package", tmp_path / "patched")
    flow.apply(made["PATCHED"])
    made["BROKEN"] = copy_fixture("package", tmp_path / "broken")
    flow.apply(made["BROKEN"])
    utils = made["BROKEN"] / UTILS
    utils.write_bytes(utils.read_bytes() + b"\n\ndef broken(:\n    pass\n")
    return made


def _python_says(path) -> str:
    """``FILE:LINE: does not parse: <Python's message>``, as Python itself reports the file."""
    try:
        compile(path.read_bytes(), UTILS, "exec")
    except SyntaxError as e:
        return f"{UTILS}:{e.lineno}: does not parse: {e.msg}"
    raise AssertionError("the file parses")


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("errors")
    made = _paths(tmp_path)

    def fill(text):
        for key in sorted(made, key=len, reverse=True):
            text = text.replace(key, str(made[key]))
        return text.replace("PARSE_ERROR", _python_says(made["BROKEN"] / UTILS))

    argv = [[fill(a) for a in row[1]] for row in ROWS]
    p = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argv)], env={**CLEAN_ENV, "PYTHONPATH": str(REPO)},
                       capture_output=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return {row[0]: (answer, row[2], [fill(line) for line in ([row[3]] if isinstance(row[3], str) else row[3])])
            for row, answer in zip(ROWS, json.loads(p.stdout))}


@pytest.mark.parametrize("name", [row[0] for row in ROWS])
def test_answers_in_one_line_before_torch(answers, name):
    answer, code, lines = answers[name]
    assert answer["stderr"].splitlines() == lines and answer["code"] == code, answer
    assert answer["imported"] == [], f"{name}: imported {answer['imported']} before answering"
    assert all(width(text) <= 200 for text in answer["stderr"].splitlines())
