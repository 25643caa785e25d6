"""dsfix verify DIR --against REF_DIR (patcher/checkpoint/check/compare.py): two model folders, tensor by tensor.

Fast tier: small safetensors folders written here (one file or shards with an index), without config.json
(no ties to build). Slow tier: the narrow tied Qwen3's config, for the ties.
"""
from __future__ import annotations

import json

import pytest

from patcher.checkpoint.check import compare, values
from patcher.checkpoint.verify import compare_path
from patcher.errors import DsfixError

torch = pytest.importorskip("torch")


def _folder(path, tensors, shards=1, config=None):
    """``tensors`` saved as model.safetensors, or as ``shards`` shards with an index; config.json if given."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def _base():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(6, 5).to(torch.bfloat16), "b.bias": torch.randn(7), "c.count": torch.arange(4),
            "d.flag": torch.tensor([True, False])}


def _with(**changes):
    tensors = _base()
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value(tensors.get(name))
    return tensors


def _ulp(t):  # the next bf16 value up, everywhere
    return (t.view(torch.int16) + 1).view(torch.bfloat16)


CASES = [  # (the folder's tensors, atol, rtol, which check fails or None, words of its detail)
    (_base(), 0.0, 0.0, None, "all 4 bit-equal"),
    (_with(a__weight=_ulp), 0.0, 0.0, "values", "a.weight: max |diff|"),
    (_with(a__weight=_ulp), 0.05, 0.0, None, "3 of 4 bit-equal, the rest within atol 0.05"),
    (_with(a__weight=_ulp), 0.0, 0.01, None, "within atol 0 / rtol 0.01"),
    (_with(b__bias=lambda t: t + 1.0), 0.5, 0.0, "values", "b.bias: max |diff| 1 > atol 0.5"),
    (_with(a__weight=lambda t: t.float()), 1.0, 0.0, "dtypes", "a.weight: F32 here, BF16 in the reference"),
    (_with(b__bias=lambda t: t[:6]), 0.0, 0.0, "shapes", "b.bias: [6] here, [7] in the reference"),
    (_with(c__count=lambda t: t.flip(0)), 2.0, 0.0, "values", "c.count: max |diff| 3 > atol 2"),  # integers too
    (_with(c__count=lambda t: t.flip(0)), 3.0, 0.0, None, "within atol 3"),
    (_with(c__count=lambda t: t + 0), 0.0, 0.0, None, "all 4 bit-equal"),
    (_with(d__flag=None), 0.0, 0.0, "keys", "1 only in the reference: d.flag"),
    (_with(e__extra=lambda t: torch.zeros(2)), 0.0, 0.0, "keys", "1 not in the reference: e.extra"),
]


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("tensors,atol,rtol,failing,words", CASES)
def test_compare_table(tmp_path, tensors, atol, rtol, failing, words, shards):
    folder = _folder(tmp_path / "out", tensors, shards=shards)
    ref = _folder(tmp_path / "ref", _base(), shards=3 - shards)  # one side sharded, the other not
    report = compare.compare_folders(folder, ref, atol=atol, rtol=rtol)
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ([failing] if failing else []), report.checks
    assert report.ok is (failing is None)
    if failing:
        assert report.first.startswith(f"{failing}: ") and report.summary == f"differs from {ref}: {report.first}"
    if words:
        detail = (failed[0] if failing else report.check("values")).detail
        assert words in detail, detail
    data = report.to_dict()
    assert data["against"] == str(ref) and len(data["compared"]) == len(report.rows)


def test_nan_compares_by_bits_and_never_within_a_tolerance(tmp_path):
    nan = torch.tensor([float("nan"), 1.0, 2.0])
    ref = _folder(tmp_path / "ref", {"x": nan})
    assert compare.compare_folders(_folder(tmp_path / "same", {"x": nan.clone()}), ref).ok
    other = _folder(tmp_path / "other", {"x": torch.tensor([0.0, 1.0, 2.0])})
    report = compare.compare_folders(other, ref, atol=1e9)
    assert not report.ok and "max |diff| inf" in report.check("values").detail


def test_large_tensors_are_read_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    big = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    changed = big.clone()
    changed[63, 31] += 0.5  # in the last block only
    ref = _folder(tmp_path / "ref", {"w": big})
    reads = []
    original = values.difference
    monkeypatch.setattr(values, "BLOCK_BYTES", 8 * 32 * 8)  # 8 rows of float64 a block
    monkeypatch.setattr(values, "difference",
                        lambda a, b, atol, rtol: reads.append(a.shape[0]) or original(a, b, atol, rtol))
    report = compare.compare_folders(_folder(tmp_path / "out", {"w": changed}), ref)
    assert not report.ok and reads == [8] * 8
    assert report.rows[0].max_diff == 0.5


def test_the_reading_shows_its_progress_and_counts_every_byte_it_compares(tmp_path, monkeypatch):
    """verify --against's progress: a line off a terminal, and the bytes handed to it (both sides, a block pair at a
    time) add up to its total; a pair of two shapes is not read, and not counted."""
    import io

    from rich.console import Console

    from patcher.checkpoint import progress

    ref = _folder(tmp_path / "ref", _base())
    folder = _folder(tmp_path / "out", _with(b__bias=lambda t: torch.randn(8)))  # b.bias: a shape of its own
    monkeypatch.setattr(values, "BLOCK_BYTES", 16)
    monkeypatch.setattr(compare, "MIN_BYTES", 0)
    seen: dict = {}
    real = progress.Progress

    class Counted(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.update(total=self.total, done=0)

        def advance(self, n):
            seen["done"] += n
            super().advance(n)

    monkeypatch.setattr(compare, "Progress", Counted)
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    report = compare.compare_folders(folder, ref, console=console)
    assert not report.ok and report.check("shapes").detail.startswith("b.bias")
    # a.weight (bf16, 6 x 5), c.count (int64, 4), d.flag (bool, 2), each on both sides
    assert seen == {"total": 2 * (60 + 32 + 2), "done": 2 * (60 + 32 + 2)}
    assert console.file.getvalue().startswith("dsfix verify: comparing every tensor with the reference: 0 MB of ")


@pytest.mark.parametrize("make,words", [
    (lambda tmp: (tmp / "missing", _folder(tmp / "ref", _base())), "the folder: no such folder"),
    (lambda tmp: (_folder(tmp / "out", _base()), tmp / "nothing"), "--against: no such folder"),
    (lambda tmp: (_folder(tmp / "out", _base()), _folder(tmp / "ref", _base()) / "model.safetensors"),
     "is a file, not a folder; pass the folder that holds it"),
    (lambda tmp: (_folder(tmp / "out", _base()), (tmp / "empty").mkdir() or tmp / "empty"), "no model weights"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, make, words):
    folder, ref = make(tmp_path)
    with pytest.raises(DsfixError) as info:
        compare.compare_folders(folder, ref)
    assert info.value.code == 2 and words in str(info.value) and "\n" not in str(info.value)


def test_step3_folders_pair_by_name_and_expect_is_refused(tmp_path):
    for side in ("out", "ref"):
        for name in ("actor", "critic"):
            _folder(tmp_path / side / name, _base())
    result = compare_path(tmp_path / "out", tmp_path / "ref")
    assert result.exit_code == 0
    assert [r.path for r in result.reports] == [str(tmp_path / "out" / n) for n in ("actor", "critic")]
    (tmp_path / "ref" / "critic").rename(tmp_path / "ref" / "actor_ema")
    with pytest.raises(DsfixError, match="holds actor, critic but --against holds actor, actor_ema"):
        compare_path(tmp_path / "out", tmp_path / "ref")
    with pytest.raises(DsfixError, match="--expect checks a folder against its config"):
        compare_path(tmp_path / "out", tmp_path / "ref", expect=311)


@pytest.mark.slow
def test_tied_alias_on_one_side_is_compared_through_its_partner(tmp_path, tiny_qwen3_helper):
    """With config.json's ties (the narrow Qwen3): lm_head.weight stored on one side only (clone against dedupe)
    is compared through model.embed_tokens.weight; stored but different from its partner, it fails."""
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    clone = _folder(tmp_path / "clone", state, config=config)
    dedupe = _folder(tmp_path / "dedupe", {k: v for k, v in state.items() if k != "lm_head.weight"}, config=config)
    report = compare.compare_folders(clone, dedupe)
    assert report.ok, report.checks
    # each side's own count: the clone holds 311, the dedupe 310; the alias is compared through its partner
    assert report.check("keys").detail == ("311 tensors here, 310 in the reference; 311 compared, lm_head.weight "
                                           "through its tied partner")
    assert report.check("tied").detail == "lm_head.weight ~ model.embed_tokens.weight (folder) bit-equal"
    assert [(r.name, r.ref) for r in report.rows if r.name != r.ref] == [("lm_head.weight",
                                                                          "model.embed_tokens.weight")]
    back = compare.compare_folders(dedupe, clone)  # the other way: the reference's alias is checked as a tie
    assert back.ok and len(back.rows) == 310, back.checks
    assert back.check("keys").detail == ("310 tensors here, 311 in the reference; 310 compared; the reference's "
                                         "lm_head.weight checked as a tie")
    assert back.check("tied").detail == "lm_head.weight ~ model.embed_tokens.weight (reference) bit-equal"
    same = compare.compare_folders(clone, clone)
    assert same.check("keys").detail == "311 tensors on both sides"
    untied = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    report = compare.compare_folders(_folder(tmp_path / "untied", untied, config=config), dedupe, atol=10.0)
    assert not report.ok and [c.name for c in report.checks if not c.ok] == ["tied"]
    assert "tied aliases differ from their partner: lm_head.weight ~ model.embed_tokens.weight (folder)" in report.first
