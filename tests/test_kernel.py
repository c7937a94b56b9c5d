"""stnb.launch inside a real Jupyter kernel (nbclient), the way a notebook cell runs it.

nbclient runs in a subprocess (``python -c DRIVER``), so the kernel it starts inherits that
subprocess's stderr: everything ipykernel logs - in particular "attempted to send message from
fork", which it logs when a forked process touches the kernel's sockets - lands in the
``stderr`` this test captures. The notebook:

  0. imports stnb and tests/rankfns.py (as tests_rankfns)
  1. stnb.launch(tests_rankfns.chatty, num_processes=2): many prints, tqdm.auto bars and an
     ipywidgets widget inside each rank (every launch here passes device="cpu": gloo ranks)
  2. a launch whose rank 1 raises (the cell fails with LaunchError)
  3. a long launch, interrupted from another thread with KernelManager.interrupt_kernel
  4. psutil: the kernel's child processes
  5. a normal launch in the same kernel
  6. control: a raw os.fork() that calls display() - proves the fork warning *is* detected
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

TESTS = Path(__file__).resolve().parent
FORK_WARNING = "attempted to send message from fork"
CONTROL_MARKER = "=== stnb-test: control cell starts ==="

CELLS = [
    # 0
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    os.environ["HF_HUB_OFFLINE"] = "1"
    import psutil
    import stnb
    import rankfns as tests_rankfns
    print("READY", os.getpid())
    """,
    # 1
    """
    res = stnb.launch(tests_rankfns.chatty, 120, num_processes=2, device="cpu")
    print("RESULT " + json.dumps(res))
    """,
    # 2 (raises)
    """
    stnb.launch(tests_rankfns.raise_on, 1, None, 120.0, num_processes=2, device="cpu")
    """,
    # 3 (interrupted)
    """
    stnb.launch(tests_rankfns.sleep_silent, 300.0, {ready!r}, num_processes=2, stall_timeout=None, device="cpu")
    """,
    # 4
    """
    kids = [(p.pid, p.status(), " ".join(p.cmdline()[:3])) for p in psutil.Process().children(recursive=True)]
    print("CHILDREN " + json.dumps(kids))
    print("RANKS_ALIVE " + json.dumps([pid for pid in tests_rankfns.rank_pids({ready!r})
                                       if psutil.pid_exists(pid)
                                       and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]))
    """,
    # 5
    """
    res = stnb.launch(tests_rankfns.info, "after", num_processes=2, device="cpu")
    print("AFTER " + json.dumps([[r["rank"], r["world_size"], r["all_reduce"]] for r in res]))
    """,
    # 6 control: a fork that talks to the kernel's sockets must be noticed by this test
    """
    from IPython.display import display
    pid = os.fork()
    if pid == 0:
        try:
            display("hello from a raw fork")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("CONTROL DONE")
    """,
]
RAISES = {2, 3}
INTERRUPT_CELL = 3
CONTROL_CELL = 6

DRIVER = r'''
import asyncio, json, os, sys, threading, time, traceback
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

nb_path, ready, interrupt_cell, control_cell, marker, report = sys.argv[1:7]
interrupt_cell, control_cell = int(interrupt_cell), int(control_cell)
nb = nbformat.read(nb_path, as_version=4)
client = NotebookClient(nb, timeout=240, kernel_name="python3",
                        resources={"metadata": {"path": os.path.dirname(nb_path)}})
events = {"errors": {}, "interrupt_sent": None, "interrupt_error": None}

def interrupter():
    end = time.time() + 120
    while not os.path.exists(ready) and time.time() < end:
        time.sleep(0.1)
    time.sleep(2.0)  # the ranks are running: interrupt mid-launch
    try:
        asyncio.run(client.km.interrupt_kernel())
        events["interrupt_sent"] = time.time()
    except Exception:
        events["interrupt_error"] = traceback.format_exc()

with client.setup_kernel():
    events["kernel_pid"] = client.km.provisioner.process.pid
    for i, cell in enumerate(nb.cells):
        if i == interrupt_cell:
            threading.Thread(target=interrupter, daemon=True).start()
        if i == control_cell:
            sys.stderr.write(marker + "\n")
            sys.stderr.flush()
        t = time.time()
        try:
            client.execute_cell(cell, i)
        except CellExecutionError as e:
            events["errors"][str(i)] = {"ename": getattr(e, "ename", None), "evalue": getattr(e, "evalue", None)}
        events.setdefault("seconds", {})[str(i)] = round(time.time() - t, 2)
        if i == control_cell:
            time.sleep(1.0)  # let the kernel log the control's warning before shutdown
nbformat.write(nb, nb_path)
with open(report, "w") as f:
    json.dump(events, f)
'''


def _error(cell) -> dict | None:
    errs = [o for o in cell.outputs if o.output_type == "error"]
    return {"ename": errs[0].ename, "evalue": errs[0].evalue} if errs else None


def _stream_text(cell, name=None) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and (name is None or o.name == name))


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel")
    ready = str(tmp / "ready.mark")
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(CELLS):
        cell = nbformat.v4.new_code_cell(textwrap.dedent(src.format(tests=str(TESTS), ready=ready)).strip())
        if i in RAISES:
            cell.metadata["tags"] = ["raises-exception"]  # nbclient lets these cells fail
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb_path = tmp / "launch_in_kernel.ipynb"
    nbformat.write(nb, nb_path)
    report = tmp / "report.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(nb_path), ready, str(INTERRUPT_CELL),
                           str(CONTROL_CELL), CONTROL_MARKER, str(report)],
                          capture_output=True, text=True, timeout=420, env=env, cwd=str(tmp))
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    executed = nbformat.read(nb_path, as_version=4)
    return {"nb": executed, "events": json.loads(report.read_text()), "stderr": proc.stderr}


def test_no_fork_message_from_ranks(kernel_run):
    stderr = kernel_run["stderr"]
    before, marker, after = stderr.partition(CONTROL_MARKER)
    assert marker, f"control marker missing from the kernel's stderr:\n{stderr[-3000:]}"
    # the kernel's own log, while stnb ranks printed, drew bars and made widgets: nothing
    assert FORK_WARNING not in before, before[-4000:]
    # nor did a rank's copy of that warning reach the notebook through the rank's log
    for i in range(CONTROL_CELL):
        assert FORK_WARNING not in _stream_text(kernel_run["nb"].cells[i])
    # the control fork proves this test would see it
    assert FORK_WARNING in after, f"control fork did not trigger the warning; stderr after marker:\n{after}"


def test_chatty_launch_output_whole_prefixed_lines(kernel_run):
    cell = kernel_run["nb"].cells[1]
    text = _stream_text(cell)
    assert _error(cell) is None, _error(cell)
    # no widget views or other rich output sent from the ranks
    assert all(o.output_type == "stream" for o in cell.outputs), [o.output_type for o in cell.outputs]
    lines = text.splitlines()
    chatty = [ln for ln in lines if "chatty r" in ln]
    per_rank = {0: [], 1: []}
    for ln in chatty:
        m = re.match(r"^\[rank (\d)\] chatty r(\d) (?:line (\d{4}) y{40}|done)$", ln)
        assert m, f"not a whole prefixed line: {ln!r}"
        assert m.group(1) == m.group(2), f"line from another rank: {ln!r}"
        if m.group(3):
            per_rank[int(m.group(1))].append(int(m.group(3)))
    assert per_rank[0] == list(range(120)) and per_rank[1] == list(range(120))
    # the tqdm.auto bars became text bars in the ranks; their final state is one prefixed line
    for r in (0, 1):
        assert re.search(rf"^\[rank {r}\] bar r{r}: 100%", text, re.M), text[-2000:]
    # every output line that came from a rank carries the prefix (the parent adds one header)
    for ln in lines:
        assert ln.startswith("[rank ") or ln.startswith("stnb: launching") or ln.startswith("RESULT "), ln
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    assert [r["rank"] for r in result] == [0, 1]
    assert all(r["widget_value"] == 3 for r in result)
    assert all(r["tqdm_class"] == "tqdm.std" for r in result), result


def test_failing_launch_in_kernel(kernel_run):
    err = _error(kernel_run["nb"].cells[2])
    assert err and err["ename"] == "LaunchError", err
    assert "rank 1 raised ValueError" in err["evalue"] and "deliberate failure in rank 1" in err["evalue"]


def test_interrupt_stops_launch_and_kernel_recovers(kernel_run):
    ev = kernel_run["events"]
    assert ev["interrupt_error"] is None, ev["interrupt_error"]
    assert ev["interrupt_sent"] is not None, "interrupt was never sent"
    err = _error(kernel_run["nb"].cells[3])
    assert err and err["ename"] == "KeyboardInterrupt", err
    assert ev["seconds"]["3"] < 120, "the interrupted launch did not stop promptly"
    nb = kernel_run["nb"]
    children = json.loads(_stream_text(nb.cells[4]).split("CHILDREN ", 1)[1].splitlines()[0])
    assert children == [], f"processes left in the kernel: {children}"
    alive = json.loads(_stream_text(nb.cells[4]).split("RANKS_ALIVE ", 1)[1].splitlines()[0])
    assert alive == []
    after = json.loads(_stream_text(nb.cells[5]).split("AFTER ", 1)[1].splitlines()[0])
    assert after == [[0, 2, 3.0], [1, 2, 3.0]]
    assert not ev["errors"], ev["errors"]  # only the tagged cells failed
    assert _error(nb.cells[5]) is None


def test_a_finished_bar_is_saved_as_it_ended_not_as_it_started(tmp_path):
    """In a real kernel (nbclient, as make notebooks runs one), each rank's widget bar is saved with the text
    a viewer without widgets shows (GitHub, nbconvert's HTML): the bar as it ended (30/30, 100%), not the
    0/30 it was displayed with; the widget stays the output's live view."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent("""
        from stnb.launchers.bars import StepBars
        from stnb.processes.channel import RankState

        bars = StepBars("ddp")
        bars.update([RankState(r, "running", 0, 30, None, 0.0) for r in (0, 1)])
        bars.update([RankState(r, "done", 30, 30, 0.25, 0.0) for r in (0, 1)])
        bars.close()
        """))]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = [o for o in nb.cells[0].outputs if o.output_type == "display_data"]
    assert len(shown) == 2 and all("application/vnd.jupyter.widget-view+json" in o.data for o in shown), shown
    texts = [o.data["text/plain"] for o in shown]
    assert all(re.match(rf"ddp rank {r}: 100%\|\S+\| 30/30 ", t) for r, t in enumerate(texts)), texts
    assert [o.text for o in nb.cells[0].outputs if o.output_type == "stream"][-1].startswith("ddp: 30/30 steps")
