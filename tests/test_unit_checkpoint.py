"""Fast tests of the torch side's pure parts: the checks verify and convert share (on headers written out by
hand), the folder rules, the refusals that come before any model is built, the worker's extraction of
dsfix's code, the rank environment, progress off a terminal, and the demo's own files. Nothing here imports
torch but the critic test, which needs it for the module and nothing more."""

from __future__ import annotations

import io
import json
import shutil
import sys
import types

import pytest
from rich.console import Console

from patcher.checkpoint import names
from patcher.checkpoint.check import headers as checks
from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.readers import safetensors as st
from patcher.checkpoint.readers.safetensors import Header
from patcher.errors import DsfixError

EXPECTED = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,), "lm_head.weight": (8, 4)}
TIED = [["model.embed_tokens.weight", "lm_head.weight"]]


def head(*entries) -> Header:
    """A Header of (key, shape, dtype code) rows, all in model.safetensors."""
    return Header({k: (tuple(shape), code, "model.safetensors") for k, shape, code in entries}, ["model.safetensors"])


FULL = [("model.embed_tokens.weight", (8, 4), "BF16"), ("model.norm.weight", (4,), "BF16"),
        ("lm_head.weight", (8, 4), "BF16")]

KEYS = [
    # (name, header rows, the keys check)
    ("all there", FULL, Check("keys", True, "3 of 3 keys")),
    ("the tied alias left out, as save_pretrained does", FULL[:2],
     Check("keys", True, "2 of 3 keys; omitted tied alias lm_head.weight (tied to model.embed_tokens.weight)")),
    ("a key missing that is no alias", FULL[::2], Check("keys", False, "1 missing: model.norm.weight")),
    ("both of a tied pair missing", FULL[1:2],
     Check("keys", False, "2 missing: model.embed_tokens.weight, lm_head.weight")),
    ("an unexpected key", FULL + [("v_head.weight", (1, 4), "BF16")],
     Check("keys", False, "1 unexpected: v_head.weight")),
    ("missing and unexpected",
     FULL[:1] + [("a", (1,), "F32"), ("b", (1,), "F32"), ("c", (1,), "F32"), ("d", (1,), "F32")],
     Check("keys", False, "1 missing: model.norm.weight; 4 unexpected: a, b, c (+1 more)")),
]


@pytest.mark.parametrize("rows, expected", [k[1:] for k in KEYS], ids=[k[0] for k in KEYS])
def test_keys_check(rows, expected):
    assert checks.keys_check(head(*rows), EXPECTED, TIED) == expected


SHAPES = [
    ("all match", FULL, Check("shapes", True, "all match the config's model")),
    ("one wrong", [("model.norm.weight", (5,), "BF16")] + FULL[::2],
     Check("shapes", False, "1 wrong: model.norm.weight [5] != [4]")),
    ("ZeRO-3 placeholders count as empty, not wrong", [(k, (0,), c) for k, _, c in FULL],
     Check("shapes", False, "3 empty (see non-empty)")),
    ("a key the model lacks is the keys check's business", FULL + [("x", (9,), "BF16")],
     Check("shapes", True, "all match the config's model")),
]


@pytest.mark.parametrize("rows, expected", [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_shapes_check(rows, expected):
    assert checks.shapes_check(head(*rows), EXPECTED) == expected


NONEMPTY = [
    ("none empty", FULL, Check("non-empty", True, "3 tensors, none empty")),
    ("ZeRO-3 placeholders", [(k, (0,), c) for k, _, c in FULL],
     Check("non-empty", False, "3 of 3 tensors are empty: model.embed_tokens.weight [0], model.norm.weight [0], "
                               "lm_head.weight [0] — shape [0] is a ZeRO-3 partitioned placeholder: gather the "
                               "parameters before saving")),
    ("an empty matrix", FULL[:2] + [("lm_head.weight", (0, 4), "BF16")],
     Check("non-empty", False, "1 of 3 tensors are empty: lm_head.weight [0, 4]")),
]


@pytest.mark.parametrize("rows, expected", [n[1:] for n in NONEMPTY], ids=[n[0] for n in NONEMPTY])
def test_nonempty_check(rows, expected):
    assert checks.nonempty_check(head(*rows)) == expected


DTYPES = [
    # (name, header rows, config.json's dtype, the check, the one floating dtype)
    ("all bf16", FULL, "bfloat16", Check("dtype", True, "all floating tensors bfloat16"), "bfloat16"),
    ("the config says another", FULL, "float32",
     Check("dtype", True, "all floating tensors bfloat16 (config.json says float32; from_pretrained(dtype='auto') "
                          "would cast)"), "bfloat16"),
    ("torch. prefix in the config", FULL, "torch.bfloat16", Check("dtype", True, "all floating tensors bfloat16"),
     "bfloat16"),
    ("integers are not floating", FULL + [("ids", (3,), "I64"), ("mask", (3,), "BOOL")], None,
     Check("dtype", True, "all floating tensors bfloat16"), "bfloat16"),
    ("fp8 counts as floating", [("w", (2,), "F8_E4M3")], None,
     Check("dtype", True, "all floating tensors float8_e4m3fn"),
     "float8_e4m3fn"),
    ("no floating tensor", [("ids", (3,), "I64")], None, Check("dtype", True, "no floating tensors"), None),
    ("mixed", FULL + [("model.norm.weight", (4,), "F32")], None,
     Check("dtype", False, "floating tensors mix dtypes: 2 bfloat16 (e.g. model.embed_tokens.weight); "
                           "1 float32 (e.g. model.norm.weight)"), None),
]


@pytest.mark.parametrize("rows, cfg, expected, name", [d[1:] for d in DTYPES], ids=[d[0] for d in DTYPES])
def test_dtype_check(rows, cfg, expected, name):
    assert checks.dtype_check(head(*rows), cfg) == (expected, name)


def test_one_dtype_table_the_templates():
    codes = st.dtype_codes()
    assert codes["bfloat16"] == "BF16" and codes["float8_e5m2"] == "F8_E5M2" and codes["bool"] == "BOOL"
    assert {st.dtype_name(c) for c in codes.values()} == set(codes)
    assert [st.dtype_code(n) for n in ("torch.float16", "int8", "complex64")] == ["F16", "I8", "COMPLEX64"]


def test_examples_names_three_and_counts_the_rest():
    assert names.examples(["a", "b"]) == "a, b"
    assert names.examples(range(5)) == "0, 1, 2 (+2 more)"


WEIGHT_FILES = [
    # (name, files in the folder, (files to read, problems)) or the error's message
    ("one file", {"model.safetensors": ""}, (["model.safetensors"], [])),
    ("an index and its shards",
     {"model.safetensors.index.json": {"weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors"}},
      "s-1.safetensors": "", "s-2.safetensors": ""}, (["s-1.safetensors", "s-2.safetensors"], [])),
    ("an index naming a missing shard",
     {"model.safetensors.index.json": {"weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors"}},
      "s-1.safetensors": ""},
     (["s-1.safetensors"], ["model.safetensors.index.json names shards that are missing: s-2.safetensors"])),
    ("an unreadable index", {"model.safetensors.index.json": "{", "model.safetensors": ""},
     ([], ["model.safetensors.index.json is unreadable: Expecting property name enclosed in double quotes: "
           "line 1 column 2 (char 1)"])),
    ("safetensors under another name", {"weights.safetensors": ""},
     (["weights.safetensors"], ["no model.safetensors or model.safetensors.index.json; found weights.safetensors, "
                                "which from_pretrained ignores"])),
    ("only a pickle", {"pytorch_model.bin": ""},
     "no safetensors weights, only pytorch_model.bin (a pickle save); nothing to verify (`dsfix convert` turns it "
     "into safetensors)"),
    ("nothing", {"config.json": "{}"},
     "no model weights (model.safetensors or model.safetensors.index.json) in this folder"),
]


def write(folder, files: dict):
    for name, content in files.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


@pytest.mark.parametrize("files, expected", [w[1:] for w in WEIGHT_FILES], ids=[w[0] for w in WEIGHT_FILES])
def test_weight_files(tmp_path, files, expected):
    write(tmp_path, files)
    if isinstance(expected, str):
        with pytest.raises(DsfixError) as e:
            st.weight_files(tmp_path)
        assert (e.value.message, e.value.path) == (expected, str(tmp_path))
    else:
        found, _, problems = st.weight_files(tmp_path)
        assert (found, problems) == expected


# ----------------------------------------------------------------------------- verify and convert, before a model


def test_folder_kind_and_model_folders(tmp_path):
    from patcher.checkpoint.check.model import CAUSAL_LM, CRITIC, folder_kind
    from patcher.checkpoint.readers.find import model_folders

    assert folder_kind(["model.norm.weight", "lm_head.weight"]) == CAUSAL_LM
    assert folder_kind(["rwtransformer.norm.weight", "v_head.weight"]) == CRITIC
    step3 = tmp_path / "step3"
    for sub in ("actor", "critic", "other"):
        (step3 / sub).mkdir(parents=True)
    (step3 / "training_args.bin").write_text("")  # not model weights
    assert model_folders(step3) == [step3 / "actor", step3 / "critic"]
    (step3 / "pytorch_model.bin").write_text("")
    assert model_folders(step3) == [step3]
    assert model_folders(tmp_path / "nope") == [tmp_path / "nope"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "nope", "no such folder"),
    (lambda p: write(p, {"f": ""}) / "f", "is a file, not a folder; pass the folder that holds it"),
    (lambda p: write(p, {"pytorch_model.bin": ""}), "no safetensors weights, only pytorch_model.bin"),
    (lambda p: p, "no model weights (model.safetensors or model.safetensors.index.json) in this folder"),
])
@pytest.mark.parametrize("entry", ["verify_folder", "verify_path"])
def test_verify_refuses_before_reading(tmp_path, make, message, entry):
    from patcher.checkpoint import verify
    from patcher.checkpoint.check import verify as check

    with pytest.raises(DsfixError) as e:
        {"verify_folder": check.verify_folder, "verify_path": verify.verify_path}[entry](make(tmp_path))
    assert e.value.message.startswith(message) and e.value.code == 2


@pytest.mark.parametrize("make, kwargs, message", [  # all before torch (tests/test_cli_errors.py: in a process)
    (lambda p: p, {"strategy": "fast"}, "--strategy must be clone or dedupe, not fast"),
    (lambda p: p / "nope", {}, "no such folder"),
    (lambda p: write(p, {"f": ""}) / "f", {}, "is a file, not a folder; pass the folder that holds it"),
    (lambda p: write(p, {"notes.txt": ""}), {},
     "no pytorch_model.bin (also not in actor/, critic/, actor_ema/), no latest, no checkpoint-N/; found "
     "notes.txt"),
    (lambda p: write(p, {"pytorch_model.bin": ""}), {},
     "no config.json beside pytorch_model.bin, as save_16bit_model writes it: add --config MODEL_DIR --output OUT"),
    (lambda p: write((p / "actor").mkdir() or p / "actor", {"pytorch_model.bin": ""}).parent, {},  # step 3's
     "no config.json: convert needs the model's config to check the weights"),
    (lambda p: write(p, {"pytorch_model.bin.index.json": {"weight_map": {"a": "../x.bin"}}}), {},
     "pytorch_model.bin.index.json names shards outside the folder: ../x.bin"),
])
def test_convert_refuses_before_loading(tmp_path, make, kwargs, message):
    from patcher.checkpoint.convert import convert

    with pytest.raises(DsfixError) as e:
        convert(make(tmp_path), **kwargs)
    assert e.value.message == message and e.value.code == 2


@pytest.mark.parametrize("kwargs", [{}, {"output": "out"}, {"output": "out", "config": "cfg", "dtype": "bf16"}])
def test_convert_leaves_a_model_folder_alone_and_names_verify(tmp_path, kwargs):
    from patcher.checkpoint.convert import convert

    write(tmp_path, {"model.safetensors": "", "config.json": "{}"})
    report = convert(tmp_path, **{k: (tmp_path / v if k in ("output", "config") else v) for k, v in kwargs.items()})
    assert (report.ok, report.status, report.exit_code) == (True, "nothing to convert", 0)
    assert report.message == (f"nothing to convert in {tmp_path}: a Hugging Face model folder already "
                              "(model.safetensors, config.json)")
    data = report.to_dict()
    assert (data["kind"], data["folder"], data["next"]) == ("hugging-face-model-folder", str(tmp_path),
                                                          f"dsfix verify {tmp_path}")
    assert not (tmp_path / "out").exists()


def test_convert_leaves_safetensors_without_config_alone(tmp_path):
    from patcher.checkpoint.convert import convert

    write(tmp_path, {"model.safetensors": ""})
    report = convert(tmp_path)
    assert (report.ok, report.status, report.exit_code) == (True, "nothing to convert", 0)
    assert report.message == f"nothing to convert in {tmp_path}: it is already safetensors (model.safetensors)"


def test_an_in_place_report_says_each_folder_in_short_lines(capsys):
    """A step-3 folder of sharded .bin folders converted in place: one summary line a folder, then its files, then
    its kind; the report's message names each folder's status; no line over 200 characters with a long path."""
    from patcher.checkpoint.convert import ConvertReport, ConvertStatus, FolderResult

    root = "/tmp/pytest-of-someone/pytest-123/test_an_in_place_report_says_e0/step3"
    shards = tuple(f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3))
    written = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json")
    folders = tuple(FolderResult(
        f"{root}/{name}", ConvertStatus.CONVERTED, True, kind="causal-lm", source=shards, tensors=311, written=written,
        restored=("lm_head.weight <- model.embed_tokens.weight",), removed=shards + ("pytorch_model.bin.index.json",))
        for name in ("actor", "critic", "actor_ema"))
    report = ConvertReport(root, "clone", folders)
    assert folders[0].summary() == f"converted {root}/actor: 311 tensors (clone; restored lm_head.weight <- " \
                                   "model.embed_tokens.weight)"
    assert folders[0].files() == ("pytorch_model-00001-of-00003.bin (+2 more) -> model-00001-of-00002.safetensors "
                                  "(+2 more); removed pytorch_model-00001-of-00003.bin (+3 more)")
    assert report.message == f"{root}: actor converted, critic converted, actor_ema converted"
    from patcher.console import Stderr

    report.render(Stderr(), {})  # plain lines on stderr (no checks here, so no table)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == [f"{root}: DeepSpeed-Chat .bin output (converted in place)", folders[0].summary(),
                         folders[0].files(), "actor: causal LM (a Trainer's or accelerate's model, DeepSpeed-Chat's "
                         "step-1 model or step-3 actor/EMA)"]
    assert max(len(line) for line in lines + [report.message]) <= 200


# ----------------------------------------------------------------------------- smoke, its worker, the ranks


def test_smoke_refuses_before_building_a_model(tmp_path):
    from patcher.checkpoint.smoke import run_smoke
    from patcher.demo import demo_checkout_source

    co = shutil.copytree(demo_checkout_source(), tmp_path / "co")
    quiet = Console(file=io.StringIO())
    with pytest.raises(DsfixError) as e:
        run_smoke(co, console=quiet)
    assert "defines no save_hf_format_safetensors: this checkout was never patched" in e.value.message
    for kwargs, message in [({"dtype": "int4"}, "--dtype must be one of bf16, fp16, fp32, not 'int4'"),
                            ({"zero_stage": 4}, "--zero-stage must be 0, 1, 2 or 3, not 4"),
                            ({"nproc": 0}, "--nproc must be at least 1, not 0"),
                            ({"model_dir": tmp_path, "config_path": tmp_path}, "give --model or --config, not both"),
                            ({"model_dir": tmp_path}, "not a model folder (no config.json)")]:
        with pytest.raises(DsfixError) as e:
            run_smoke(co, console=quiet, **kwargs)
        assert e.value.message == message


def test_worker_extracts_only_imports_and_dsfix_definitions(tmp_path):
    from patcher.checkpoint.smoke.functions import extract_definitions

    utils = tmp_path / "utils.py"
    utils.write_text("import os\nimport not_installed_anywhere\nfrom . import sibling\nSIDE = print('ran')\n\n\n"
                     "def save_hf_format(model):\n    pass\n\n\n_DSFIX_STRATEGY = 'clone'\n\n\n"
                     "def save_hf_format_safetensors(model):\n    return os.sep\n\n\n"
                     "def _dsfix_helper():\n    return 1\n")
    ns, skipped = extract_definitions(utils)
    assert {k for k in ns if not k.startswith("__")} == {"os", "_DSFIX_STRATEGY", "save_hf_format_safetensors",
                                                         "_dsfix_helper"}
    assert ns["save_hf_format_safetensors"](None) == "/" or sys.platform == "win32"
    assert [s.split(":")[0] for s in skipped] == ["line 2", "line 3"]


SAVE_MODULE = """\
def save_hf_format(model, tokenizer, output_dir, *, global_rank=None, strategy="clone", **options):
    return ("saved", output_dir, strategy)
"""
WRAPPER = """\


def save_hf_format_safetensors(model, tokenizer, args, sub_folder=""):
    return {name}.save_hf_format(model, tokenizer, args.output_dir, strategy="dedupe")
"""
INLINE = ("\n\n_DSFIX_STRATEGY = 'clone'\n\n\n"
          "def save_hf_format_safetensors(model, tokenizer, args):\n    return _DSFIX_STRATEGY\n")


@pytest.mark.parametrize("imports, name, module_file, expect", [
    # (how utils.py imports the save module, the name it binds, a dsfix_safetensors.py beside it?, the call's result)
    ("from . import dsfix_safetensors", "dsfix_safetensors", True, ("saved", "OUT", "dedupe")),
    ("import dsfix_safetensors", "dsfix_safetensors", True, ("saved", "OUT", "dedupe")),
    ("try:\n    from . import dsfix_safetensors\nexcept ImportError:\n    import dsfix_safetensors",
     "dsfix_safetensors", True, ("saved", "OUT", "dedupe")),
    ("from . import dsfix_safetensors as _dsfix_io", "_dsfix_io", True, ("saved", "OUT", "dedupe")),
    ("", None, False, "clone"),  # the v3 block inline: no module to load
    ("from . import dsfix_safetensors", "dsfix_safetensors", False, "no dsfix_safetensors.py beside it"),
])
def test_worker_finds_the_save_module_beside_utils(tmp_path, imports, name, module_file, expect):
    """smoke's ast path (utils.py does not import here: no DeepSpeed, a relative import) still reaches dsfix's save
    module: loaded from its file beside utils.py and bound to the name utils.py imports it as."""
    from patcher.checkpoint.smoke.functions import extract_definitions

    utils = tmp_path / "utils.py"
    body = WRAPPER.format(name=name) if name else INLINE
    utils.write_text(f"import os\nimport deepspeed_is_not_here\n{imports}\n{body}")
    if module_file:
        (tmp_path / "dsfix_safetensors.py").write_text(SAVE_MODULE)
    if isinstance(expect, str) and not module_file and name:
        with pytest.raises(ImportError, match=expect):
            extract_definitions(utils)
        return
    ns, skipped = extract_definitions(utils)
    assert ns["save_hf_format_safetensors"](None, None, types.SimpleNamespace(output_dir="OUT")) == expect
    assert [s.split(":")[0] for s in skipped] == ["line 2"], "only the missing module is reported as skipped"
    assert "dsfix_smoke_extracted_dsfix_safetensors" not in sys.modules


CUT = "utils.py read with ast: import failed (RuntimeError: "


@pytest.mark.parametrize("top, note", [
    # (utils.py's first line, the note smoke shows: None for none)
    ("import deepspeed", None),  # README's first command installs no DeepSpeed: expected, no warning
    ("from deepspeed.runtime.zero import partition_parameters", None),
    ("import dsfix_test_missing_module", "utils.py read with ast: import failed (ModuleNotFoundError: No module "
                                         "named 'dsfix_test_missing_module')"),
    ("raise RuntimeError('x' * 500)", CUT + "x" * (156 - len(CUT)) + "..."),  # cut to 159 characters
])
def test_worker_warns_only_when_the_user_can_act(tmp_path, monkeypatch, top, note):
    from patcher.checkpoint.smoke.functions import NOTE_LIMIT, load_save_functions

    for name in ["deepspeed", *(m for m in sys.modules if m.startswith("deepspeed."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as in an environment without DeepSpeed
    (tmp_path / "dsfix_note_utils.py").write_text(f"{top}\n\n\n"
                                                  "def save_hf_format_safetensors(m, t, a):\n    return 1\n")
    funcs, method, detail, got = load_save_functions(tmp_path / "dsfix_note_utils.py", tmp_path, "dsfix_note_utils")
    assert method == "ast" and funcs["save_hf_format_safetensors"](0, 0, 0) == 1
    assert got == note and (got is None or len(got) <= NOTE_LIMIT < 160)
    assert "import dsfix_note_utils failed" in detail, "the whole story stays in --json's load_detail"


def test_rank_env_is_cpu_gloo_on_loopback():
    from patcher.checkpoint.smoke.ranks import free_port, rank_env

    env = rank_env({"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin"})
    assert (env["DS_ACCELERATOR"], env["CUDA_VISIBLE_DEVICES"], env["PATH"]) == ("cpu", "", "/bin")
    assert rank_env({"GLOO_SOCKET_IFNAME": "eth9"}).get("GLOO_SOCKET_IFNAME") == "eth9"
    assert 0 < free_port() < 65536


def test_demo_files_and_its_summary_of_the_change(tmp_path, capsys):
    from patcher.demo import DEMO_CHECKOUT, demo_checkout_source, run_demo, show_changes
    from patcher.patch import flow

    source = demo_checkout_source()
    assert source.as_posix().endswith(f"fixtures/{DEMO_CHECKOUT}") and (source / "dschat/utils/utils.py").is_file()
    co = shutil.copytree(source, tmp_path / "DeepSpeed-Chat")
    out = io.StringIO()
    show_changes(Console(file=out, width=200), co, flow.check(co))
    assert "dschat/utils/dsfix_safetensors.py: a new file of" in out.getvalue()
    diff = capsys.readouterr().out
    assert "+def save_hf_format_safetensors(" in diff and "+            save_hf_format_safetensors(model" in diff
    with pytest.raises(DsfixError) as e:  # --keep: a folder that holds a checkout already
        run_demo(Console(file=io.StringIO()), keep=tmp_path)
    assert e.value.message.endswith("already exists; pick an empty --keep folder")


VALUE_HEADS = [
    # (config attributes, the width of v_head's input)
    ({"hidden_size": 1024}, 1024),
    ({"n_embd": 768}, 768),
    ({"word_embed_proj_dim": 512, "hidden_size": 2048}, 512),  # OPT projects its output
    ({"hidden_size": None, "n_embd": 64}, 64),
]


@pytest.mark.parametrize("attrs, width", VALUE_HEADS)
def test_critic_value_head_width(attrs, width):
    pytest.importorskip("torch")
    from patcher.checkpoint.check.critic import value_head_width

    assert value_head_width(types.SimpleNamespace(**attrs)) == width


def test_critic_without_a_hidden_size_is_refused():
    pytest.importorskip("torch")
    from patcher.checkpoint.check.critic import value_head_width

    with pytest.raises(ValueError, match="names no hidden size"):
        value_head_width(types.SimpleNamespace())


# ----------------------------------------------------------------------------- progress off a terminal


PROGRESS = [
    # (id, total, events (time, "phase"/"advance"/"tick", argument), lines written (time, text))
    ("a phase starts: a line at once", None, [(0, "phase", "build")], ["build [0s]"]),
    ("phases within the interval: the latest, once it is due", None,
     [(0, "phase", "load"), (1, "phase", "build"), (3, "phase", "save"), (4.9, "tick", None), (5, "tick", None),
      (6, "tick", None)], ["load [0s]", "save [5s]"]),
    ("nothing new: a heartbeat", None, [(0, "phase", "save"), (29, "tick", None), (30, "tick", None),
                                        (31, "tick", None), (60, "tick", None)],
     ["save [0s]", "save [30s]", "save [1m00s]"]),
    ("bytes: a line every interval while they move", 4 * 10**9,
     [(0, "phase", "converting"), (1, "advance", 10**9), (6, "advance", 10**9), (7, "advance", 10**9),
      (11, "tick", None)],
     ["converting: 0 MB of 4.0 GB, 0% [0s]", "converting: 2.0 GB of 4.0 GB, 50% [6s]",
      "converting: 3.0 GB of 4.0 GB, 75% [11s, ~5s left at this rate]"]),
    ("time left: at the last 10 s's rate, not the page cache's fast start", 10**10,
     [(0, "phase", "converting"), (1, "advance", 10**9), (6, "advance", 3 * 10**9), (16, "advance", 10**9),
      (26, "advance", 10**9)],
     ["converting: 0 MB of 10.0 GB, 0% [0s]", "converting: 4.0 GB of 10.0 GB, 40% [6s]",
      "converting: 5.0 GB of 10.0 GB, 50% [16s, ~50s left at this rate]",
      "converting: 6.0 GB of 10.0 GB, 60% [26s, ~40s left at this rate]"]),
    ("time left: none before the bytes have moved for 10 s (the time before them is not theirs)", 10**10,
     [(0, "phase", "converting"), (60, "advance", 10**9), (66, "advance", 10**9)],
     ["converting: 0 MB of 10.0 GB, 0% [0s]", "converting: 1.0 GB of 10.0 GB, 10% [1m00s]",
      "converting: 2.0 GB of 10.0 GB, 20% [1m06s]"]),
    ("time left: none once every byte is done", 2 * 10**9,
     [(0, "phase", "converting"), (1, "advance", 10**9), (6, "advance", 10**9), (11, "tick", None)],
     ["converting: 0 MB of 2.0 GB, 0% [0s]", "converting: 2.0 GB of 2.0 GB, 100% [6s]"]),
    ("no phase yet: nothing to say", 100, [(0, "advance", 50), (9, "tick", None)], []),
]


@pytest.mark.parametrize("total, events, lines", [p[1:] for p in PROGRESS], ids=[p[0] for p in PROGRESS])
def test_progress_lines_off_a_terminal(total, events, lines):
    from patcher.checkpoint.progress import Lines

    now = [0.0]
    out = []
    lines_ = Lines(out.append, "dsfix x", total, interval=5, heartbeat=30, clock=lambda: now[0])
    for t, what, arg in events:
        now[0] = t
        getattr(lines_, what)(*(() if arg is None else (arg,)))
    assert out == [f"dsfix x: {text}" for text in lines]


@pytest.mark.parametrize("console, total, min_total, shown", [
    (None, None, 0, False),  # a library call without a console
    ("plain", None, 0, True),  # a pipe, a log file
    ("plain", 10, 64, False),  # too little data to be worth a line
    ("terminal", None, 0, False),  # rich's live bar, not lines (transient: nothing left once done)
])
def test_progress_prints_plain_lines_only_off_a_terminal(console, total, min_total, shown):
    from patcher.checkpoint.progress import Progress

    file = io.StringIO()
    if console is not None:
        console = Console(file=file, force_terminal=console == "terminal", width=100)
    with Progress(console, "dsfix x", total=total, min_total=min_total) as p:
        p.phase("working")
    assert ("dsfix x: working [0s]" in file.getvalue()) is shown
