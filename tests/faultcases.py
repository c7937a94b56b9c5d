"""The fault matrix: provoke each failure, measure time-to-error and orphans, check recovery.

Used by tests/test_faults.py (asserts) and tests/fault_matrix.py (prints the table).
Every case returns an ``Outcome``:

* ``error``: the exception stnb raised (None if it raised nothing);
* ``time_to_error_s``: seconds from the fault (the moment a rank wrote its mark file just
  before faulting, the moment SIGINT was sent, or the call for refusals) to the exception;
  for the stall and timeout cases the limit itself is subtracted (``after_limit``);
* ``orphans``: descendants of this process that appeared during the case and are still
  there afterwards (zombies included);
* ``rank_pids`` / ``rank_pids_alive``: every process the ranks recorded while they ran (the ranks
  themselves and any process a rank started), and those still alive after the error. This set is
  written before anything is killed, so a process re-parented away from this one still counts;
* ``children_seen``: whether any new child process existed at any point during the call
  (sampled every 20 ms) - refusals must start none;
* ``next_ok``: a healthy 2-rank launch right afterwards, in the same process, works.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import rankfns  # noqa: E402

import stnb  # noqa: E402
from stnb.errors import ConfigError, LaunchError, ResultsFileError  # noqa: E402

# every launch here runs gloo ranks on CPU cores, also on a machine with GPUs
cpu_launch = functools.partial(stnb.launch, device="cpu")

STALL_LIMIT = 3.0
TIMEOUT_LIMIT = 4.0


@dataclass
class Outcome:
    case: str
    error: BaseException | None = None
    time_to_error_s: float | None = None
    after_limit: float = 0.0
    orphans: list = field(default_factory=list)
    rank_pids: list = field(default_factory=list)
    rank_pids_alive: list = field(default_factory=list)
    children_seen: bool = False
    next_ok: bool | None = None
    next_error: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return getattr(self.error, "kind", type(self.error).__name__ if self.error else "-")

    def row(self) -> dict:
        return {"case": self.case,
                "error": f"{type(self.error).__name__}({self.kind})" if self.error else "none",
                "time_to_error_s": self.time_to_error_s,
                "orphans": len(self.orphans) + len(self.rank_pids_alive),
                "children_started": self.children_seen,
                "next_launch_ok": self.next_ok}


# ---- process bookkeeping --------------------------------------------------------------------

def descendants() -> dict:
    """{pid: status} of every descendant of this process."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            out[p.pid] = p.status()
        except psutil.NoSuchProcess:
            pass
    return out


def new_descendants(before, settle: float = 0.0) -> list:
    """Descendants not in ``before`` (optionally waiting up to ``settle`` s for them to go)."""
    end = time.time() + settle
    while True:
        extra = [f"{pid}:{st}" for pid, st in descendants().items() if pid not in before]
        if not extra or time.time() >= end:
            return extra
        time.sleep(0.05)


class ChildSampler(threading.Thread):
    """Notices any new descendant of this process while it runs."""

    def __init__(self, before):
        super().__init__(daemon=True)
        self.before = set(before)
        self.seen = set()
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                self.seen |= set(descendants()) - self.before
            except Exception:
                pass
            time.sleep(0.02)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join(2)
        return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_mark(path) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def healthy_launch() -> tuple[bool, str]:
    """The recovery check: a normal 2-rank launch returns every rank's correct answer."""
    try:
        res = cpu_launch(rankfns.info, "after", num_processes=2, echo=False)
    except BaseException as e:  # noqa: BLE001 - reported, not hidden
        return False, f"{type(e).__name__}: {e}"
    ok = ([r["rank"] for r in res] == [0, 1] and all(r["world_size"] == 2 for r in res)
          and all(r["all_reduce"] == 3.0 for r in res))
    return ok, "" if ok else f"unexpected results {res}"


def measure(case: str, call, mark: str | None = None, after_limit: float = 0.0,
            check_next: bool = True, sample_children: bool = False, pid_mark: str | None = None) -> Outcome:
    """Run ``call()`` expecting an exception; measure it."""
    out = Outcome(case=case, after_limit=after_limit)
    before = descendants()
    t_call = time.time()
    sampler = ChildSampler(before) if sample_children else None
    if sampler:
        sampler.start()
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is one of the cases
        out.error = e
    t_err = time.time()
    if sampler:
        sampler.stop.set()
        sampler.join(2)
        out.children_seen = bool(sampler.seen)
    fault = read_mark(mark) if mark else None
    t0 = fault if fault is not None else t_call
    if out.error is not None:
        out.time_to_error_s = round(t_err - t0 - after_limit, 2)
    # stnb must have cleaned up before returning: no grace period here
    out.orphans = new_descendants(before)
    if mark or pid_mark:
        out.rank_pids = rankfns.rank_pids(pid_mark or mark)
        out.rank_pids_alive = [p for p in out.rank_pids if _alive(p)]
    if check_next:
        out.next_ok, out.next_error = healthy_launch()
    return out


def _mark_path(tmp: str, name: str) -> str:
    return os.path.join(tmp, f"{name}.mark")


# ---- the cases ------------------------------------------------------------------------------

def case_raise(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "raise")
    return measure("1. a rank raises", lambda: cpu_launch(rankfns.raise_on, 1, mark, num_processes=2,
                                                          echo=False), mark=mark)


def case_sigkill(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "sigkill")
    return measure("2. a rank is SIGKILLed", lambda: cpu_launch(rankfns.sigkill_on, 1, mark, num_processes=2,
                                                                 echo=False), mark=mark)


def case_sigkill_in_collective(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "sigkill2")
    return measure("2b. a rank is SIGKILLed while rank 0 waits in all_reduce",
                   lambda: cpu_launch(rankfns.sigkill_in_collective, 1, mark, num_processes=2, echo=False),
                   mark=mark)


def case_sigkill_with_children(tmp: str) -> Outcome:
    """The killed rank had started a child and a double-forked daemon: both are re-parented when it
    dies, away from this process's descendants; their pids were recorded before anything was killed."""
    mark = _mark_path(tmp, "children")
    return measure("2c. a rank that started a child and a daemon is SIGKILLed",
                   lambda: cpu_launch(rankfns.children_then_sigkill, 1, mark, num_processes=2, echo=False),
                   mark=mark)


def case_stall(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "stall")
    return measure(f"3. a rank hangs in a collective (stall_timeout={STALL_LIMIT:g})",
                   lambda: cpu_launch(rankfns.hang_in_collective, mark, num_processes=2, echo=False,
                                       stall_timeout=STALL_LIMIT),
                   mark=mark, after_limit=STALL_LIMIT)


def case_stall_single(tmp: str) -> Outcome:
    """One rank (stnb forks it itself, not torchelastic) that blocks in one C call."""
    mark = _mark_path(tmp, "stall1")
    return measure(f"3b. a 1-rank launch stalls (stall_timeout={STALL_LIMIT:g})",
                   lambda: cpu_launch(rankfns.hang_forever, mark, num_processes=1, echo=False,
                                       stall_timeout=STALL_LIMIT),
                   mark=mark, after_limit=STALL_LIMIT)


def case_keyboard_interrupt(tmp: str) -> Outcome:
    """SIGINT to this very process while stnb.launch blocks (what Jupyter's interrupt does)."""
    mark = _mark_path(tmp, "sigint")
    ready = _mark_path(tmp, "sigint-ready")
    sent = {}
    done = threading.Event()

    def interrupter():
        end = time.time() + 60
        # wait until both ranks run, so the signal lands inside the launch
        while not done.is_set() and time.time() < end:
            if read_mark(ready) is not None:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        if not done.is_set():
            with open(mark, "w") as f:
                f.write(repr(time.time()))
            sent["t"] = time.time()
            os.kill(os.getpid(), signal.SIGINT)

    def call():
        th = threading.Thread(target=interrupter, daemon=True)
        th.start()
        try:
            cpu_launch(rankfns.sleep_silent, 120.0, ready, num_processes=2, echo=False, stall_timeout=None)
        finally:
            done.set()

    out = measure("4. KeyboardInterrupt during the launch", call, mark=mark, pid_mark=ready)
    out.extra["signal_sent"] = "t" in sent
    return out


def case_port_busy(tmp: str) -> Outcome:
    """29500 is taken by someone else; stnb picks a free port and the launch succeeds."""
    out = Outcome(case="5. port 29500 busy")
    before = descendants()
    with busy_port(29500) as bound:
        out.extra["port_busy"] = port_busy(29500)  # ours or someone else's: a launch on 29500 would fail
        t = time.time()
        try:
            res = cpu_launch(rankfns.info, num_processes=2, echo=False)
            out.extra["results"] = res
            out.note = f"succeeded on port {res[0]['master_port']} (29500 bound: {bound})"
        except BaseException as e:  # noqa: BLE001
            out.error = e
            out.time_to_error_s = round(time.time() - t, 2)
    out.orphans = new_descendants(before)
    out.next_ok, out.next_error = healthy_launch()
    return out


def case_cuda_initialised(tmp: str) -> Outcome:
    """CUDA already initialised in the parent: pretended (no GPU here) by patching
    torch.cuda.is_initialized, the only thing stnb.launch's check looks at."""
    import torch

    real = torch.cuda.is_initialized
    torch.cuda.is_initialized = lambda: True
    try:
        out = measure("6. CUDA already initialised in the parent",
                      lambda: cpu_launch(rankfns.info, num_processes=2, echo=False),
                      check_next=False, sample_children=True)
    finally:
        torch.cuda.is_initialized = real
    out.next_ok, out.next_error = healthy_launch()
    return out


def case_exit_without_return(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "exit")
    return measure("7. a rank exits without returning (os._exit(0))",
                   lambda: cpu_launch(rankfns.exit_without_return, 1, mark, num_processes=2, echo=False),
                   mark=mark)


def case_exit_then_collective(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "exit2")
    return measure("7b. a rank os._exit(0)s while rank 0 waits in a barrier",
                   lambda: cpu_launch(rankfns.exit_then_collective, 1, mark, num_processes=2, echo=False,
                                       stall_timeout=STALL_LIMIT),
                   mark=mark)


def case_sys_exit(tmp: str) -> Outcome:
    mark = _mark_path(tmp, "sysexit")
    return measure("7c. a rank calls sys.exit(0)",
                   lambda: cpu_launch(rankfns.sys_exit_on, 1, 0, mark, num_processes=2, echo=False),
                   mark=mark)


def case_missing_model(tmp: str) -> Outcome:
    return measure("8. missing model path",
                   lambda: stnb.run(stnb.TrainConfig(model="/nonexistent/model", device="cpu"), echo=False),
                   check_next=True, sample_children=True)


def case_results_not_writable(tmp: str) -> Outcome:
    blocker = os.path.join(tmp, "a-regular-file")
    with open(blocker, "w") as f:
        f.write("not a folder\n")
    target = os.path.join(blocker, "sub", "results.jsonl")
    out = measure("9. results file not writable",
                  lambda: stnb.run(stnb.TrainConfig(model="tiny", device="cpu", steps=3), results_file=target,
                                   echo=False),
                  check_next=True, sample_children=True)
    out.extra["target"] = target
    return out


def case_two_launches(tmp: str) -> Outcome:
    """A second launch from a thread while the first runs: refused at once; the first is fine."""
    out = Outcome(case="10. two launches at once")
    before = descendants()
    ready = _mark_path(tmp, "busy-ready")
    box = {}

    def second():
        end = time.time() + 60
        while read_mark(ready) is None and time.time() < end:
            time.sleep(0.05)
        t = time.time()
        try:
            box["result"] = cpu_launch(rankfns.info, num_processes=2, echo=False)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
        box["dt"] = time.time() - t
        box["children_during"] = len(descendants())

    th = threading.Thread(target=second, daemon=True)
    th.start()
    first = cpu_launch(rankfns.sleep_silent_then_rank, 3.0, ready, num_processes=2, echo=False)
    th.join(30)
    out.error = box.get("error")
    out.time_to_error_s = round(box["dt"], 2) if "dt" in box else None
    out.extra.update(first=first, second_result=box.get("result"))
    out.note = f"first launch returned {first}"
    out.orphans = new_descendants(before)
    out.next_ok, out.next_error = healthy_launch()
    return out


def case_timeout(tmp: str, limit: float = TIMEOUT_LIMIT) -> Outcome:
    mark = _mark_path(tmp, "timeout")
    return measure(f"11. overall timeout={limit:g} s",
                   lambda: cpu_launch(rankfns.sleep_silent, 120.0, mark, num_processes=2, echo=False, timeout=limit),
                   after_limit=limit, pid_mark=mark)


CASES = [case_raise, case_sigkill, case_sigkill_in_collective, case_sigkill_with_children, case_stall, case_stall_single, case_keyboard_interrupt,
         case_port_busy, case_cuda_initialised, case_exit_without_return, case_exit_then_collective,
         case_sys_exit, case_missing_model, case_results_not_writable, case_two_launches, case_timeout]


def port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class busy_port:
    """Bind and listen on 127.0.0.1:port for the duration (True when we got it)."""

    def __init__(self, port: int):
        self.port = port

    def __enter__(self) -> bool:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind(("127.0.0.1", self.port))
            self.sock.listen(1)
            return True
        except OSError:  # someone else already holds it: just as busy
            return False

    def __exit__(self, *exc):
        self.sock.close()
        return False


def run_all(cases=None) -> list:
    with tempfile.TemporaryDirectory(prefix="stnb-faults-") as tmp:
        return [case(tmp) for case in (cases or CASES)]
