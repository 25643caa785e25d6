"""How a launch of ranks is judged and shown (tests/smokekit.py's Launch, fixtures/step1_trainer/rank_end.py), on
made-up logs: no ranks are started."""
import pytest

from smokekit import Launch, rank_end

DONE0, DONE1 = "step\n[rank 0] finished\n", "step\n[rank 1] finished\n"
ABORT1 = "step\n[rank 1] finished\nterminate called without an active exception\n"


@pytest.mark.parametrize("code,logs,ok,late,finished", [
    (0, {0: DONE0, 1: DONE1}, True, False, [0, 1]),
    # every rank finished, then a process died in its interpreter's exit: passes, named as a late exit
    (250, {0: DONE0, 1: ABORT1}, True, True, [0, 1]),
    # a rank that never printed its last line: its work (or its teardown) is not known to be done
    (0, {0: DONE0, 1: "step\n"}, False, False, [0]),
    (1, {0: DONE0, 1: "Traceback (most recent call last):\n"}, False, False, [0]),
    (250, {0: DONE0}, False, False, [0]),  # no log from rank 1
    (None, {0: DONE0, 1: DONE1}, False, False, [0, 1]),  # killed past the limit
    # another rank's line does not count, nor the line inside another
    (0, {0: DONE0, 1: "[rank 0] finished\n"}, False, False, [0]),
    (0, {0: DONE0, 1: "x [rank 1] finished\n"}, False, False, [0]),
])
def test_a_launch_is_ok_when_every_rank_printed_its_last_line(code, logs, ok, late, finished):
    launch = Launch(code, "launcher\n", logs, 2)
    assert (launch.ok, launch.late_exit, launch.finished) == (ok, late, finished)


def test_the_report_shows_each_rank_last_lines_and_the_launcher():
    logs = {0: "".join("line %d\n" % i for i in range(100)) + "[rank 0] finished\n", 1: "a\nb\nboom\n"}
    report = Launch(250, "spawned\nexits with return code = 1\n", logs, 3).report(lines=5)
    lines = report.splitlines()
    assert lines[0] == "launcher exit 250; 1 of 3 ranks finished (rank 0)"
    assert lines[1:7] == ["-- rank 0 (finished; last 5 of 101 lines):", "line 96", "line 97", "line 98", "line 99",
                          "[rank 0] finished"]
    assert lines[7:11] == ["-- rank 1 (did not finish; last 3 of 3 lines):", "a", "b", "boom"]
    assert lines[11] == "-- rank 2: no log"
    assert lines[12:] == ["-- the launcher (last 2 of 2 lines):", "spawned", "exits with return code = 1"]
    assert Launch(None, "", {}, 1).report().startswith("launcher exit none (killed past its limit); 0 of 1 ranks")


def test_rank_logs_reads_the_launchers_files(tmp_path):
    (tmp_path / "20261205083000_rank1.log").write_text(DONE1)
    (tmp_path / "20261205083000_rank0.log").write_text(DONE0)
    (tmp_path / "other.txt").write_text("x")
    assert rank_end.rank_logs(tmp_path) == {0: DONE0, 1: DONE1}
    assert rank_end.rank_logs(tmp_path / "none") == {}
    assert rank_end.END_LINE.format(rank=1) + "\n" == DONE1.split("\n", 1)[1]
