"""The fault-injection harness itself (tests/faultkit.py): what it counts, how it fails and kills, and the
start-up hook for processes a test starts. Real files in a temporary folder, real processes."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from faultkit import ERRNOS, KINDS, Faults, hook_env, read_record, snapshot


def _operation(folder):
    """One of each counted kind, the way dsfix's code makes them."""
    os.makedirs(os.path.join(folder, "a", "b"))                      # mkdir x2
    with open(os.path.join(folder, "a", "f.txt"), "w") as handle:    # open
        handle.write("text")                                         # write
        handle.flush()
        os.fsync(handle.fileno())                                    # fsync
    fd = os.open(os.path.join(folder, "g.bin"), os.O_WRONLY | os.O_CREAT, 0o644)  # open
    os.pwrite(fd, b"abc", 0)                                         # write
    os.close(fd)
    os.chmod(os.path.join(folder, "g.bin"), 0o600)                   # chmod
    os.replace(os.path.join(folder, "g.bin"), os.path.join(folder, "h.bin"))  # rename
    os.remove(os.path.join(folder, "h.bin"))                         # unlink
    shutil.rmtree(os.path.join(folder, "a"))                         # rmtree (one call)
    with open(os.path.join(folder, "read.txt"), "w"):                # open
        pass
    with open(os.path.join(folder, "read.txt")) as handle:           # reading: not counted
        handle.read()


EXPECTED = ["mkdir", "mkdir", "open", "write", "fsync", "open", "write", "chmod", "rename", "unlink", "rmtree",
            "open"]


def test_records_every_kind_inside_its_roots_alone(tmp_path):
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    with Faults(roots=[inside]) as rec:
        _operation(str(inside))
        _operation(str(outside))
    assert [c.kind for c in rec.calls] == EXPECTED
    assert set(EXPECTED) == set(KINDS)
    assert all(c.path.startswith(str(inside.resolve())) for c in rec.calls)
    assert rec.calls[-2] == ("rmtree", "shutil.rmtree", str((inside / "a").resolve()))
    assert type(open(tmp_path / "x", "w")).__module__ != "faultkit"  # the real functions are back


@pytest.mark.parametrize("n", range(len(EXPECTED)))
def test_fails_the_nth_call_with_its_path_and_nothing_after_it(tmp_path, n):
    faults = Faults(roots=[tmp_path], fail_at=n, error="ENOSPC")
    with pytest.raises(OSError) as caught:
        with faults:
            _operation(str(tmp_path))
    assert caught.value.errno == errno.ENOSPC
    assert [c.kind for c in faults.calls] == EXPECTED[:n + 1]
    assert faults.failed == faults.calls[n] and caught.value.filename == faults.failed.path


def test_every_kind_is_failed_with_eio_and_writes_with_enospc():
    assert set(ERRNOS) == set(KINDS)
    assert all(codes[0] == "EIO" for codes in ERRNOS.values())
    assert all("ENOSPC" in ERRNOS[k] for k in ("open", "write", "mkdir"))


def test_a_failed_rmtree_that_ignores_errors_raises_nothing_and_removes_nothing(tmp_path):
    """shutil.rmtree(ignore_errors=True) swallows its own failures: the failed call leaves the tree, quietly."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    with Faults(roots=[tmp_path], fail_at=0) as faults:
        shutil.rmtree(tmp_path / "a", ignore_errors=True)
    assert faults.failed is not None and (tmp_path / "a" / "f").read_text() == "x"
    with pytest.raises(OSError):
        with Faults(roots=[tmp_path], fail_at=0):
            shutil.rmtree(tmp_path / "a")


def test_kills_the_process_right_before_the_nth_call(tmp_path):
    pid = os.fork()
    if pid == 0:  # the child: killed before its fifth call (the fsync), so f.txt is there, g.bin is not
        try:
            with Faults(roots=[tmp_path], kill_at=4):
                _operation(str(tmp_path))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert sorted(snapshot(tmp_path)) == ["a", "a/b", "a/f.txt"]


def test_a_started_process_records_and_fails_through_the_hook(tmp_path):
    script = tmp_path / "op.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_faultkit import _operation
        _operation(sys.argv[1])
    """))
    work, record = tmp_path / "work", tmp_path / "calls.jsonl"
    work.mkdir()
    env = {**os.environ, **hook_env([work], record=record)}
    subprocess.run([sys.executable, str(script), str(work)], env=env, check=True)
    assert [c.kind for c in read_record(record)] == EXPECTED
    shutil.rmtree(work)
    work.mkdir()
    env = {**os.environ, **hook_env([work], fail_at=8, error="EACCES")}
    done = subprocess.run([sys.executable, str(script), str(work)], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "PermissionError" in done.stderr and "g.bin" in done.stderr
    env = {**os.environ, **hook_env([work], kill_at=0, rank=1)}  # RANK is not 1 here: nothing installed
    shutil.rmtree(work)
    work.mkdir()
    assert subprocess.run([sys.executable, str(script), str(work)], env=env).returncode == 0


def test_snapshot_keeps_modes_and_bytes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"\x00\x01")
    os.chmod(tmp_path / "d" / "x", 0o640)
    assert snapshot(tmp_path) == {"d": (snapshot(tmp_path)["d"][0], None), "d/x": (0o640, b"\x00\x01")}
    assert tempfile.gettempdir()
