import ast
import importlib.util
import json
import os
import signal
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TINY_QWEN3_HELPER = os.path.join(REPO_ROOT, "fixtures", "step1_trainer", "tiny_qwen3.py")

# The interrupt tests stop real processes with real SIGINTs (patcher.errors.stop_point). A suite started
# where SIGINT is ignored (a background job of a script, nohup) would pass that on to every process it
# starts, and dsfix rightly leaves an ignored SIGINT ignored; so the suite takes Python's own handler back,
# and the processes it starts get the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _marked_slow(path) -> bool:
    """Whether a test module says ``pytestmark = pytest.mark.slow`` at its top level (read, not imported)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            values = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            return any(ast.unparse(v) == "pytest.mark.slow" for v in values)
    return False


def pytest_ignore_collect(collection_path, config):
    """A module marked slow as a whole is not even imported when ``-m`` deselects slow tests: collecting it
    would import torch, transformers or DeepSpeed, seconds of CPU that the fast tier has no use for."""
    markexpr = config.getoption("markexpr", "")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if not _marked_slow(collection_path):
        return None
    try:
        from _pytest.mark.expression import Expression

        wanted = Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == "slow")
    except Exception:  # another pytest's expression API: collect as usual, the marks still deselect
        return None
    return None if wanted else True


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="run the extended tier alone (tests marked `extended`: the full fault sweep, the real "
                          "Trainer and accelerate runs, the device check on the CPU); .ci/run runs it after the "
                          "main suite")
    parser.addoption("--both-tiers", action="store_true",
                     help="run the main suite and the extended tier together (the further environments of "
                          ".ci/envs.sh, whose test lists are short)")


def pytest_collection_modifyitems(config, items):
    """Two tiers that never overlap: the main suite (`python -m pytest -q`) leaves out the tests marked
    ``extended``, ``--extended`` runs those alone, and ``--both-tiers`` runs both."""
    extended = config.getoption("--extended")
    both = config.getoption("--both-tiers")
    keep, drop = [], []
    for item in items:
        (keep if both or (item.get_closest_marker("extended") is not None) == extended else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    items.sort(key=lambda item: _start_order(item.path.name))  # stable: each file's tests keep their order


# The files that take longest start first: with `-n 2 --dist loadfile` each file runs on one worker, and a long one
# left to the end keeps one worker busy while the other has nothing. Each launches ranks or builds a full model
# (in order of their time on a 2-core machine, CONTRIBUTING.md); every other file follows in its own order.
# pytest-xdist would otherwise send the files with the most tests first, and these have few (pytest_configure).
LONGEST_FIRST = ("test_peft_runs.py", "test_fault_sweep.py", "test_engine.py", "test_convert.py",
                 "test_save_module_ranks.py", "test_device_check.py", "test_bench_scale.py", "test_hf_runs.py",
                 "test_cli_model.py", "test_verify.py", "test_smoke.py")


def _start_order(file_name: str) -> int:
    return LONGEST_FIRST.index(file_name) if file_name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --dist loadfile: take the files in our order
        config.option.loadscopereorder = False


def _load_tiny_qwen3_helper():
    spec = importlib.util.spec_from_file_location("dsfix_fixture_tiny_qwen3", TINY_QWEN3_HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_qwen3_helper():
    """fixtures/step1_trainer/tiny_qwen3.py: tiny_qwen3_model(seed, dtype, ...), tiny_qwen3_tokenizer()."""
    return _load_tiny_qwen3_helper()


@pytest.fixture(scope="session")
def tiny_qwen3_tokenizer(tiny_qwen3_helper):
    """A small Qwen2TokenizerFast over a BPE trained on a few words."""
    return tiny_qwen3_helper.tiny_qwen3_tokenizer()


@pytest.fixture
def tiny_qwen3(tiny_qwen3_helper):
    """A fresh seeded narrow Qwen3ForCausalLM (28 layers, tied embeddings, 311 state-dict keys)."""
    return tiny_qwen3_helper.tiny_qwen3_model(seed=0)


def made_once(tmp_path_factory, name: str, make):
    """``make(folder)``'s result, made once in the whole test run. Under pytest-xdist every worker is a session of
    its own, so a session fixture used by two files that run on two workers would launch its ranks twice: here the
    first worker to ask makes it in a folder of the run's own (above each worker's), while any other waits on a
    lock, then reads the same folder and the same result (pickled). A make that raised is made again by the next
    worker to ask, so each reports its own failure. Without xdist it is one call."""
    import fcntl
    import pickle
    import shutil

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder, result = base / name, base / f"{name}.pickle"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return pickle.loads(result.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # a make that raised, in another worker
        folder.mkdir()
        made = make(folder)
        result.write_bytes(pickle.dumps(made))
        return made


@pytest.fixture(scope="session")
def zero3_patched_run(tmp_path_factory):
    """One real ZeRO-3 run on 2 CPU ranks (gloo) of the step-1-like trainer, with the utils.py of a fixture
    checkout patched by `dsfix apply`: its output (dsfix's save) in out/, the checkout's own functions'
    save (upstream's .bin, the tied lm_head.weight missing) in original/, the reference in ref/. Made once in
    the run (made_once). Returns (folder, smokekit.Launch)."""
    pytest.importorskip("deepspeed")

    def make(tmp_path):
        import shutil

        from patcher.patch import flow
        from smokekit import REPO, run_trainer

        checkout = tmp_path / "checkout"
        shutil.copytree(REPO / "fixtures" / "checkouts" / "package", checkout)
        assert flow.apply(checkout).exit_code == 0
        variants = json.dumps([{"dir": str(tmp_path / "original"), "original": True}])
        utils = checkout / "dschat" / "utils" / "utils.py"
        return tmp_path, run_trainer(tmp_path, 2, 3, "--variants", variants, utils=utils)

    return made_once(tmp_path_factory, "zero3-patched", make)


@pytest.fixture(scope="session")
def zero3_article_run(tmp_path_factory):
    """The article's hand edit run by `dsfix smoke` on real ZeRO-3 engines, 2 CPU ranks (gloo), bf16: what
    it printed and the folder it wrote ([0]-shaped placeholders, no config.json). Made once in the run
    (made_once). Returns (report, folder)."""
    pytest.importorskip("deepspeed")

    def make(base):
        from patcher.checkpoint.smoke import run_smoke
        from smokekit import NARROW, broken_code, make_checkout, quiet_console

        checkout = make_checkout(base / "DeepSpeed-Chat", broken_code("article_utils.py"))
        report = run_smoke(checkout, config_path=NARROW, dtype="bf16", zero_stage=3, nproc=2, keep=base / "out",
                           console=quiet_console(), timeout=300)
        return report, base / "out"

    return made_once(tmp_path_factory, "zero3-article", make)


@pytest.fixture(scope="session", autouse=True)
def killed_op_build(tmp_path_factory):
    """Every process the tests start finds a torch extensions folder holding the lock of a killed build of
    DeepSpeed's shared-memory all-reduce: one that tried to build that op would wait on the lock until its
    test's limit. So every launch of ranks also checks that they use gloo alone (patcher.checkpoint.smoke.ranks)."""
    from patcher.checkpoint.smoke.ranks import SHM_OP

    folder = tmp_path_factory.mktemp("torch-extensions")
    (folder / SHM_OP).mkdir()
    (folder / SHM_OP / "lock").touch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(folder))
        yield folder
