"""Failure diagnosis: why a launch did not return every rank's result, and which rank to blame.

``diagnose`` gathers the evidence once (the watchdog's findings, the ranks' error records and
output, the launcher's exit codes) and asks one function per failure kind, in order; the first
that recognises the launch gives the exception ``launch`` raises. Each names the rank that really
failed, not the ranks that failed because of it (``peerfail`` tells those apart), and carries that
rank's traceback, its stack or its last output.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass

from ..errors import LaunchError, failure_kind
from .channel import Channel
from .peerfail import is_secondary, origin
from .start import Outcome
from .watchdog import MIN_START_S, Watchdog

#: error types a rank records when it was stopped rather than failed by itself
COLLATERAL = ("KeyboardInterrupt", "SystemExit", "SignalException")
OOM_HINT = " (from outside, or by the out-of-memory killer: try a smaller batch size)"


@dataclass
class Evidence:
    ch: Channel
    watchdog: Watchdog
    outcome: Outcome
    nproc: int
    base: int  # global rank of this node's local rank 0
    logs: dict
    errors: list  # every error record a rank wrote
    real: list  # ... less the collateral ones
    first: dict | None  # the origin among the real ones
    start_method: str = "fork"

    def last_output(self, r: int, lines: int = 20) -> str:
        return "\n".join(self.logs.get(r, "").splitlines()[-lines:])

    def unstarted(self) -> list:
        """The local ranks that had not checked in when the watchdog stopped the launch (no stack to ask for)."""
        return [r for r in range(self.nproc) if r not in self.watchdog.stacks and not self.ch.started(r)]

    def stacks(self) -> str:
        """The stack of every rank the watchdog asked when it stopped the launch, and a line for each rank that had
        not started then."""
        found = {**self.watchdog.stacks, **dict.fromkeys(self.unstarted())}
        return "\n".join(f"--- stack of rank {self.base + r} ---\n"
                         + ("(had not started: the process was still being created, no stack to ask for)" if s is None
                            else s.strip() or "(no stack captured)") for r, s in sorted(found.items()))

    def error(self, message: str, **kw) -> LaunchError:
        return LaunchError(message, logs=self.logs, **kw)

    def output_of(self, r: int) -> str:
        """Local rank ``r``'s last output under a header ("" when it printed nothing)."""
        tail = self.last_output(r)
        return f"--- last output of rank {self.base + r} ---\n{tail}" if tail else ""


def _traceback(record: dict) -> str:
    return f"--- traceback of rank {record['rank']} ---\n{record['traceback']}"


def _listed(ranks) -> str:
    return ", ".join(map(str, ranks))


def diagnose(ch: Channel, watchdog: Watchdog, outcome: Outcome, nproc: int, node_rank: int,
             start_method: str = "fork") -> BaseException | None:
    """The exception that explains how the launch ended, or None when every rank returned."""
    errors = [e for e in (ch.read_error(r) for r in range(nproc)) if e is not None]
    real = [e for e in errors if e["type"] not in COLLATERAL]
    ev = Evidence(ch, watchdog, outcome, nproc, node_rank * nproc, dict(watchdog.logs), errors, real,
                  origin(real),  # the earliest error that is not a consequence of another rank's failure
                  start_method)
    for kind in (interrupted, timed_out, not_started, spawned_rank_never_ran, raised_then_peers_stalled,
                 stalled, ended_silently,
                 never_joined, raised, called_sys_exit, exited_with_code, stopped_only, launcher_failed):
        err = kind(ev)
        if err is not None:
            return err
    return None


def interrupted(ev: Evidence):
    if ev.outcome.interrupted:
        return KeyboardInterrupt("stnb.launch interrupted; all ranks were stopped")


def timed_out(ev: Evidence):
    wd = ev.watchdog
    if wd.reason == "timeout":
        late = [ev.base + r for r in ev.unstarted()]
        why = (f" Rank(s) {_listed(late)} had not even started: creating the processes took longer than "
               "the timeout (a busy machine, a slow import)." if late else "")
        return ev.error(f"launch timed out after {wd.timeout:g} s; all {ev.nproc} ranks were stopped.{why} "
                        "Raise timeout=... or make the run shorter.", ranks=[ev.base + r for r in range(ev.nproc)],
                        kind="timeout", rank_traceback=ev.stacks())


def not_started(ev: Evidence):
    wd = ev.watchdog
    if wd.reason == "not started":
        ranks = [ev.base + r for r in wd.stalled]
        why = ("This usually means the process forked while another thread held a lock; run the launch again, "
               "and report it if it repeats." if ev.start_method == "fork" else
               "Spawned ranks import torch and the training stack themselves, which a busy machine slows down; "
               "raise stall_timeout=..., or run the launch again.")
        return ev.error(
            f"rank(s) {_listed(ranks)} did not start within {max(wd.stall_timeout, MIN_START_S):g} s "
            f"after the launch began ({ev.start_method}); all ranks were stopped. {why}",
            ranks=ranks, kind="stalled", rank_traceback=ev.stacks())


def spawned_rank_never_ran(ev: Evidence):
    """spawn: a rank's new interpreter failed before stnb's code ran in it. Most often a script
    without the ``if __name__ == "__main__":`` guard: the rank imports the script first, and a
    launch at its top level starts again there (multiprocessing refuses, on the rank's stderr)."""
    if ev.start_method != "spawn":
        return None
    dead = {r: c for r, c in _bad_exit_codes(ev).items() if c > 0 and not ev.ch.started(r)}
    if not dead:
        return None
    r, code = min(dead.items())
    return ev.error(
        f"rank {ev.base + r} exited (exit code {code}) while its new Python process was starting, before stnb's "
        "code ran in it (start_method='spawn'); the other ranks were stopped. A spawned rank first imports the "
        "script that launched it: in a script, call stnb.launch / stnb.run under "
        "`if __name__ == \"__main__\":`. The rank's own error is on this process's stderr.",
        rank=ev.base + r, ranks=[ev.base + x for x in sorted(dead)], kind="exited")


def raised_then_peers_stalled(ev: Evidence):
    """The rank that raised never exited (e.g. blocked tearing NCCL down), so its peers waited for it."""
    wd, first = ev.watchdog, ev.first
    if wd.reason == "stalled" and first is not None and not is_secondary(first):
        stalled = [ev.base + r for r in wd.stalled]
        return ev.error(
            f"rank {first['rank']} raised {first['type']}: {first['message']} (rank(s) {_listed(stalled)} "
            f"then waited for it with no progress for {wd.stall_timeout:g} s and all ranks were stopped)",
            rank=first["rank"], ranks=sorted({first["rank"], *stalled}), kind=failure_kind(first["type"]),
            rank_traceback=_traceback(first) + "\n" + ev.stacks())


def stalled(ev: Evidence):
    wd = ev.watchdog
    if wd.reason == "stalled":
        ranks = [ev.base + r for r in wd.stalled]
        if wd.setting_up:
            message = (f"rank(s) {_listed(ev.base + r for r in wd.setting_up)} stalled while setting up "
                       f"(joining the process group; on GPUs starting CUDA and NCCL's communicator): no progress for "
                       f"{wd.setup_limit:g} s. All ranks were stopped; each rank's stack follows. A peer that never "
                       "joined, an unreachable MASTER_ADDR or a blocked port are the usual causes.")
        else:
            message = (f"rank(s) {_listed(ranks)} stalled: no progress for {wd.stall_timeout:g} s "
                       "(e.g. waiting in a collective another rank never entered). All ranks were stopped; each "
                       "rank's stack at the time of the stall follows. Raise stall_timeout=... (or None) if the work "
                       "is legitimately long, or call stnb.heartbeat() in long loops.")
        return ev.error(message, rank=ranks[0] if len(ranks) == 1 else None, ranks=ranks, kind="stalled",
                        rank_traceback=ev.stacks())


def _silent_ranks(ev: Evidence) -> dict:
    """{local rank: exit code or None} of the ranks that ended without a result or an error record
    (SIGKILL, os._exit) and are the cause of what the others then reported ("Connection closed by
    peer", SignalException)."""
    wd, ch, first, codes = ev.watchdog, ev.ch, ev.first, ev.outcome.exit_codes
    returned = wd.returned_at or time.time()
    ended = _ended(ev)
    stopped = _stopped_peers(ended, first, ev.nproc)
    silent = {r: code for r, (t, code) in ended.items()
              if t <= returned and (first is None or t <= first["time"] + 1.0) and ch.is_silent(r)
              and r not in stopped}
    for r, code in codes.items():
        # (a rank killed by a signal after another rank's own error is a consequence: NCCL's watchdog
        # aborts the process of a peer left waiting)
        if code not in (0, None) and ch.is_silent(r) and r not in stopped and (r in silent or first is None
                                                          or (code < 0 and is_secondary(first))):
            silent[r] = code if silent.get(r) is None else silent[r]
    if first is not None and not silent and is_secondary(first):
        # the rank that raised says its peer went away; the peer that left no trace is the cause
        silent = {r: codes.get(r) for r in range(ev.nproc) if ch.is_silent(r) and ch.started(r)
                  and r not in stopped}
    return silent


def _ended(ev: Evidence) -> dict:
    """The watchdog's {local rank: (time seen ended, exit code)}, with an exit code it could not read taken
    from the launcher's record of the failure. A busy machine can delay the watchdog's poll past torch
    elastic's handling: elastic reaps the failed rank (its code is gone from /proc) and SIGTERMs the
    others, and the watchdog then sees them all end in the same poll; only elastic still knows that the
    first one was SIGKILLed (tests/test_faults.py::test_2_rank_sigkilled_seen_late_still_names_it)."""
    codes = ev.outcome.exit_codes
    return {r: (t, code if code is not None else codes.get(r)) for r, (t, code) in ev.watchdog.ended.items()}


def _stopped_peers(ended: dict, first: dict | None, nproc: int) -> set:
    """Local ranks torch elastic stopped: ended by SIGTERM (or with no exit code read) once the failing
    rank had ended (the rank that recorded ``first``, else the first rank to end), or not seen to end
    at all before the launcher returned (still running when the failing rank ended). A rank's SIGTERM
    is the default action (``rank.rank_main``), so it leaves no record; such a rank is not a cause."""
    stopping = (None, -signal.SIGTERM)
    if first is not None:
        failed = first.get("local_rank")
    else:  # the first to end; on a tie, the one not ended by SIGTERM
        failed = min(ended, key=lambda r: (ended[r][0], ended[r][1] in stopping), default=None)
    if failed not in ended:
        return set()
    t0 = ended[failed][0]
    unseen = {r for r in range(nproc) if r not in ended}
    return unseen | {r for r, (t, code) in ended.items() if r != failed and code in stopping and t >= t0}


def ended_silently(ev: Evidence):
    """A rank ended without a result or an exception: killed by a signal, or exited."""
    wd, first = ev.watchdog, ev.first
    silent = _silent_ranks(ev)
    if not (wd.reason == "exited" or silent):
        return None
    # the watchdog stopped the launch for the ranks it saw end silently; the others it killed itself
    cause = wd.stalled if wd.reason == "exited" else (silent or wd.stalled)
    r = min(cause, key=lambda x: (silent.get(x) is None, x))
    code = silent.get(r, ev.outcome.exit_codes.get(r))
    if code is None and r in silent:
        why = ("ended without returning a result or raising an exception (killed from outside, e.g. "
               "SIGKILL or the out-of-memory killer - try a smaller batch size - or os._exit())")
        kind = "killed"
    elif code is None or code >= 0:
        why = (f"exited (exit code {code if code is not None else 'unknown'}) without returning a result "
               "or raising an exception (did the function call os._exit()/sys.exit(), or did a library "
               "end the process?)")
        kind = "exited"
    else:
        why, kind = _killed_by(-code), "killed"
    also = ""
    if first is not None:
        also = f" Rank {first['rank']} then raised {first['type']}: {_first_line(first)} (a consequence)."
    tb = ev.output_of(r)
    if first is not None:
        tb += "\n" + _traceback(first)
    ranks = sorted({ev.base + x for x in silent} | {ev.base + x for x in wd.stalled})
    return ev.error(f"rank {ev.base + r} {why}; the other ranks were stopped.{also}", rank=ev.base + r,
                    ranks=ranks, kind=kind, rank_traceback=tb.strip())


def never_joined(ev: Evidence):
    """A peer gave up waiting in a collective (gloo / NCCL) for ranks that never joined it."""
    first, base = ev.first, ev.base
    if not (ev.real and is_secondary(first)):
        return None
    failed = {e["local_rank"] for e in ev.real}
    absent = [r for r in range(ev.nproc) if r not in failed and not ev.ch.has_result(r)]
    if not absent:
        return None
    tails = "\n".join(f"--- last output of rank {base + r} ---\n{ev.last_output(r)}" for r in absent)
    names = _listed(base + r for r in absent)
    return ev.error(
        f"rank(s) {names} never joined the collective rank {first['rank']} waited in: rank {first['rank']} "
        f"raised {first['type']}: {_first_line(first)} (a consequence). Rank(s) {names} were busy elsewhere "
        "or hung and were stopped; their last output follows.", rank=base + absent[0] if len(absent) == 1 else None,
        ranks=sorted({base + r for r in absent} | {first["rank"]}), kind="stalled",
        rank_traceback=f"{tails}\n{_traceback(first)}")


def raised(ev: Evidence):
    """A rank raised an exception (the origin is named; the others are listed)."""
    first = ev.first
    if ev.real:
        others = sorted({e["rank"] for e in ev.real} - {first["rank"]})
        also = f" (rank(s) {_listed(others)} failed too)" if others else ""
        return ev.error(f"rank {first['rank']} raised {first['type']}: {first['message']}{also}",
                        rank=first["rank"], ranks=sorted({e["rank"] for e in ev.real}),
                        kind=failure_kind(first["type"]),
                        rank_traceback=_traceback(first))


def _bad_exit_codes(ev: Evidence) -> dict:
    return {r: c for r, c in ev.outcome.exit_codes.items() if c not in (0, None)}


def called_sys_exit(ev: Evidence):
    """sys.exit() in a rank: it raised SystemExit instead of returning."""
    failed, bad = ev.outcome.failure is not None, _bad_exit_codes(ev)
    exits = [e for e in ev.errors if e["type"] == "SystemExit" and (not failed or e["local_rank"] in bad)]
    if exits:
        e = min(exits, key=lambda x: x["time"])
        return ev.error(f"rank {e['rank']} raised SystemExit: {e['message']} (sys.exit() ends a rank without a "
                        "result; return a value from the function instead)", rank=e["rank"],
                        ranks=sorted({x["rank"] for x in exits}), kind="exited",
                        rank_traceback=_traceback(e))


def exited_with_code(ev: Evidence):
    """The launcher reports a rank that exited non-zero or was killed, and nothing explains it better."""
    bad = _bad_exit_codes(ev)
    if ev.outcome.failure is None or not bad:
        return None
    r, code = min(bad.items())
    why = _killed_by(-code) if code < 0 else f"exited with code {code} without raising a Python exception"
    return ev.error(f"rank {ev.base + r} {why}; the other ranks were stopped.", rank=ev.base + r,
                    ranks=[ev.base + x for x in sorted(bad)], kind="killed" if code < 0 else "exited",
                    rank_traceback=ev.output_of(r))


def stopped_only(ev: Evidence):
    """Only KeyboardInterrupt / SystemExit / SignalException were recorded."""
    if ev.outcome.failure is not None and ev.errors:
        e = min(ev.errors, key=lambda x: x["time"])
        return ev.error(f"rank {e['rank']} raised {e['type']}: {e['message']}", rank=e["rank"],
                        ranks=sorted({x["rank"] for x in ev.errors}), kind="raised",
                        rank_traceback=_traceback(e))


def launcher_failed(ev: Evidence):
    """The launcher itself failed before any rank reported anything."""
    failure = ev.outcome.failure
    if failure is not None:
        msg = "".join(traceback.format_exception_only(type(failure), failure)).strip()
        return ev.error(f"the launch failed before any rank reported an error: {msg}", kind="exited",
                        rank_traceback="".join(traceback.format_exception(failure)))


def _killed_by(signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"was killed by {name}" + (OOM_HINT if signum == signal.SIGKILL else "")


def _first_line(record: dict) -> str:
    return record["message"].splitlines()[0] if record["message"] else ""
