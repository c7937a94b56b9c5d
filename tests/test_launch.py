"""stnb.launch with real processes: results, torch.distributed in every rank, a busy 29500,
a failing rank, per-rank output, and the refusals that happen before anything starts.

Functions run in ranks live in tests/rankfns.py (an importable module).
"""

from __future__ import annotations

import gc
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import re
import subprocess
import sys
import time

import psutil
import pytest
import torch

import importlib

import faultcases as fc
import rankfns
import stnb
from stnb import examples
from stnb.errors import ConfigError, LaunchError
from stnb.hardware import cpu_cores

stnb_launch = importlib.import_module("stnb.processes")  # the package (stnb.launch is the function)
cpu_launch = fc.cpu_launch  # stnb.launch(..., device="cpu"): gloo ranks, also where GPUs exist


def _descendants() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ---- results and torch.distributed ----------------------------------------------------------

def test_returns_every_rank_result_in_rank_order():
    before = _descendants()
    res = cpu_launch(rankfns.info, "hello", num_processes=2, echo=False)
    assert isinstance(res, list) and len(res) == 2
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["tag"] == "hello"
        assert r["initialized"] and r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["ctx_rank"] == r["rank"]  # stnb.rank_context() agrees
        assert r["all_reduce"] == 3.0  # 1 + 2: both ranks took part in one collective
    # one job of two processes, not two single-process runs: distinct processes, neither is
    # this one, and each saw the other's pid through all_gather_object
    pids = [r["pid"] for r in res]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert res[0]["pids"] == res[1]["pids"] == pids
    assert _descendants() - before == set()


def test_results_ordered_by_rank_not_by_completion():
    # rank 0 finishes last; the list is still [rank 0, rank 1]
    assert cpu_launch(rankfns.rank_value, 10, num_processes=2, echo=False) == [0, 10]


def test_progress_shows_each_rank_its_own_step():
    """The per-rank bars read each rank's own row: ranks at different steps are shown at different
    steps (a lagging rank is visible), with their own total and loss, and 'done' once they returned."""
    seen = []
    cpu_launch(rankfns.report_own_step, 50, num_processes=2, echo=False, on_progress=seen.append)
    assert seen, "on_progress was never called"
    last = seen[-1]  # the launch's final call, after both ranks returned
    assert [s.rank for s in last] == [0, 1]
    assert [s.step for s in last] == [3, 7]
    assert [s.total for s in last] == [50, 51]
    assert [s.loss for s in last] == [0.25, 1.25]
    assert [s.state for s in last] == ["done", "done"]
    # while running, every rank's step was already its own (the calls twice a second)
    running = [states for states in seen[:-1] if all(s.step for s in states)]
    assert running and all([s.step for s in states] == [3, 7] for states in running)


def test_channel_rows_are_per_rank():
    """In one process: what rank r reports is what the parent reads for rank r, and nothing else."""
    from stnb.processes.channel import Channel

    with Channel(3) as ch:
        fresh = ch.states()
        assert [(s.step, s.total, s.loss, s.state) for s in fresh] == [(0, 0, None, "starting")] * 3
        assert [s.seconds_since_progress for s in fresh] == [0.0] * 3  # no beat yet: not "stalled for ages"
        ch.report(1, 7, 40, 0.5)
        ch.report(2, 2, None, None)  # no total, no loss: the earlier values stay
        ch.report(2, 4, None, None)
        ch.check_in(2)
        states = ch.states()
        assert [s.step for s in states] == [0, 7, 4]
        assert [s.total for s in states] == [0, 40, 0]
        assert [s.loss for s in states] == [None, 0.5, None]
        assert [s.state for s in states] == ["starting", "starting", "setting up"]
        assert [ch.heartbeats(r) for r in range(3)] == [0.0, 1.0, 2.0]
        assert ch.pids() == {2: os.getpid()} and not ch.started(0) and ch.started(2)
        assert 0.0 <= states[2].seconds_since_progress < 60
        ch.mark_progress(2, time.time() - 100)
        ch.set_up(2)  # joined its world: running, and the stall limit counts from now
        assert ch.states()[2].state == "running" and ch.states()[2].seconds_since_progress < 60
        ch.set_state(1, 3.0)
        ch.set_state(0, 2.0)
        assert [s.state for s in ch.states()] == ["done", "failed", "running"]


def test_channel_files_per_rank():
    """What a rank leaves (result, error record, stack) is read back for that rank only; a rank that left
    nothing is silent; the folder goes with the channel."""
    import pickle

    from stnb.processes.channel import Channel

    with Channel(2) as ch:
        assert ch.is_silent(0) and ch.is_silent(1) and not ch.has_result(0)
        assert ch.read_error(0) is None and ch.read_stack(0) == ""
        with pytest.raises(FileNotFoundError):
            ch.read_result(0)
        ch.write_result(1, pickle.dumps({"rank": 1}))
        ch.write_error(0, {"type": "ValueError", "message": "bad"})
        with open(ch.path("stack", 0), "w") as f:
            f.write("Thread 1 ...")
        assert ch.read_result(1) == {"rank": 1} and ch.has_result(1) and not ch.has_result(0)
        assert ch.read_error(0) == {"type": "ValueError", "message": "bad"} and ch.read_error(1) is None
        assert ch.read_stack(0) == "Thread 1 ..." and ch.read_stack(1) == ""
        assert not ch.is_silent(0) and not ch.is_silent(1)
        assert oct(os.stat(ch.path("result", 1)).st_mode & 0o777) == oct(0o600)
        assert oct(os.stat(ch.path("error", 0)).st_mode & 0o777) == oct(0o600)
        ch.mark_progress(1, 1234.5)
        assert ch.last_progress(1) == 1234.5 and ch.last_progress(0) == 0.0
        ch.mark_progress(1, time.time() - 100)  # a rank quiet for 100 s is shown as quiet for 100 s
        assert 99 < ch.states()[1].seconds_since_progress < 200
        folder = ch.dir
        assert ch.path("log", 1) == os.path.join(folder, "log-1")
        assert os.path.basename(folder).startswith("stnb-launch-")  # leftovers in /tmp say whose they are
        ch.cleanup()
    assert not os.path.exists(folder)  # removed once, and leaving the context removes nothing twice


def test_a_launch_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """Its channel and torch elastic's per-rank folders are removed with the launch (elastic's default made a
    torchelastic_* folder per launch and left it)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where this process's temporary folders go
    res = cpu_launch(rankfns.info, num_processes=2, echo=False)
    assert [r["rank"] for r in res] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failed_launch_leaves_nothing_in_the_temporary_folder(nproc, tmp_path, monkeypatch):
    """A rank that raises leaves nothing either: torch.multiprocessing pickled its traceback into a
    pytorch-errorfile-* in /tmp that nothing removed (one per failed rank; stnb's error record holds it)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(LaunchError) as e:
        cpu_launch(examples.fail_on, 0, num_processes=nproc, echo=False)
    assert (e.value.kind, e.value.rank) == ("raised", 0) and "ValueError: rank 0 was asked to fail" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_launch_gives_the_notebook_its_environment_back(nproc, monkeypatch):
    """The ranks inherit STNB_LAUNCH and gloo on loopback while they start; the notebook's own environment is as
    it was after the launch, a value the user had set included (one rank: forked here; two: torch elastic)."""
    monkeypatch.delenv("STNB_LAUNCH", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the user's own: kept, not taken away after
    before = dict(os.environ)
    seen = cpu_launch(rankfns.read_env, ("STNB_LAUNCH", "GLOO_SOCKET_IFNAME"), num_processes=nproc, echo=False)
    assert seen == [{"STNB_LAUNCH": "1", "GLOO_SOCKET_IFNAME": "lo"}] * nproc
    assert dict(os.environ) == before


def test_single_process_launch():
    res = cpu_launch(rankfns.info, num_processes=1, echo=False)
    assert len(res) == 1 and res[0]["rank"] == 0 and res[0]["world_size"] == 1
    assert res[0]["pid"] != os.getpid()


@pytest.mark.parametrize("nproc", [1, 2])
def test_ranks_with_threads_after_the_parent_ran_torch(nproc):
    # the notebook ran a multi-threaded torch op before launching (libgomp then owns a thread
    # pool in this process); ranks with more than one thread each must not deadlock in theirs
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(256, 4096)
        torch.nn.functional.layer_norm(x, (4096,)).sum()
        res = cpu_launch(rankfns.torch_work, 5, num_processes=nproc, threads_per_rank=2, echo=False,
                          stall_timeout=20)
        assert len(res) == nproc and len(set(res)) == 1
        torch.nn.functional.layer_norm(x, (4096,)).sum()  # the parent's own pool still works
    finally:
        torch.set_num_threads(old)


# ---- what the ranks inherit -------------------------------------------------------------------

class _CyclicGarbage:
    """Garbage in a reference cycle whose destructor leaves the pid of the process that ran it."""

    def __init__(self, path: str):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_a_rank_never_runs_destructors_of_garbage_it_inherited(tmp_path):
    # the notebook's uncollected garbage (an earlier failed launch's TCPStore, in a cycle, crashed ranks
    # with SIGSEGV when they collected it): a rank collects its own garbage and never reaches the inherited
    path = tmp_path / "destroyed-by"
    gc.disable()  # the garbage below stays uncollected until the launch forks
    try:
        _CyclicGarbage(str(path))
        pids = cpu_launch(rankfns.collect_garbage, num_processes=2, echo=False)
    finally:
        gc.enable()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    ran = [int(p) for p in path.read_text().split()] if path.exists() else []
    assert not set(ran) & set(pids), f"a rank ran the destructor of garbage it inherited: {ran} in {pids}"
    gc.collect()  # the notebook's own collector still frees it, here
    assert os.getpid() in [int(p) for p in path.read_text().split()]


INHERITED_DEEPSPEED = """
import importlib.util, json, sys, torch, stnb
sys.path.insert(0, %r)
import rankfns
before = "deepspeed" in sys.modules
ranks = stnb.launch(rankfns.inherited_modules, "deepspeed", num_processes=2, device="cpu", echo=False)
print(json.dumps({"before": before, "parent": "deepspeed" in sys.modules, "ranks": [r["held"]["deepspeed"] for r in ranks],
                  "cpu_build": torch.version.cuda is None and torch.version.hip is None,
                  "installed": importlib.util.find_spec("deepspeed") is not None}))
"""


def test_forked_ranks_inherit_deepspeed_instead_of_each_importing_it():
    # every Trainer imports DeepSpeed when it is installed (accelerate's unwrap_model): with a CPU torch the
    # notebook imports it once before forking, so no rank pays that import (0.8 CPU-s a rank here). With a
    # CUDA torch the ranks import it themselves: its import starts the CUDA driver, which forks can't inherit.
    # A fresh interpreter: this one may have imported DeepSpeed already.
    out = subprocess.run([sys.executable, "-c", INHERITED_DEEPSPEED % os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    expected = seen["cpu_build"] and seen["installed"]
    assert seen["before"] is False
    assert seen["parent"] is expected and seen["ranks"] == [expected, expected], seen


def test_busy_port_29500_does_not_matter():
    # torch's and accelerate's default port is held (by us, or by whoever holds it already): a launch
    # that fell back on 29500 would fail to bind its rendezvous store
    with fc.busy_port(29500):
        assert fc.port_busy(29500)
        res = cpu_launch(rankfns.info, num_processes=2, echo=False)
    assert [r["rank"] for r in res] == [0, 1] and all(r["all_reduce"] == 3.0 for r in res)
    assert res[0]["master_port"] == res[1]["master_port"] == str(stnb.last_launch().port)


def test_a_picked_port_another_program_takes_before_the_store_binds_it_is_picked_again(monkeypatch):
    # free_port only finds a port free for a moment: here the first one it returns is taken (held by
    # this test) before elastic's rendezvous store binds it, as another process's connection took one
    # in CI ("EADDRINUSE" from the launcher, no rank started). stnb picks another and starts again.
    taken = stnb_launch.free_port()
    real, picked = stnb_launch.launcher.free_port, []

    def first_one_taken(host="127.0.0.1"):
        picked.append(taken if not picked else real(host))
        return picked[-1]

    monkeypatch.setattr(stnb_launch.launcher, "free_port", first_one_taken)
    with fc.busy_port(taken) as held:
        assert held, f"could not hold port {taken}"
        res = cpu_launch(rankfns.info, num_processes=2, echo=False)
    assert [r["rank"] for r in res] == [0, 1] and all(r["all_reduce"] == 3.0 for r in res)
    assert len(picked) == 2 and picked[0] == taken
    assert res[0]["master_port"] == res[1]["master_port"] == str(stnb.last_launch().port) == str(picked[1])


def test_a_one_process_world_needs_no_picked_port(monkeypatch):
    # a world of one process binds its store on any free port (0) as it starts: no moment in which a
    # port free_port found could be taken by another program
    def every_port_taken(host="127.0.0.1"):
        raise AssertionError("a one-process launch asked for a port")

    monkeypatch.setattr(stnb_launch.launcher, "free_port", every_port_taken)
    res = cpu_launch(rankfns.info, num_processes=1, echo=False)
    assert res[0]["initialized"] and res[0]["world_size"] == 1 and res[0]["all_reduce"] == 1.0
    assert stnb.last_launch().port == 0 and res[0]["master_port"] == "0"


def test_explicit_busy_master_port_is_refused_before_starting():
    port = stnb_launch.free_port()
    before = _descendants()
    with fc.busy_port(port) as held:
        assert held, f"could not hold port {port}"
        with pytest.raises(ConfigError) as ei:
            cpu_launch(rankfns.info, num_processes=2, echo=False, master_port=port)
    msg = str(ei.value)
    assert str(port) in msg and "already in use" in msg and "master_port=None" in msg
    assert _descendants() - before == set()


def test_explicit_free_master_port_is_used():
    port = stnb_launch.free_port()
    res = cpu_launch(rankfns.info, num_processes=2, echo=False, master_port=port)
    assert res[0]["master_port"] == str(port)


# ---- a rank that raises -------------------------------------------------------------------

def test_rank_raises_launch_error_others_stopped_no_children(tmp_path):
    mark = str(tmp_path / "mark")
    before = _descendants()
    t0 = time.time()
    with pytest.raises(LaunchError) as ei:
        # rank 0 would idle for 120 s: it must be stopped, not waited for
        cpu_launch(rankfns.raise_on, 1, mark, 120.0, num_processes=2, echo=False)
    t_err = time.time()
    e = ei.value
    assert e.rank == 1 and e.kind == "raised"
    msg = str(e)
    assert "rank 1" in msg and "ValueError: deliberate failure in rank 1" in msg
    assert "--- traceback of rank 1 ---" in msg and 'rankfns.py", line' in msg and "_fail_here" in msg
    fault = fc.read_mark(mark)
    assert fault is not None
    stopped_after = t_err - fault
    print(f"error {stopped_after:.2f} s after the fault; launch took {t_err - t0:.2f} s")
    assert stopped_after < 10, stopped_after  # generous: machine is shared
    # every rank process is gone, and no descendant of ours is left (zombies included)
    pids = rankfns.rank_pids(mark)
    assert len(pids) == 2
    assert not [p for p in pids if fc._alive(p)]
    assert _descendants() - before == set()
    # the rank's output is kept on the error
    assert "about to fail" in e.logs[1]
    # and the next launch in this process works
    assert [r["rank"] for r in cpu_launch(rankfns.info, num_processes=2, echo=False)] == [0, 1]


def test_unpicklable_result_names_the_fix():
    with pytest.raises(LaunchError) as ei:
        cpu_launch(rankfns.unpicklable, num_processes=2, echo=False)
    assert "cannot be pickled" in str(ei.value) and "return plain data" in str(ei.value)


# ---- output ---------------------------------------------------------------------------------

LINE = re.compile(r"^\[rank (\d)\] spam r(\d) i(\d{4}) x{60} end r(\d) i(\d{4})$")


def test_rank_output_prefixed_whole_lines_not_interleaved(capfd):
    res = cpu_launch(rankfns.spam, 400, num_processes=2)
    assert res == [400, 400]
    out, err = capfd.readouterr()
    lines = [ln for ln in out.splitlines() if "spam" in ln]
    per_rank = {0: [], 1: []}
    for ln in lines:
        if "c-level" in ln:
            m = re.match(r"^\[rank (\d)\] spam r(\d) c-level line end r(\d)$", ln)
            assert m and m.group(1) == m.group(2) == m.group(3), ln
            continue
        m = LINE.match(ln)
        assert m, f"not a whole, prefixed line: {ln!r}"
        assert m.group(1) == m.group(2) == m.group(4), f"line of another rank: {ln!r}"
        assert m.group(3) == m.group(5)
        per_rank[int(m.group(1))].append(int(m.group(3)))
    # every line of both ranks (stdout and stderr of the rank), each rank's in order
    for r in (0, 1):
        assert per_rank[r] == list(range(400)), f"rank {r}: {len(per_rank[r])} lines"
    assert sum("c-level" in ln for ln in lines) == 2
    assert "spam" not in err  # the parent prints rank output on stdout only


def test_echo_false_keeps_output_in_last_launch(capfd):
    cpu_launch(rankfns.spam, 5, num_processes=2, echo=False)
    out, _ = capfd.readouterr()
    assert "spam" not in out
    logs = stnb.last_launch().logs
    assert all(f"spam r{r} i0004" in logs[r] for r in (0, 1))


# ---- refusals before anything starts ----------------------------------------------------------

def _refused(call):
    before = _descendants()
    with fc.ChildSampler(before) as sampler:
        with pytest.raises(ConfigError) as ei:
            call()
    assert not sampler.seen, "a process was started before the refusal"
    assert _descendants() - before == set()
    return str(ei.value)


def test_check_fork_safe_refuses_when_cuda_initialised(monkeypatch):
    if not torch.cuda.is_initialized():
        stnb_launch.check_fork_safe()  # fine: no CUDA in this process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError) as ei:
        stnb_launch.check_fork_safe()
    msg = str(ei.value)
    assert "CUDA is already initialised" in msg and "forked" in msg
    assert "restart the kernel" in msg and "inside the launched function" in msg
    # and launch refuses before starting anything
    msg = _refused(lambda: cpu_launch(rankfns.info, num_processes=2, echo=False))
    assert "CUDA is already initialised" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to initialise CUDA for real")
def test_real_cuda_initialisation_is_refused(tmp_path):
    # in a fresh interpreter (this one must stay fork-safe): a tensor on the GPU, then a launch
    code = ("import sys, torch, stnb; sys.path.insert(0, %r); import rankfns\n"
            "torch.zeros(1, device='cuda')\n"
            "try:\n    stnb.launch(rankfns.info, num_processes=1)\n"
            "except stnb.ConfigError as e:\n    print('REFUSED', e)\n" % os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED CUDA is already initialised" in out.stdout, out.stdout + out.stderr
    # stnb was imported after torch, so it watched: the refusal names the line (tests/test_cuda_first_start.py)
    assert "It was first started by <string>, line 2" in out.stdout and "torch.cuda._lazy_init" in out.stdout, out.stdout


def test_more_processes_than_cores_refused():
    n = cpu_cores() + 1  # 3 on the 2-core CI machine
    msg = _refused(lambda: cpu_launch(rankfns.info, num_processes=n, echo=False, device="cpu"))
    assert f"num_processes={n}" in msg and "CPU core" in msg and f"num_processes <= {cpu_cores()}" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_cuda_device_without_gpu_refused():
    msg = _refused(lambda: cpu_launch(rankfns.info, num_processes=2, echo=False, device="cuda"))
    assert "no CUDA GPU" in msg and "device='cpu'" in msg


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_processes=0), ["num_processes", "integer >= 1", "0"]),
    (dict(num_processes=-1), ["num_processes", "integer >= 1", "-1"]),
    (dict(num_processes="2"), ["num_processes", "integer >= 1", "'2'"]),
    (dict(num_processes=True), ["num_processes", "integer >= 1", "True"]),
    (dict(num_processes=2.0), ["num_processes", "integer >= 1"]),
    (dict(timeout=0), ["timeout", "positive number of seconds"]),
    (dict(timeout=-5), ["timeout", "positive number of seconds"]),
    (dict(timeout="10"), ["timeout", "positive number of seconds"]),
    (dict(stall_timeout=0), ["stall_timeout", "positive number of seconds"]),
    (dict(device="tpu"), ["device", "'auto', 'cpu' or 'cuda'"]),
    (dict(threads_per_rank=0), ["threads_per_rank", "integer >= 1"]),
    (dict(num_nodes=0), ["num_nodes", "integer >= 1"]),
    (dict(node_rank=1), ["node_rank", "num_nodes=1"]),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_bad_arguments_refused(kwargs, words):
    msg = _refused(lambda: cpu_launch(rankfns.info, **{"num_processes": 2, "echo": False, **kwargs}))
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("fn", ["rankfns.info", None, 42])
def test_non_callable_refused(fn):
    msg = _refused(lambda: cpu_launch(fn, num_processes=2, echo=False))
    assert "needs a callable" in msg and type(fn).__name__ in msg


# ---- stnb.launch: the function; stnb.processes: its package ------------------------------------------------

PACKAGE_AND_FUNCTION = r"""
import json, pathlib
import stnb.processes.supervise            # the package's submodules import before and after `import stnb`
from stnb.processes import child_subreaper, free_port, last_launch, LaunchInfo, RankState
from stnb.processes.supervise import kill_tree, children_now
import stnb
res = stnb.launch(lambda: 1, num_processes=1, device="cpu", echo=False)
print(json.dumps({"callable": callable(stnb.launch), "defined_in": stnb.launch.__module__, "res": res,
                  "info": isinstance(stnb.last_launch(), LaunchInfo), "same": last_launch is stnb.last_launch,
                  "no_package_named_launch": not (pathlib.Path(stnb.__file__).parent / "launch" / "__init__.py").exists()}))
"""


def test_stnb_launch_is_the_function_and_its_package_stays_importable():
    """`stnb.launch` is the function and nothing else (its package is `stnb.processes`, whose public names
    and submodules import before and after `import stnb`). Fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PACKAGE_AND_FUNCTION], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"callable": True, "defined_in": "stnb.processes.launcher", "res": [1], "info": True, "same": True,
                   "no_package_named_launch": True}


def test_no_private_name_of_launch_is_imported_elsewhere():
    """Other stnb modules, and the launch package's own modules among themselves, import only public
    names from stnb.launch."""
    import ast
    import pathlib

    root = pathlib.Path(stnb.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        mod = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                if target == "stnb.processes" or target.startswith("stnb.processes."):
                    bad += [f"{mod}: from {target} import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_progress_ends_with_a_plain_text_line(capsys):
    """A viewer without widgets shows a Jupyter bar as the text it was created with (0%): the bars end
    with one printed line that says how far the run got, printed once however often close() is called."""
    from stnb.processes.channel import RankState
    from stnb.launchers.bars import StepBars

    bars = StepBars("ddp")
    bars.update([RankState(0, "running", 3, 30, 0.5, 0.0), RankState(1, "running", 2, 30, 0.5, 0.0)])
    bars.update([RankState(0, "done", 30, 30, 0.25, 0.0), RankState(1, "done", 30, 30, 0.25, 0.0)])
    bars.close()
    bars.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ddp:")]
    assert len(lines) == 1 and re.fullmatch(r"ddp: 30/30 steps, 2 ranks, \d+ s", lines[0]), lines
    stopped = StepBars("fsdp")
    stopped.update([RankState(0, "failed", 7, 30, None, 0.0), RankState(1, "running", 9, 30, None, 0.0)])
    stopped.close()
    out = capsys.readouterr().out
    assert re.search(r"^fsdp: 7/30 steps, 2 ranks, \d+ s \(stopped before the last step\)$", out, re.M), out
    silent = StepBars("single")  # no rank ever reported a step count: nothing to say
    silent.close()
    assert "single" not in capsys.readouterr().out


def test_known_harmless_warnings_are_left_out_and_others_kept():
    """A CPU rank does not print torch's pin_memory warning, sentence-transformers' drop_last note or a
    LOAD REPORT of a new classification head only; a warning stnb does not know, a report with any other
    row and another note of the same logger still print."""
    # spawned: a forked rank would inherit pytest's warning recorder and log capture, which print nothing
    assert cpu_launch(rankfns.harmless_and_other_warnings, num_processes=2, echo=False, start_method="spawn") == [0, 1]
    for log in stnb.last_launch().logs.values():
        assert "pin_memory" not in log and "dataloader_drop_last" not in log, log
        assert "BertForSequenceClassification LOAD REPORT" not in log, log
        assert "OtherModel LOAD REPORT" in log and "UNEXPECTED" in log, log
        assert "a warning stnb knows nothing about" in log and "another note of theirs" in log, log


def test_a_bar_lock_a_dead_process_left_held_never_stops_a_later_rank():
    """tqdm's multiprocessing lock is one semaphore shared by the launching process and every rank it forks. A
    rank killed while drawing a bar (the Stop button, the stall watchdog, the out-of-memory killer) leaves it
    held for good; a later rank of the same kernel must still draw its bars (seen in CI: every later launch of
    one test worker stalled at its first bar, 60 s, and failed)."""
    import multiprocessing

    import tqdm.std

    locks = tqdm.std.TqdmDefaultWriteLock
    saved = {"mp_lock": locks.__dict__.get("mp_lock"), "_lock": tqdm.std.tqdm.__dict__.get("_lock")}
    held = multiprocessing.get_context("fork").RLock()
    locks.mp_lock = held
    tqdm.std.tqdm.__dict__.get("_lock") is not None and delattr(tqdm.std.tqdm, "_lock")
    pid = os.fork()
    if pid == 0:  # a process of this kernel that dies holding the bars' lock
        held.acquire()
        os._exit(0)
    os.waitpid(pid, 0)
    try:
        assert not held.acquire(timeout=0.2)  # held for good by the dead process
        assert cpu_launch(rankfns.draws_a_bar, 3, num_processes=2, timeout=120, stall_timeout=15, echo=False,
                          start_method="fork") == [3, 3]
    finally:  # this worker's own bars get their lock back
        tqdm.std.tqdm.__dict__.get("_lock") is not None and delattr(tqdm.std.tqdm, "_lock")
        for name, value in saved.items():
            owner = locks if name == "mp_lock" else tqdm.std.tqdm
            if value is None:
                owner.__dict__.get(name) is not None and delattr(owner, name)
            else:
                setattr(owner, name, value)
