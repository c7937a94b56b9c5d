"""The watchdog: a thread in the launching process that watches the ranks while they run.

Every 20 ms it looks for ranks that ended without a result or an error record (torch elastic never
reports a rank that exits with code 0, and its peers would wait forever); every 100 ms it relays the
ranks' output, calls ``on_progress`` and enforces the limits: ``timeout``, ranks that never start, and
the stall detector (no running rank's stack moved and no heartbeat for ``stall_timeout`` s; a rank still
joining the process group gets at least ``MIN_START_S``). To stop a launch it dumps every rank's stack
(faulthandler, SIGUSR1), kills the ranks and records why (``reason``, ``stalled``, ``stacks``).
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time
import traceback

from .channel import RUNNING, SETTING_UP, Channel
from .output import OutputRelay
from .supervise import children_now, kill_new_children, kill_tree, process_ended

#: seconds a silently ended rank may take to be noticed by torch elastic before the launch is stopped
EXIT_GRACE_S = 2.0
#: ranks get at least this long to start after the fork (a stall limit shorter than that is not used)
MIN_START_S = 60.0
#: seconds the ranks get to write their stacks when asked (a loaded machine schedules them late)
STACK_WAIT_S = 3.0


class Watchdog(threading.Thread):
    """A context manager: starts on enter; on exit stops, relays the last output, calls ``on_progress`` once more."""

    def __init__(self, ch: Channel, nproc: int, timeout, stall_timeout, on_progress, echo: bool,
                 rank_offset: int = 0):
        super().__init__(name="stnb-watchdog", daemon=True)
        self.ch, self.nproc = ch, nproc
        self.timeout, self.stall_timeout = timeout, stall_timeout
        self.on_progress = on_progress
        # output is prefixed with global ranks: rank_offset is this node's first (node_rank * nproc)
        self.relay = OutputRelay(lambda r: ch.path("log", r), nproc, rank_offset, echo)
        self.start_time = time.time()
        self.stop_event = threading.Event()
        self.reason: str | None = None  # 'timeout' | 'not started' | 'stalled' | 'exited'
        self.stalled: list = []
        self.setting_up: list = []  # of the stalled ranks, those still setting up (joining the process group)
        self.setup_limit: float | None = None  # the seconds those were given (max(stall_timeout, MIN_START_S))
        self.stacks: dict = {}
        self._checked_in = False
        self._last_progress_call = 0.0
        # ranks whose process ended while the launch ran: {local_rank: (time seen, exit code or None)}
        self.ended: dict = {}
        self.returned_at: float | None = None  # set when the launcher call returned
        self._children_before = children_now()  # this process's children before any rank was created

    @property
    def logs(self) -> dict:
        return self.relay.logs

    def __enter__(self) -> "Watchdog":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def launcher_returned(self) -> None:
        self.returned_at = time.time()

    # stopping -----------------------------------------------------------------------------
    def dump_stacks(self) -> dict:
        pids = self.ch.pids()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        # each rank's faulthandler writes its stack from the signal handler; on a busy machine that can take
        # more than a moment, so wait (up to STACK_WAIT_S) until every signalled rank's stack is there
        deadline = time.time() + STACK_WAIT_S
        while time.time() < deadline and not all(self.ch.read_stack(r) for r in pids):
            time.sleep(0.1)
        time.sleep(0.1)  # a stack being written as it was read: its end
        return {r: self.ch.read_stack(r) for r in pids}

    def kill_ranks(self) -> None:
        """Every rank's process tree; while a rank has not checked in (no pid yet), every process started since
        the launch began, or the launch would wait for that rank forever."""
        pids = self.ch.pids()
        kill_tree(list(pids.values()))
        if len(pids) < self.nproc:
            kill_new_children(self._children_before, reap=False)

    def _halt(self, reason: str, stalled=()) -> None:
        self.reason = reason
        self.stalled = list(stalled)
        self.stacks = self.dump_stacks() if reason != "exited" else {}
        self.kill_ranks()

    # watching -----------------------------------------------------------------------------
    def run(self) -> None:
        n = 0
        while not self.stop_event.wait(0.02):
            try:
                # ended ranks are looked for every 20 ms: torchelastic reaps a dead rank within its
                # 0.1 s monitor interval, and only a rank seen dead can be blamed for what follows
                self._track_ended(time.time())
                n += 1
                if not self.reason and n % 5 == 0:
                    self._tick()
            except Exception:  # never let the watchdog die silently
                traceback.print_exc()
            if self.reason:
                return

    def _track_ended(self, now: float) -> None:
        """Note ranks whose process has ended; stop the launch EXIT_GRACE_S after one ended with neither result
        nor error record (os._exit(0), a C library calling exit(): elastic never reports those)."""
        if self.returned_at is not None:
            return
        for r, pid in self.ch.pids().items():
            if r not in self.ended:
                ended, code = process_ended(pid)
                if ended:
                    self.ended[r] = (now, code)
        silent = [r for r, (t, _) in self.ended.items() if now - t > EXIT_GRACE_S and self.ch.is_silent(r)]
        if silent:
            self._halt("exited", stalled=sorted(silent))

    def _tick(self) -> None:
        now = time.time()
        if not self._checked_in:
            # print nothing until every rank has started: a write in the parent while a
            # fork happens could leave a lock held in the child.
            self._checked_in = all(self.ch.started(r) for r in range(self.nproc))
        if self._checked_in:
            self.relay.relay()
            if self.on_progress is not None and now - self._last_progress_call >= 0.5:
                self._last_progress_call = now
                self._report_progress()
        if self.timeout is not None and now - self.start_time > self.timeout:
            self._halt("timeout")
        elif self.stall_timeout is not None and not self._checked_in:
            if now - self.start_time > max(self.stall_timeout, MIN_START_S):
                self._halt("not started", stalled=[r for r in range(self.nproc) if not self.ch.started(r)])
        elif self.stall_timeout is not None:
            # a rank setting up (the CUDA context, the process group, NCCL's first communicator) gets at
            # least MIN_START_S like a rank starting; a running rank the stall limit
            setup_limit = max(self.stall_timeout, MIN_START_S)
            states = {r: self.ch.state(r) for r in range(self.nproc)}
            limits = {r: self.stall_timeout if s == RUNNING else setup_limit
                      for r, s in states.items() if s in (RUNNING, SETTING_UP)}
            if limits and all(now - self.ch.last_progress(r) > limit for r, limit in limits.items()):
                self.setting_up = sorted(r for r in limits if states[r] == SETTING_UP)
                self.setup_limit = setup_limit
                self._halt("stalled", stalled=sorted(limits))

    def _report_progress(self) -> None:
        try:
            self.on_progress(self.ch.states())
        except KeyboardInterrupt:
            # raised by the callback itself (a display's own Stop): in this thread it would end the watchdog and
            # leave the ranks training unwatched; it stops the launch as the Stop button does, in the main thread
            if threading.current_thread() is threading.main_thread():
                raise
            self.on_progress = None
            _thread.interrupt_main(signal.SIGINT)
        except Exception:
            traceback.print_exc()

    def finish(self) -> None:
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        if self._checked_in or self.relay.any_output():
            self.relay.relay(final=True)
        if self.on_progress is not None:
            self._report_progress()
