"""The spawn start method (macOS / Windows, or asked for): ranks are fresh interpreters, so what a
notebook cell defined reaches them by value.

The kernel test runs a real Jupyter kernel (nbclient) with ``STNB_START_METHOD=spawn`` in its
environment, as on a Mac where stnb picks spawn without being told; the cells never mention the
start method until the last launch, which asks for fork explicitly. In the notebook:

  0. setup; the hardware report says how ranks start here
  1. a function defined in the cell, reading a global of the cell, launched on 2 ranks; a lambda
     returning instances of a dataclass defined in the cell
  2. a build function, its dataset and a loss class defined in cells, trained under ddp and fsdp
  3. a function that reads an unpicklable global (a lock): refused before any process starts
  4. a spawned rank that raises: LaunchError with the rank and its traceback
  5. a long launch interrupted (KernelManager.interrupt_kernel, the stop button) while ranks run
  6. the same kernel launches with start_method="fork" afterwards
  7. psutil: the kernel's child processes at the end
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stnb.config import TrainConfig
from stnb.errors import ConfigError
from stnb.hardware import start_method

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

CELLS = [
    # 0
    """
    import json, os, sys, threading
    import psutil
    import stnb
    from stnb.models import built_path
    stnb.setup(show=False)
    TINY = built_path("tiny")
    print("METHOD " + stnb.hardware_report().start_method)
    print("KERNEL " + str(os.getpid()))
    """,
    # 1
    """
    OFFSET = 40

    def where_am_i(x):
        ctx = stnb.rank_context()
        return {"rank": ctx.rank, "pid": os.getpid(), "value": x + OFFSET, "start_method": ctx.start_method,
                # a forked rank shares the notebook's __main__ (and its OFFSET); a spawned one does not
                "main_has_offset": hasattr(sys.modules["__main__"], "OFFSET")}

    print("LAUNCH " + json.dumps(stnb.launch(where_am_i, 2, num_processes=2, device="cpu")))

    from dataclasses import dataclass

    @dataclass
    class Point:  # defined in the cell: a spawned rank has it only by value
        rank: int

    points = stnb.launch(lambda: Point(stnb.rank_context().rank), num_processes=2, device="cpu", echo=False)
    print("POINTS " + json.dumps([[type(p).__name__, p.rank] for p in points]))
    """,
    # 2
    """
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    class SharperMNRL(MultipleNegativesRankingLoss):  # a loss class defined in the notebook
        def __init__(self, model):
            super().__init__(model, scale=30.0)

    triplets = Dataset.from_list([{"anchor": f"question {i}", "positive": f"answer {i}",
                                   "negative": f"unrelated {i}"} for i in range(64)])

    def build():
        from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                           SentenceTransformerTrainingArguments)
        model = SentenceTransformer(TINY)
        args = SentenceTransformerTrainingArguments(output_dir=os.path.join(os.getcwd(), "out"), max_steps=4,
                                                    per_device_train_batch_size=8, report_to=[],
                                                    save_strategy="no")
        return SentenceTransformerTrainer(model=model, args=args, train_dataset=triplets,
                                          loss=SharperMNRL(model))

    runs = {s: stnb.run(build, strategy=s, num_processes=2, device="cpu") for s in ("ddp", "fsdp")}
    print("RUNS " + json.dumps({s: {"verified": r.verified, "reason": r.reason, "start_method": r.start_method,
                                    "steps": r.steps, "columns": r.verification.get("data_columns"),
                                    "checked": r.verification.get("start_method"), "loss": r.config.get("loss")}
                       for s, r in runs.items()}))
    """,
    # 3
    """
    lock = threading.Lock()

    def holds_lock():
        with lock:
            return 1

    kids = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        stnb.launch(holds_lock, num_processes=2, device="cpu")
        print("REFUSED " + json.dumps(None))
    except stnb.ConfigError as e:
        print("REFUSED " + json.dumps(str(e)))
    print("NEW_KIDS " + json.dumps(sorted({p.pid for p in psutil.Process().children(recursive=True)} - kids)))
    """,
    # 4
    """
    def fails_on_rank_1():
        if stnb.rank_context().rank == 1:
            raise ValueError("deliberate failure in a spawned rank")
        return "ok"

    try:
        stnb.launch(fails_on_rank_1, num_processes=2, device="cpu", echo=False)
        print("FAILED " + json.dumps(None))
    except stnb.LaunchError as e:
        print("FAILED " + json.dumps({"rank": e.rank, "traceback": e.rank_traceback}))
    """,
    # 5 (interrupted by the driver once rank 0 wrote READY)
    """
    import time

    def sleeps(ready):
        if stnb.rank_context().rank == 0:
            open(ready, "w").close()
        time.sleep(300)

    t0 = time.time()
    try:
        stnb.launch(sleeps, READY, num_processes=2, device="cpu", stall_timeout=None, echo=False)
        print("INTERRUPTED " + json.dumps(None))
    except KeyboardInterrupt:
        print("INTERRUPTED " + json.dumps(round(time.time() - t0, 1)))
    """,
    # 6
    """
    print("FORK " + json.dumps(stnb.launch(where_am_i, 1, num_processes=2, device="cpu", start_method="fork")))
    """,
    # 7
    """
    print("CHILDREN " + json.dumps([(p.pid, " ".join(p.cmdline())) for p in psutil.Process().children(recursive=True)]))
    """,
]

INTERRUPT_CELL = 5

DRIVER = r'''
import asyncio, os, sys, threading, time
import nbformat
from nbclient import NotebookClient

nb_path, ready, interrupt_cell = sys.argv[1], sys.argv[2], int(sys.argv[3])
nb = nbformat.read(nb_path, as_version=4)
client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                        resources={"metadata": {"path": os.path.dirname(nb_path)}})

def interrupter():  # the notebook's stop button, once the spawned ranks are running
    end = time.time() + 180
    while not os.path.exists(ready) and time.time() < end:
        time.sleep(0.1)
    time.sleep(1.0)
    asyncio.run(client.km.interrupt_kernel())

with client.setup_kernel():
    for i, cell in enumerate(nb.cells):
        if i == interrupt_cell:
            threading.Thread(target=interrupter, daemon=True).start()
        client.execute_cell(cell, i)
nbformat.write(nb, nb_path)
'''


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spawn")
    nb = nbformat.v4.new_notebook()
    ready = str(tmp / "ready.mark")
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(src).strip().replace("READY", repr(ready)))
                for src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb_path = tmp / "spawn.ipynb"
    nbformat.write(nb, nb_path)
    env = dict(os.environ, STNB_START_METHOD="spawn", STNB_PROFILE="ci", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(nb_path), ready, str(INTERRUPT_CELL)],
                          capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp))
    assert proc.returncode == 0, f"the notebook did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = {"errors": {}}
    for i, cell in enumerate(nbformat.read(nb_path, as_version=4).cells):
        for o in cell.outputs:
            if o.output_type == "error":  # each test names the cell it needs; the error says why it is missing
                out["errors"][i] = f"{o.ename}: {o.evalue}"[-3000:]
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key.isupper() and value:
                out[key] = value
    return out


def _output(spawned, key):
    assert key in spawned, f"no {key} line; cells that raised: {spawned['errors']}"
    return spawned[key]


def test_cell_function_runs_in_spawned_ranks(spawned):
    assert _output(spawned, "METHOD") == "spawn"  # STNB_START_METHOD, as the platform default would on macOS
    kernel = int(_output(spawned, "KERNEL"))
    ranks = json.loads(_output(spawned, "LAUNCH"))
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["value"] == 42 for r in ranks)  # the cell's global came along with the function
    assert all(r["start_method"] == "spawn" for r in ranks)
    assert not any(r["main_has_offset"] for r in ranks), "ranks share the notebook's __main__: not spawned"
    assert kernel not in {r["pid"] for r in ranks}


def test_cell_class_instances_come_back_from_spawned_ranks(spawned):
    assert json.loads(_output(spawned, "POINTS")) == [["Point", 0], ["Point", 1]]


def test_own_training_under_spawn_verified(spawned):
    runs = json.loads(_output(spawned, "RUNS"))
    for strategy, r in runs.items():
        assert r["verified"], (strategy, r["reason"])
        assert r["start_method"] == "spawn", (strategy, r)
        assert r["checked"] == {"requested": "spawn", "seen": "spawn", "per_rank": ["spawn", "spawn"]}
        assert r["steps"] == 4
        assert r["columns"] == ["anchor", "positive", "negative"]  # the hard negatives reached the ranks
        assert r["loss"] == "SharperMNRL"  # a class defined in a cell travels by value too


def test_unpicklable_global_refused_before_start(spawned):
    message = json.loads(_output(spawned, "REFUSED"))
    assert message is not None, "a function reading a lock was launched under spawn"
    assert "the global 'lock' (read by holds_lock)" in message and "cannot be pickled" in message
    assert "inside the function" in message and "start_method='fork'" in message
    assert json.loads(_output(spawned, "NEW_KIDS")) == []  # refused before any process started


def test_spawned_rank_failure_reported(spawned):
    failed = json.loads(_output(spawned, "FAILED"))
    assert failed is not None and failed["rank"] == 1
    assert "deliberate failure in a spawned rank" in failed["traceback"]
    assert "fails_on_rank_1" in failed["traceback"]


def test_interrupting_spawned_ranks_stops_them(spawned):
    seconds = json.loads(_output(spawned, "INTERRUPTED"))
    assert seconds is not None, "the launch ended without the interrupt"
    assert seconds < 120  # ranks sleep 300 s: the interrupt ended the launch
    # the kernel's children after it (and after the later cells): see test_nothing_left_but_multiprocessing_tracker


def test_fork_after_spawn_in_same_kernel(spawned):
    ranks = json.loads(_output(spawned, "FORK"))
    assert [r["start_method"] for r in ranks] == ["fork", "fork"]
    assert all(r["main_has_offset"] and r["value"] == 41 for r in ranks)


def test_nothing_left_but_multiprocessing_tracker(spawned):
    children = json.loads(_output(spawned, "CHILDREN"))
    # multiprocessing's resource tracker lives as long as the kernel (started by the first spawn)
    assert [c for c in children if "resource_tracker" not in c[1]] == [], children
    assert len(children) <= 1, children


def test_start_method_choice(monkeypatch):
    monkeypatch.delenv("STNB_START_METHOD", raising=False)
    assert start_method() == ("fork" if sys.platform.startswith("linux") else "spawn")
    assert start_method("spawn") == "spawn"
    monkeypatch.setattr(sys, "platform", "darwin")  # fork exists there but is not the default
    assert start_method() == "spawn"
    monkeypatch.setenv("STNB_START_METHOD", "fork")
    assert start_method() == "fork"
    monkeypatch.setenv("STNB_START_METHOD", "forkserver")
    with pytest.raises(ConfigError, match="STNB_START_METHOD='forkserver'"):
        start_method()
    with pytest.raises(ConfigError, match="unknown start_method 'threads'"):
        TrainConfig(start_method="threads").validate(check_resources=False)


def test_fork_refused_where_missing(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # Windows has no fork
    monkeypatch.delenv("STNB_START_METHOD", raising=False)
    assert start_method() == "spawn"
    with pytest.raises(ConfigError, match="not available on win32; use 'spawn'"):
        start_method("fork")


def test_script_without_main_guard_is_explained(tmp_path):
    """A script that launches at top level under spawn: each rank re-imports it first and fails there
    (multiprocessing refuses a launch during its bootstrap). The error says what to change, and no
    process of the run is left. A spawned rank imports torch and stnb before it gets there: on a busy
    machine (CI's own three workers on this 2-core host) that took longer than the 60 s a rank gets to start,
    and the launch was stopped as 'did not start' first; the script gives its ranks 240 s."""
    import uuid

    import psutil

    script = tmp_path / "train_no_guard.py"
    script.write_text("import stnb\n\ndef work():\n    return 1\n\n"
                      "stnb.launch(work, num_processes=2, device='cpu', start_method='spawn', timeout=240,\n"
                      "            stall_timeout=240)\n")
    mark = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, cwd=str(tmp_path),
                          env=dict(os.environ, STNB_TEST_MARK=mark))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stnb.errors.LaunchError: rank ") and "while its new Python process was starting" in last
    assert 'under `if __name__ == "__main__":`' in last
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("STNB_TEST_MARK") == mark:
                left.append((p.pid, p.cmdline()))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    assert left == []
