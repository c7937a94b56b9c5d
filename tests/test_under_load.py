"""``make test-under-load`` (tests/under_load.py): the command runs while the busy processes run, its exit status
is the script's, and no busy process outlives it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_command_runs_beside_the_busy_processes_and_none_outlives_it():
    """(Only the busy processes this call started are counted: the suite itself may run under make test-under-load.)"""
    count = ("import psutil, sys; from under_load import BUSY; "
             "n = sum(p.cmdline()[-1:] == [BUSY] for p in psutil.Process().parent().children()); "
             "print('busy', n); sys.exit(7)")
    out = subprocess.run([sys.executable, os.path.join(HERE, "under_load.py"), "--procs", "2", "--", sys.executable,
                          "-c", count], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert out.returncode == 7, out.stderr
    assert "busy 2" in out.stdout and "the command exited 7 after" in out.stdout, out.stdout
    pids = [int(p) for p in re.search(r"pids ([\d, ]+)\)", out.stdout).group(1).split(", ")]
    assert len(pids) == 2 and not [p for p in pids if psutil.pid_exists(p)]


def test_without_a_command_it_says_what_to_give():
    out = subprocess.run([sys.executable, os.path.join(HERE, "under_load.py")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "give the command to run after --, e.g. -- make test" in out.stderr


def test_stopped_by_sigterm_it_stops_the_command_and_every_busy_process():
    """``timeout 300 python tests/under_load.py -- ...`` once left its two loops spinning after the timeout."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "under_load.py"), "--procs", "2", "--", sys.executable,
                             "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True, cwd=HERE)
    first = proc.stdout.readline()
    pids = [int(p) for p in re.search(r"pids ([\d, ]+)\)", first).group(1).split(", ")]
    command = [c for c in psutil.Process(proc.pid).children() if c.pid not in pids]
    assert len(pids) == 2 and len(command) == 1, (first, command)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert "the command exited 143" in proc.stdout.read()
    time.sleep(0.5)
    assert not [p for p in pids + [command[0].pid] if psutil.pid_exists(p)]
