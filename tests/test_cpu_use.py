"""``--cpu-use`` (tests/cpu_use.py): a test's CPU time is its own process's plus the children it reaped, the
summary adds the tests up per file beside the machine's busy CPU-seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import cpu_use

TESTS = os.path.dirname(os.path.abspath(__file__))

BURNS = textwrap.dedent("""
    import subprocess, sys, time

    def _burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def test_in_a_child():
        subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 1.0\\n"
                        "while time.process_time() < end: pass"], check=True)

    def test_in_this_process():
        _burn(0.6)

    def test_idle():
        time.sleep(0.3)
""")


def test_each_tests_cpu_is_its_process_and_its_reaped_children(tmp_path):
    (tmp_path / "test_burns.py").write_text(BURNS)
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {TESTS!r})\n"
                                          "from cpu_use import *  # noqa\n")
    record = tmp_path / "out" / "cpu.jsonl"
    record.parent.mkdir()
    record.write_text(json.dumps({"session": "an earlier run", "test": "old::t", "file": "old", "own": 99.0,
                                  "children": 0.0, "wall": 1.0, "worker": "main"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--cpu-use={record}",
                           "test_burns.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert lines[0]["session"] == "an earlier run"  # appended to, not replaced
    rows = {r["test"].split("::")[1]: r for r in lines[1:]}
    assert set(rows) == {"test_in_a_child", "test_in_this_process", "test_idle"}
    assert len({r["session"] for r in rows.values()}) == 1
    child, own, idle = rows["test_in_a_child"], rows["test_in_this_process"], rows["test_idle"]
    assert child["children"] >= 0.9 and child["own"] < 0.5, child
    assert own["own"] >= 0.55 and own["children"] == 0, own
    assert idle["own"] + idle["children"] < 0.2 and idle["wall"] >= 0.3, idle
    # the summary: this run's tests only (not the earlier run's 99 s), one file, and the machine's busy time
    said = [x for x in done.stdout.splitlines() if x.startswith("cpu use: ")]
    assert said[0].startswith("cpu use: 3 tests, 2 CPU-s in their process trees"), said
    assert "the machine was busy" in said[1] and "of " in said[1], said
    assert any(x.split()[2:4] == ["test_burns.py", "2"] for x in said), said


def test_machine_busy_counts_every_cores_work():
    before = cpu_use.machine_busy()
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    after = cpu_use.machine_busy()
    assert before is not None and after - before >= 0.45
