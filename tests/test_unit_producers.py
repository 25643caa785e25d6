"""Fast tier: which checkpoint ``dsfix convert`` reads where the Hugging Face Trainer and accelerate write them
(a run folder's checkpoint-N, the checkpoint's own config.json), what it calls the run's precision, who wrote
it, and the staging folder's mode; which folders already are a Hugging Face model (save_pretrained, save_model(),
save_only_model) and where a ``.bin`` folder (DeepSpeed-Chat's, save_16bit_model's) is written. Folders of empty
files shaped as transformers 4.57, accelerate 1.16 and DeepSpeed 0.19.8 write them (the real runs:
tests/test_hf_runs.py and tests/test_peft_runs.py, extended tier)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from patcher.checkpoint.convert import command
from patcher.checkpoint.readers import find
from patcher.checkpoint.readers.engine import precision_of, step_files
from patcher.checkpoint.write.files import make_staging
from patcher.errors import DsfixError


def _checkpoint(folder: Path, step: int, config=True, trainer=True, prefix="bf16_") -> Path:
    """A Trainer checkpoint-N's names: latest, global_stepN/ (ZeRO-2 files), config.json, trainer_state.json."""
    (folder / f"global_step{step}").mkdir(parents=True)
    (folder / "latest").write_text(f"global_step{step}")
    (folder / f"global_step{step}" / "mp_rank_00_model_states.pt").touch()
    for r in (0, 1):
        (folder / f"global_step{step}" / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
    if config:
        (folder / "config.json").write_text("{}")
    if trainer:
        (folder / "trainer_state.json").write_text("{}")
    return folder


def _run(root: Path, steps=(2, 10, 9), **kw) -> Path:
    for n in steps:
        _checkpoint(root / f"checkpoint-{n}", n, **kw)
    return root


CHOICES = [  # (make the folder, --tag, the checkpoint chosen relative to root / the error's words / None)
    (lambda r: _checkpoint(r, 4), None, "."),  # a checkpoint folder itself
    (lambda r: _checkpoint(r, 4), "global_step4", "."),  # --tag then names its step folder, as before
    (lambda r: _run(r), None, "checkpoint-10"),  # the largest N, not the last name in text order
    (lambda r: (_run(r), (r / "checkpoint-11").write_text("a file")), None, "checkpoint-10"),  # folders only
    (lambda r: (_run(r), (r / "checkpoint-x").mkdir(), (r / "checkpoint-12-tmp").mkdir()), None, "checkpoint-10"),
    (lambda r: _run(r), "checkpoint-2", "checkpoint-2"),
    (lambda r: _run(r, steps=(5,)), None, "checkpoint-5"),
    (lambda r: _run(r), "checkpoint-7", "--tag checkpoint-7: no such checkpoint here; the run saved checkpoint-2, "
                                        "checkpoint-9, checkpoint-10"),
    (lambda r: _run(r), "global_step2", "--tag global_step2: here --tag names a checkpoint-N"),
    (lambda r: _run(r, steps=range(1, 7)), "x", "(checkpoint-1, ..., checkpoint-6 (6 in all))"),
    (lambda r: (_run(r, steps=(2,)), (r / "checkpoint-3").mkdir(), (r / "checkpoint-3" / "model.safetensors").touch()),
     None, "checkpoint-3 holds no DeepSpeed checkpoint (no latest): found model.safetensors"),
    (lambda r: ((r / "checkpoint-3").mkdir(parents=True), (r / "checkpoint-3" / "pytorch_model.bin").touch()), None,
     "found pytorch_model.bin; a .bin folder is converted in place: dsfix convert "),
    (lambda r: (r.mkdir(), (r / "notes.txt").touch()), None, None),  # neither: the caller says what was found
    # the Trainer's save_model() at ZeRO-3 without gathering: latest in the output folder itself, its final save
    (lambda r: (_run(r), _checkpoint(r, 12, trainer=False)), None, "."),
    (lambda r: (_run(r), _checkpoint(r, 12, trainer=False)), "global_step12", "."),
    (lambda r: (_run(r), _checkpoint(r, 12, trainer=False)), "checkpoint-9", "checkpoint-9"),
]


@pytest.mark.parametrize("make,tag,expect", CHOICES)
def test_the_checkpoint_chosen_in_a_run_folder(tmp_path, make, tag, expect):
    root = tmp_path / "output"
    make(root)
    if expect is None:
        assert find.choose_checkpoint(root, tag) is None
        return
    if expect.startswith(("checkpoint-", ".")) and " " not in expect:
        chosen = find.choose_checkpoint(root, tag)
        assert chosen.path == (root / expect if expect != "." else root)
        assert chosen.tag == (tag if expect == "." else None)
        assert (chosen.note == "") == (expect == ".")
        return
    with pytest.raises(DsfixError) as info:
        find.choose_checkpoint(root, tag)
    assert expect in info.value.message and "\n" not in info.value.message


@pytest.mark.parametrize("steps", [(2, 10, 9), (1,), (100, 20, 3000)])
def test_the_last_checkpoint_is_transformers_own_choice(tmp_path, steps):
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    root = _run(tmp_path / "output", steps=steps)
    chosen = find.choose_checkpoint(root)
    assert str(chosen.path) == trainer_utils.get_last_checkpoint(str(root))
    assert chosen.note.startswith(f"checkpoint-{max(steps)} (the last of ")
    assert ("--tag checkpoint-N picks another" in chosen.note) == (len(steps) > 1)


CONFIGS = [  # (make, the path given relative to root, the folder whose config.json is used, or None)
    (lambda r: _checkpoint(r, 4), ".", "."),  # a Trainer checkpoint-N
    (lambda r: _checkpoint(r, 4), "global_step4", "."),  # its step folder given: the folder holding it and latest
    (lambda r: _checkpoint(r, 4, config=False), ".", None),  # engine.save_checkpoint: no config
    (lambda r: (_checkpoint(r, 4, config=False), (r / "global_step4" / "config.json").write_text("{}")),
     "global_step4", "global_step4"),
    (lambda r: (_checkpoint(r / "ckpt", 4, config=False), (r / "config.json").write_text("{}")), "ckpt", None),
    (lambda r: (_checkpoint(r, 4), (r / "latest").unlink()), "global_step4", None),  # no latest: not its root
]


@pytest.mark.parametrize("make,given,expect", CONFIGS)
def test_the_checkpoints_own_config(tmp_path, make, given, expect):
    root = tmp_path / "c"
    make(root)
    path = root / given if given != "." else root
    step, _, _ = find.step_folder(path)
    found = find.config_folder(path, step)
    assert found == (None if expect is None else (root / expect if expect != "." else root))


PRECISIONS = [  # (optimizer files' prefix, ds_config saved in model_states, the precision named)
    ("bf16", {"bf16": {"enabled": True}}, "bf16"),
    ("bf16", None, "bf16"),  # the prefix says it
    ("", {"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "fp32"),  # the Trainer's fp32 run
    ("", {}, "fp32"),  # engine.save_checkpoint without mixed precision
    ("", {"fp16": {"enabled": True, "loss_scale": 0}}, "fp16"),
    ("", {"bfloat16": {"enabled": True}}, "bf16"),  # DeepSpeed's other name for the section
    ("", {"fp16": {"enabled": "auto"}}, "fp16 or fp32"),  # unresolved: the config does not say
    ("", None, "fp16 or fp32"),  # no saved config: the file names cannot tell fp16 from fp32
]


@pytest.mark.parametrize("prefix,config,expect", PRECISIONS)
def test_the_precision_named(prefix, config, expect):
    assert precision_of(prefix, config) == expect


def test_an_fp32_runs_files_are_found_without_a_prefix(tmp_path):
    root = _checkpoint(tmp_path / "c", 2, prefix="")
    _, optim_files, prefix = step_files(root / "global_step2", stage3=False)
    assert prefix == "" and [p.name for p in optim_files] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    optim_files[0].unlink()
    with pytest.raises(DsfixError, match="rank 0.s file zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"):
        step_files(root / "global_step2", stage3=False)


@pytest.mark.parametrize("files,expect", [
    (["trainer_state.json", "latest"], "trainer"),
    (["random_states_0.pkl", "random_states_1.pkl", "latest"], "accelerate"),
    (["latest", "zero_to_fp32.py"], ""),
])
def test_who_wrote_the_checkpoint(tmp_path, files, expect):
    for name in files:
        (tmp_path / name).touch()
    assert find.producer_of(tmp_path) == expect


def _files(folder: Path, *names: str) -> Path:
    """Empty files (and the folders they need) under ``folder``."""
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()
    return folder


HF = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")  # save_pretrained's
ONLY_MODEL = HF + ("trainer_state.json", "training_args.bin", "rng_state_0.pth")  # a save_only_model checkpoint-N

MODEL_FOLDERS = [  # (make the folder, --tag, the model folder chosen relative to root / the error's words / None)
    (lambda r: _files(r, *HF), None, "."),  # save_pretrained, the Trainer's save_model()
    (lambda r: _files(r, *HF), "global_step2", "."),  # a --tag changes nothing there
    (lambda r: _files(r, "config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors"), None, "."),  # sharded
    (lambda r: _files(r, "model.safetensors"), None, None),  # no config.json: not a model folder
    (lambda r: _files(r, *HF, "pytorch_model.bin"), None, None),  # a .bin folder converted in place, .bin kept
    (lambda r: _files(r, "adapter_config.json", "adapter_model.safetensors"), None, None),  # a PEFT adapter
    # the Trainer's checkpoint-N at ZeRO-3 with the 16-bit gather on: the engine's files are read
    (lambda r: (_checkpoint(r, 2), _files(r, "model.safetensors")), None, None),
    (lambda r: _run(r), None, None),  # a DeepSpeed run: its checkpoints are converted
    (lambda r: [_files(r / f"checkpoint-{n}", *ONLY_MODEL) for n in (2, 10)], None, "checkpoint-10"),
    (lambda r: [_files(r / f"checkpoint-{n}", *ONLY_MODEL) for n in (2, 10)], "checkpoint-2", "checkpoint-2"),
    (lambda r: [_files(r / f"checkpoint-{n}", *ONLY_MODEL) for n in (2, 10)], "checkpoint-7",
     "--tag checkpoint-7: no such checkpoint here; the run saved checkpoint-2, checkpoint-10"),
    (lambda r: (_files(r / "checkpoint-2", *ONLY_MODEL), _checkpoint(r / "checkpoint-4", 4)), None, None),
    (lambda r: (_run(r), _files(r / "checkpoint-12", *ONLY_MODEL)), "checkpoint-2", None),  # --tag: an engine one
    # the Trainer's save_model() into its output folder after DeepSpeed checkpoints: that final save itself,
    # unless --tag names a checkpoint
    (lambda r: (_run(r), _files(r, *HF)), None, "."),
    (lambda r: (_run(r), _files(r, *HF)), "checkpoint-9", None),
    (lambda r: (_files(r, "pytorch_model.bin", "config.json"), _files(r / "checkpoint-3", *ONLY_MODEL)), None, None),
]


@pytest.mark.parametrize("make,tag,expect", MODEL_FOLDERS)
def test_a_folder_that_already_is_a_model(tmp_path, make, tag, expect):
    root = tmp_path / "output"
    root.mkdir()
    make(root)
    if expect is not None and " " in expect:
        with pytest.raises(DsfixError) as info:
            find.choose_model_folder(root, tag)
        assert expect in info.value.message and "\n" not in info.value.message
        return
    chosen = find.choose_model_folder(root, tag)
    if expect is None:
        assert chosen is None and command.model_folder(root, tag) is None
        return
    assert chosen.path == (root if expect == "." else root / expect) and find.is_model_folder(chosen.path)
    assert (chosen.note == "") == (expect == ".")
    answer = command.model_folder(root, tag)
    assert (answer.folder, answer.chosen, answer.next_step) == (str(chosen.path), chosen.note,
                                                                f"dsfix verify {chosen.path}")
    assert answer.exit_code == 0 and answer.message.startswith(f"nothing to convert in {chosen.path}: ")


CURE = "no config.json beside {}, as save_16bit_model writes it: add --config MODEL_DIR --output OUT"
BIN_TARGETS = [  # (files, --config given, --output given, --remove-bin, True: into --output / False: in place /
    # the error's words)
    (("pytorch_model.bin",), False, False, False, CURE.format("pytorch_model.bin")),  # save_16bit_model's
    (("pytorch_model.bin",), False, True, False, CURE.format("pytorch_model.bin")),
    (("pytorch_model.bin",), True, False, False, CURE.format("pytorch_model.bin")),
    (("pytorch_model.bin",), True, True, False, True),
    (("pytorch_model.bin",), True, True, True, "--remove-bin is for a .bin folder converted in place"),
    (("pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin"), False, True, False,
     CURE.format("pytorch_model.bin.index.json")),  # zero_to_fp32's shards
    (("pytorch_model.bin", "config.json"), False, False, False, False),  # DeepSpeed-Chat's: in place
    (("pytorch_model.bin", "config.json"), False, True, False, True),
    (("pytorch_model.bin", "config.json"), True, True, False, True),  # --config wins, as for a checkpoint
    (("pytorch_model.bin", "config.json"), True, False, False, "--config goes with --output OUT"),
    (("pytorch_model.bin", "config.json"), False, False, True, False),  # --remove-bin in place
    (("actor/pytorch_model.bin", "actor/config.json", "critic/pytorch_model.bin"), False, True, False, False),
]


@pytest.mark.parametrize("files,config,output,remove_bin,expect", BIN_TARGETS)
def test_where_a_bin_folder_is_written(tmp_path, files, config, output, remove_bin, expect):
    folder = _files(tmp_path / "bins", *files)
    if files[0].endswith(".index.json"):
        (folder / files[0]).write_text('{"weight_map": {"a": "%s"}}' % files[1])
    args = (folder, tmp_path if config else None, tmp_path / "out" if output else None, remove_bin)
    if isinstance(expect, str):
        with pytest.raises(DsfixError) as info:
            command.into_output(*args)
        assert expect in info.value.message and info.value.path == str(folder)
        return
    assert command.into_output(*args) is expect


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_the_staging_folder_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        folder = make_staging(tmp_path, ".dsfix-convert-")
    finally:
        os.umask(old)
    assert folder.parent == tmp_path and folder.name.startswith(".dsfix-convert-")
    assert folder.stat().st_mode & 0o777 == mode


def test_verify_against_takes_a_bin_reference_loaded_weights_only(tmp_path):
    """What a zero_to_fp32 user holds as a reference: a pytorch_model.bin (a state dict of tensors), compared
    with a safetensors folder; a .bin whose pickle needs code to load is refused in one line, nothing run."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from patcher.checkpoint.check.compare import compare_folders, is_bin_reference

    weights = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.bias": torch.ones(5)}
    (tmp_path / "out").mkdir()
    save_file(weights, str(tmp_path / "out" / "model.safetensors"))
    (tmp_path / "ref").mkdir()
    torch.save(weights, str(tmp_path / "ref" / "pytorch_model.bin"))
    assert is_bin_reference(tmp_path / "ref") and not is_bin_reference(tmp_path / "out")
    report = compare_folders(tmp_path / "out", tmp_path / "ref")
    assert report.ok and report.summary == f"matches {tmp_path / 'ref'}: 2 tensors compared, 2 bit-equal"

    torch.save({**weights, "b.bias": torch.ones(5) * 2}, str(tmp_path / "ref" / "pytorch_model.bin"))
    report = compare_folders(tmp_path / "out", tmp_path / "ref")
    assert not report.ok and report.first.startswith("values: b.bias: max |diff| 1")

    marker = tmp_path / "ran"
    torch.save({"a.weight": _RunsCode(str(marker))}, str(tmp_path / "ref" / "pytorch_model.bin"))
    with pytest.raises(DsfixError) as info:
        compare_folders(tmp_path / "out", tmp_path / "ref")
    assert "refused: this pickle needs code to load" in info.value.message and not marker.exists()


class _RunsCode:
    """A pickle that would create a file when loaded with weights_only=False."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
