"""Results files: one JSON line appended per run, written atomically (temp file + rename), a
corrupted file detected and reported with the line, never silently overwritten.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import faultcases as fc
import stnb
from stnb import ResultsFileError, RunResult, TrainConfig
from stnb import results as results_mod


def _result(i: int = 0) -> RunResult:
    return RunResult(strategy="ddp", world_size=2, per_device_batch_size=4, global_batch_size=8, steps=3,
                     samples_per_second=10.0 + i, step_times=[0.1, 0.2, 0.3], losses=[1.0, 0.9, 0.8],
                     peak_memory_bytes=[1, 2], local_param_count=[5, 5], total_param_count=5, verified=True,
                     verification={"ok": True}, model="tiny", device="cpu", versions={"torch": "x"},
                     run_id=f"run{i}")


def _leftovers(folder: Path, name: str) -> list:
    return [p.name for p in folder.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".tmp")]


# ---- appending ----------------------------------------------------------------------------

def test_append_one_line_per_run(tmp_path):
    path = tmp_path / "sub" / "results.jsonl"  # the folder is created
    for i in range(3):
        stnb.append_result(path, _result(i))
        assert len(path.read_text().splitlines()) == i + 1
    rows = stnb.load_results(path, as_frame=False)
    assert [r["run_id"] for r in rows] == ["run0", "run1", "run2"]
    assert rows[1]["samples_per_second"] == 11.0
    frame = stnb.load_results(path)
    assert list(frame["run_id"]) == ["run0", "run1", "run2"]
    # each line is a complete JSON object on its own
    for line in path.read_text().splitlines():
        assert isinstance(json.loads(line), dict)
    assert _leftovers(path.parent, path.name) == []


def test_a_line_of_an_older_stnb_loads_without_the_step_parts(tmp_path):
    """Results files stay readable across versions: a line written before a run had collectives and the
    step spread loads with them empty, and a new line keeps them through the file."""
    from stnb import stepparts

    path = tmp_path / "results.jsonl"
    old = _result(0).to_dict()
    for field in ("collectives", "outside_steps"):
        old.pop(field)
    path.write_text(json.dumps(old) + "\n")
    new = _result(1)
    new.collectives = [{"steps": [{"all_reduce": {"count": 2, "bytes": 8}}] * 3, "outside_steps": {}}]
    new.outside_steps = [{"spread": {"steps": 1, "mean": 0.2, "std": 0.01, "p50": 0.2, "p90": 0.2}, "work": {}}]
    stnb.append_result(path, new)
    rows = [RunResult.from_dict(r) for r in stnb.load_results(path, as_frame=False)]
    assert rows[0].collectives == [] and rows[0].outside_steps == []
    assert stepparts.collectives(rows[0]) == [] and stepparts.parts(rows[0])["spread"] is None
    assert rows[1].collectives == new.collectives
    assert stepparts.collectives(rows[1]) == [{"all_reduce": {"count": 2.0, "bytes": 8.0}}]
    assert stepparts.parts(rows[1])["spread"]["std"] == 0.01
    assert len(stnb.load_results(path)) == 2


def test_append_keeps_earlier_runs_byte_for_byte(tmp_path):
    path = tmp_path / "results.jsonl"
    stnb.append_result(path, _result(0))
    first = path.read_bytes()
    stnb.append_result(path, {"run_id": "plain-dict", "strategy": "single"})
    assert path.read_bytes().startswith(first)


def test_append_keeps_file_mode(tmp_path):
    path = tmp_path / "results.jsonl"
    stnb.append_result(path, _result(0))
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()  # not mkstemp's 0600
    path.chmod(0o664)  # e.g. shared with a group
    stnb.append_result(path, _result(1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o664


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_hand_edited_file_keeps_its_bytes(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"run_id":  "by hand", "note": "caf\u00e9"}')  # odd spacing, no final newline
    before = path.read_bytes()
    stnb.append_result(path, {"run_id": "new"})
    assert path.read_bytes().startswith(before + b"\n")
    assert [r["run_id"] for r in stnb.load_results(path, as_frame=False)] == ["by hand", "new"]


def test_blank_lines_are_tolerated(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"run_id": "a"}) + "\n\n" + json.dumps({"run_id": "b"}) + "\n")
    stnb.append_result(path, {"run_id": "c"})
    assert [r["run_id"] for r in stnb.load_results(path, as_frame=False)] == ["a", "b", "c"]


# ---- atomic -------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_exception_during_write_keeps_old_content(tmp_path, monkeypatch, where):
    path = tmp_path / "results.jsonl"
    stnb.append_result(path, _result(0))
    stnb.append_result(path, _result(1))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(results_mod.os, where, boom)
    with pytest.raises(OSError, match="simulated"):
        stnb.append_result(path, _result(2))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, path.name) == []  # the temp file was removed
    stnb.append_result(path, _result(2))  # and the file is still usable
    assert len(stnb.load_results(path, as_frame=False)) == 3


def test_exception_while_serialising_keeps_old_content(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    stnb.append_result(path, _result(0))
    before = path.read_bytes()
    real = json.dumps

    def dumps(obj, *a, **k):  # the new row cannot be serialised
        if isinstance(obj, dict) and obj.get("run_id") == "run1":
            raise TypeError("simulated serialisation failure")
        return real(obj, *a, **k)

    monkeypatch.setattr(results_mod.json, "dumps", dumps)
    with pytest.raises(TypeError):
        stnb.append_result(path, _result(1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, path.name) == []


# FAULTS: injected into a writer process at run time (they replace the hand-written mutations of
# stnb's code, docs/testing.md): "no-lock" makes fcntl.flock a no-op, "in-place" makes the temporary
# file the target itself, opened truncated (what an atomic write must never do)
FAULTS = r"""
import os, sys, tempfile
if sys.argv[-1] == "no-lock":
    import fcntl
    fcntl.flock = lambda *a, **kw: None
if sys.argv[-1] == "in-place":
    def in_place(prefix="", suffix="", dir=None, **kw):
        target = os.path.join(dir, prefix[1:-1])  # the temporary file is named ".<target>.<random>.tmp"
        return os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), target
    tempfile.mkstemp = in_place
"""

CRASHER = r"""
import os, sys, time
sys.path.insert(0, {tests!r})
from stnb import results
path, ready = sys.argv[1], sys.argv[2]
real_fsync = os.fsync
def slow_fsync(fd):
    real_fsync(fd)
    open(ready, "w").close()   # the temp file is written; the rename has not happened
    time.sleep(60)
results.os.fsync = slow_fsync
results.append_result(path, {{"run_id": "never-lands", "pad": "x" * 200000}})
"""


def test_process_killed_mid_append_leaves_old_file(tmp_path):
    path = tmp_path / "results.jsonl"
    for i in range(3):
        stnb.append_result(path, _result(i))
    before = path.read_bytes()
    ready = tmp_path / "ready"
    code = CRASHER.format(tests=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(ready)])
    try:
        end = time.time() + 60
        while not ready.exists() and time.time() < end and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), "the writer never reached the middle of its append"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert path.read_bytes() == before  # the old file, whole
    assert [r["run_id"] for r in stnb.load_results(path, as_frame=False)] == ["run0", "run1", "run2"]
    stnb.append_result(path, _result(3))  # a stale temp file does not get in the way
    assert len(stnb.load_results(path, as_frame=False)) == 4


LOOPER = FAULTS + r"""
import sys
sys.path.insert(0, {tests!r})
from stnb import results
path = sys.argv[1]
i = 0
while True:
    results.append_result(path, {{"run_id": f"w{{i}}", "pad": "y" * 50000}})
    i += 1
"""


def test_random_kills_never_leave_a_partial_file(tmp_path):
    path = tmp_path / "results.jsonl"
    code = LOOPER.format(tests=str(Path(__file__).parent))
    last = 0
    for delay in (0.8, 1.1, 1.4):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if path.exists():
            rows = stnb.load_results(path, as_frame=False)  # parses: no partial line
            assert len(rows) >= last
            last = len(rows)


# ---- concurrent appends -------------------------------------------------------------------

def test_concurrent_appends_lose_no_run(tmp_path):
    path = tmp_path / "results.jsonl"
    errors = []

    def writer(w):
        try:
            for i in range(15):
                stnb.append_result(path, {"run_id": f"t{w}-{i}"})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ids = [r["run_id"] for r in stnb.load_results(path, as_frame=False)]
    assert sorted(ids) == sorted(f"t{w}-{i}" for w in range(4) for i in range(15)), f"{len(ids)} of 60 rows"


APPENDER = FAULTS + r"""
import os, sys, time
from stnb import results
path, tag, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(n):
    results.append_result(path, {{"run_id": f"{{tag}}-{{i}}", "pad": "z" * 20000}})
"""


def test_two_processes_appending_at_once_lose_no_run(tmp_path):
    """Two notebooks (here: two processes) appending to one results file at the same moment keep every
    row: the lock serialises processes, not only threads (with a thread lock 44 and 58 of 80 survived)."""
    kept, expected = _two_processes_append(tmp_path)
    assert sorted(kept) == sorted(expected), f"{len(set(kept) & set(expected))} of 80 rows kept"


@pytest.mark.slow
def test_without_the_process_lock_rows_are_lost(tmp_path):
    """The fault injected: flock a no-op in both writers. The race above is real: rows are lost."""
    kept, expected = _two_processes_append(tmp_path, "no-lock")
    assert len(set(kept) & set(expected)) < len(expected), "no row was lost without the lock"


def _two_processes_append(tmp_path, *fault) -> tuple:
    path, go = tmp_path / "results.jsonl", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER.format(), str(path), tag, "40", str(go), *fault])
             for tag in ("a", "b")]
    try:
        time.sleep(1.0)  # both interpreters started and waiting
        go.touch()
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    ids = [r["run_id"] for r in stnb.load_results(path, as_frame=False)]
    return ids, [f"{t}-{i}" for t in ("a", "b") for i in range(40)]


def test_a_reader_never_sees_a_partial_file(tmp_path):
    """While another process appends large rows, every read of the file parses completely and never
    has fewer rows than the read before: readers see the old file or the new one, never half."""
    problem, last, reads = _read_while_appending(tmp_path)
    assert problem is None, problem
    assert last > 3 and reads > 20, (last, reads)  # the writer did append while we read, many times


@pytest.mark.slow
def test_a_write_in_place_is_seen_half_written(tmp_path):
    """The fault injected: the writer truncates and rewrites the file itself instead of renaming a whole
    temporary file over it. A reader then sees a partial file, as the test above would report."""
    problem, last, reads = _read_while_appending(tmp_path, "in-place")
    assert problem is not None, f"{reads} reads never saw a partial file"


def _read_while_appending(tmp_path, *fault) -> tuple:
    """(the first partial or shrunken file a reader saw, or None; the rows at the last read; the reads)."""
    path = tmp_path / "results.jsonl"
    stnb.append_result(path, {"run_id": "first", "pad": "y" * 200000})
    writer = subprocess.Popen([sys.executable, "-c", LOOPER.format(tests=str(Path(__file__).parent)), str(path),
                               *fault])
    reads, last, problem = 0, 1, None
    try:
        # 4 s of reads from the writer's first row on (its Python and stnb start in seconds, more on a busy
        # machine: a loaded run once read only the first file for the 4 s)
        start_by, end = time.time() + 120, None
        while writer.poll() is None and problem is None:
            if end is None and last > 1:
                end = time.time() + 4.0
            if time.time() > (start_by if end is None else end):
                break
            try:
                rows = stnb.load_results(path, as_frame=False)  # ResultsFileError on a partial line
            except ResultsFileError as e:
                problem = f"a read found a partial file: {e}"
                break
            if len(rows) < last:
                problem = f"a read found {len(rows)} rows after one with {last}"
            last = len(rows)
            reads += 1
    finally:
        writer.kill()
        writer.wait(10)
    return problem, last, reads


# ---- corrupted files ----------------------------------------------------------------------

CORRUPT = {
    "truncated-last-line": lambda good: good + good[: len(good) // 2],          # a crash by another writer
    "truncated-middle-line": lambda good: good + good[:40] + "\n" + good,
    "not-an-object": lambda good: good + "[1, 2, 3]\n",
    "garbage": lambda good: good + "\x00\x00\x00garbage\n",
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_corrupted_file_reported_with_line_and_left_untouched(tmp_path, kind):
    path = tmp_path / "results.jsonl"
    good = json.dumps({"run_id": "ok", "samples_per_second": 1.0}) + "\n"
    path.write_text(CORRUPT[kind](good))
    before = path.read_bytes()
    with pytest.raises(ResultsFileError) as ei:
        stnb.append_result(path, _result(9))
    msg = str(ei.value)
    assert "corrupted at line 2" in msg and str(path) in msg
    assert "was not modified" in msg and ("repair" in msg or "Move it aside" in msg)
    assert path.read_bytes() == before  # never silently overwritten
    assert _leftovers(tmp_path, path.name) == []
    with pytest.raises(ResultsFileError, match="line 2"):
        stnb.load_results(path)
    with pytest.raises(ResultsFileError, match="line 2"):
        results_mod.check_writable(path)


def test_run_refuses_corrupted_results_file_before_starting(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"run_id": "ok"}\n{"run_id": "trunc')
    before = path.read_bytes()
    procs_before = fc.descendants()
    with fc.ChildSampler(procs_before) as sampler:
        with pytest.raises(ResultsFileError, match="line 2"):
            stnb.run(TrainConfig(model="tiny", device="cpu", steps=3), results_file=path, echo=False)
    assert not sampler.seen
    assert path.read_bytes() == before


def test_results_path_is_a_folder(tmp_path):
    with pytest.raises(ResultsFileError) as ei:
        stnb.append_result(tmp_path, _result(0))
    assert str(tmp_path) in str(ei.value)


def test_results_path_under_a_regular_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "sub" / "results.jsonl"
    with pytest.raises(ResultsFileError, match="writable"):
        results_mod.check_writable(target)
    with pytest.raises(ResultsFileError, match="writable path"):
        stnb.append_result(target, _result(0))
    assert blocker.read_text() == "x"


def _rank_result(step_times, rank):
    from stnb.rankreport import RankReport

    return RankReport(rank=rank, device="cpu", global_batch_size=8, step_times=step_times, losses=[0.5] * 5,
                      verification={"ok": True, "world_size_seen": 2, "local_param_count": 10, "total_param_count": 10},
                      memory_breakdown={}, peak_memory_bytes=1, weight_digests={"w": "same"}, time_to_first_step_s=1.0)


def test_merge_times_the_slowest_rank_not_the_sum_of_per_step_maxima():
    """Ranks finish a step at slightly different moments; the job's time is the slowest rank's own
    time, not the sum over steps of whichever rank was slower at each step (that adds their jitter)."""
    from stnb.results import merge

    cfg = stnb.TrainConfig(strategy="ddp", num_processes=2, steps=5, warmup_steps_excluded=1)
    r0 = _rank_result([9.0, 1.0, 2.0, 1.0, 2.0], 0)   # 6 s measured
    r1 = _rank_result([9.0, 2.0, 1.0, 2.0, 1.0], 1)   # 6 s measured; per-step maxima would sum to 8 s
    res = merge(cfg, [r0, r1], device="cpu")
    assert res.samples_per_second == pytest.approx(8 * 4 / 6.0)
    assert res.step_times == [9.0, 2.0, 2.0, 2.0, 2.0]  # per-step view kept for plots
    slow = merge(cfg, [r0, _rank_result([9.0, 2.0, 2.0, 2.0, 2.0], 1)], device="cpu")
    assert slow.samples_per_second == pytest.approx(8 * 4 / 8.0)
