"""A cluster run's folder: what every rank leaves there and what the submitting process reads back.

A cluster launcher (``slurm``, ``ray``) gives its ranks one folder that every node sees. Each rank
writes, atomically, one file per fact:

    arrived-<rank>.json    it started: its host, node, pid and time (before the rendezvous)
    progress-<rank>.json   its step, total and last loss (``report_progress`` in ``train_rank``)
    report-<rank>.pkl      its RankReport, when it finished
    error-<rank>.json      what it raised (type, message, traceback), when it failed
    rank-<rank>.log        its output, where the engine does not keep one per rank

The submitting process follows the progress files (``ProgressFeed``, the same RankState lists
``stnb.launch`` gives ``on_progress``) and, when the engine says the job ended, reads the reports or
explains the failure (``failure``): the rank that failed first, on which node, with its log tail.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time
import traceback

from ..errors import LaunchError, failure_kind
from ..files import write_atomic

#: the lines of a rank's log a LaunchError carries
TAIL_LINES = 40
#: error types a rank records when it was stopped from outside rather than failing by itself
STOPPED = ("KeyboardInterrupt", "SystemExit", "SignalException")
#: besides ``launch.peerfail``'s messages: gloo's TCP transport failing under a collective (a "Read error"
#: when the peer's process is gone) is a peer's failure seen from this rank, not this rank's own
PEER_LOST = ("gloo/transport/tcp",)


class RunDir:
    """One run's shared folder (created by the submitting process)."""

    def __init__(self, path):
        self.path = os.path.abspath(os.fspath(path))

    def file(self, kind: str, rank: int, ext: str = "json") -> str:
        return os.path.join(self.path, f"{kind}-{rank}.{ext}")

    # rank side ---------------------------------------------------------------------------
    def arrive(self, rank: int, **facts) -> None:
        """This rank started (written before it joins the rendezvous); what it left in an earlier attempt of the
        same run (an engine's restart) is gone."""
        for stale in (self.file("report", rank, "pkl"), self.file("error", rank)):
            if os.path.exists(stale):
                os.unlink(stale)
        record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **facts}
        write_atomic(self.file("arrived", rank), json.dumps(record))

    def progress_sink(self, rank: int):
        """A ``report_progress`` sink writing this rank's progress file."""
        def sink(step, total=None, loss=None):
            write_atomic(self.file("progress", rank), json.dumps(
                {"step": step, "total": total, "loss": loss, "time": time.time()}))
        return sink

    def write_report(self, rank: int, report) -> None:
        write_atomic(self.file("report", rank, "pkl"), pickle.dumps(report))

    def write_error(self, rank: int, exc: BaseException) -> None:
        write_atomic(self.file("error", rank), json.dumps(
            {"rank": rank, "host": socket.gethostname(), "type": type(exc).__name__, "message": str(exc),
             "traceback": traceback.format_exc(), "time": time.time()}))

    # reader side -------------------------------------------------------------------------
    def _json(self, kind: str, rank: int) -> dict | None:
        try:
            with open(self.file(kind, rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def arrived(self, world: int) -> dict:
        """{rank: its arrival record} of the ranks that started."""
        return {r: a for r in range(world) if (a := self._json("arrived", r)) is not None}

    def errors(self, world: int) -> list:
        return [e for r in range(world) if (e := self._json("error", r)) is not None]

    def reports(self, world: int) -> dict:
        """{rank: RankReport} of the ranks that finished."""
        out = {}
        for r in range(world):
            try:
                with open(self.file("report", r, "pkl"), "rb") as f:
                    out[r] = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                pass
        return out

    def states(self, world: int) -> list:
        """Every rank's progress as ``stnb.launch``'s RankState (what ``on_progress`` receives)."""
        from ..processes import RankState

        now, out = time.time(), []
        finished, failed = set(self.reports(world)), {e["rank"] for e in self.errors(world)}
        for r in range(world):
            p = self._json("progress", r) or {}
            state = ("done" if r in finished else "failed" if r in failed else
                     "running" if os.path.exists(self.file("arrived", r)) else "starting")
            out.append(RankState(rank=r, state=state, step=int(p.get("step") or 0), total=int(p.get("total") or 0),
                                 loss=p.get("loss"), seconds_since_progress=now - p.get("time", now)))
        return out


class ProgressFeed:
    """A thread in the submitting process: every ``interval`` seconds, the ranks' progress files go to
    ``on_progress`` (a list of RankState), until ``stop()`` or, checked every few seconds, until
    ``ended()`` is true (a job nobody waits for: then ``on_end()``); the cell (the kernel) stays free."""

    def __init__(self, rundir: RunDir, world: int, on_progress, interval: float = 0.5, ended=None, on_end=None):
        self.rundir, self.world, self.on_progress, self.interval = rundir, world, on_progress, interval
        self.ended, self.on_end = ended, on_end
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="stnb-progress", daemon=True)

    def start(self) -> "ProgressFeed":
        self._thread.start()
        return self

    def _loop(self) -> None:
        ticks = 0
        while True:
            stopping = self._stop.wait(self.interval)
            ticks += 1
            try:
                if not stopping and self.ended is not None and ticks % 10 == 0 and self.ended():
                    stopping = True
                self.on_progress(self.rundir.states(self.world))
                if stopping and self.on_end is not None and not self._stop.is_set():
                    self.on_end()
            except (Exception, KeyboardInterrupt) as e:  # a display that fails (or stops itself) ends the feed,
                self.error = e                            # not the job: handle.cancel() ends the job
                return
            if stopping:
                return

    def stop(self) -> None:
        """One last update, then the thread ends."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


def log_tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join((text or "").splitlines()[-lines:])


def failure(engine: str, world: int, rundir: RunDir, logs: dict, where: dict, ended: tuple | None = None,
            hint: str = "", failed_first: tuple = ()) -> LaunchError | None:
    """Why a cluster run did not give every rank's report (None when it did).

    logs: {rank: its output}; where: {rank: the node it ran on, as the engine says}; ended: how the
    engine says the job ended, (kind, words): ('cancelled', 'cancelled'), ('timeout', 'out of its time
    limit')...; None: by itself), which wins
    over what the ranks left. In order: the job was ended by the engine; a rank raised by itself (not a
    peer's failure seen in a collective); the rendezvous did not complete (which ranks arrived, which never
    did); a rank vanished (killed: neither report nor error); a peer's failure alone.
    failed_first: the ranks the engine itself saw fail (Ray's worker failures): when several ranks vanished
    (the engine ended the others after the first died), one of these is named, not the lowest rank.
    """
    from ..processes.peerfail import is_secondary as peer_error, origin

    def is_secondary(record):
        return peer_error(record) or any(m in (record.get("message") or "") for m in PEER_LOST)

    reports = rundir.reports(world)
    if len(reports) == world:  # every rank finished (a job cancelled after that still trained)
        return None
    arrived = rundir.arrived(world)
    node = {r: (arrived.get(r) or {}).get("host") or where.get(r) or "?" for r in range(world)}

    def err(message, rank=None, ranks=(), kind="raised", traceback_text=""):
        tail = "" if rank is None else f"--- last lines of rank {rank}'s log (on {node[rank]}) ---\n" \
                                       f"{log_tail(logs.get(rank, '')) or '(no output)'}"
        return LaunchError(f"{engine}: {message}{hint}", rank=rank, ranks=ranks, kind=kind,
                           rank_traceback="\n".join(t for t in (traceback_text, tail) if t), logs=logs)

    errors = [e for e in rundir.errors(world) if e["type"] not in STOPPED]
    missing = [r for r in range(world) if r not in reports]
    if ended is not None:
        first = missing[0] if missing else None
        return err(f"the job ended ({ended[1]}) before every rank finished: rank(s) {_ranks(missing, node)} left no "
                   "result", rank=first, ranks=missing, kind=ended[0])
    primary = [e for e in errors if not is_secondary(e)]
    if primary:
        first = origin(primary)
        r = first["rank"]
        return err(f"rank {r} on {node[r]} raised {first['type']}: {first['message']}", rank=r,
                   ranks=sorted({e['rank'] for e in errors}), kind=failure_kind(first["type"]),
                   traceback_text=first.get("traceback", ""))
    failed = {e["rank"] for e in errors}
    # before the ranks that vanished: no rank gets past its first collective until every rank has arrived, so
    # the ranks that arrived and then vanished were ended because of those that never did (Ray Train ends the
    # other workers, SLURM the other tasks under KillOnBadExit), not by a signal or out-of-memory kill of their own
    never = [r for r in missing if r not in arrived]
    if never:
        came = sorted(arrived)
        return err(f"the rendezvous did not complete: rank(s) {_ranks(came, node) if came else 'none'} arrived, "
                   f"rank(s) {', '.join(map(str, never))} never started (nodes: "
                   f"{', '.join(sorted({where.get(r, '?') for r in never}))}); check that every node of the job "
                   "can start Python with stnb installed and reach the first node's MASTER_PORT",
                   rank=never[0], ranks=never, kind="rendezvous")
    vanished = [r for r in missing if r not in failed]
    if vanished:
        r = min(vanished, key=lambda v: (v not in failed_first, v))
        return err(f"rank {r} on {node[r]} ended without a result or an error (killed: by a signal, the "
                   f"out-of-memory killer, or os._exit); the other ranks failed because of it", rank=r,
                   ranks=sorted({*vanished, *failed}), kind="killed")
    if errors:
        first = origin(errors)
        r = first["rank"]
        return err(f"rank {r} on {node[r]} raised {first['type']}: {first['message']}", rank=r,
                   ranks=sorted(failed), traceback_text=first.get("traceback", ""))
    return err(f"rank(s) {_ranks(missing, node)} left no result", rank=missing[0] if missing else None,
               ranks=missing, kind="exited")


def _ranks(ranks, node) -> str:
    return ", ".join(f"{r} ({node[r]})" for r in ranks)


def train_in_rank(rundir: RunDir, rank: int, world: int, config, build, t0: float, join=None,
                  restarted: bool = False, **facts) -> None:
    """What every cluster rank runs: say it arrived, join the process group (``join()``, when the engine
    has not), train with stnb's own rank code (``training.train_rank``, the same verification as a local
    run; ``restarted``: the engine restarted the run, which continues from its newest checkpoint), and leave
    the RankReport (or the error) in the run's folder."""
    from ..processes.rank import set_progress_sink
    from ..training import train_rank

    rundir.arrive(rank, **facts)
    set_progress_sink(rundir.progress_sink(rank))
    try:
        if join is not None:
            join()
        report = train_rank(config, build, t0, world, restarted=restarted)
        rundir.write_report(rank, report)
    except BaseException as e:
        rundir.write_error(rank, e)
        raise
    finally:
        set_progress_sink(None)


#: folders each machine has its own of: a multi-node job's ranks could not all write there
LOCAL_ONLY = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def check_shared_folder(path: str, what: str, multi_node: bool, create: bool = True,
                        holds: str = "their logs, progress and results there") -> str:
    """``path`` made absolute and (``create``) created; ConfigError when a multi-node job would put it where
    only one machine sees it (the ranks on the other nodes could not write what it ``holds``), or it cannot be
    written."""
    from ..errors import ConfigError

    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if multi_node and any(path == p or path.startswith(p + "/") for p in LOCAL_ONLY):
        raise ConfigError(f"{what} {path!r} is on this machine's own disk (under {next(p for p in LOCAL_ONLY if path.startswith(p))}): "
                          f"the ranks on the other nodes could not write {holds}. "
                          "Use a folder on the cluster's shared filesystem (your home or project directory)")
    if not create:
        return path
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".stnb-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be written ({e}); choose a folder you can write on the "
                          "cluster's shared filesystem") from None
    return path


def check_shared_checkpoints(config, multi_node: bool) -> None:
    """ConfigError when a multi-node job's ``checkpoint_dir`` (stnb's recipe) is on one machine's own disk: every
    node's ranks write their parts of each checkpoint there."""
    if config.checkpoint_dir:
        check_shared_folder(config.checkpoint_dir, "checkpoint_dir", multi_node, create=False,
                            holds="their parts of each checkpoint there: none would be whole, and a requeued or "
                                  "restarted job would find none")


def check_cluster_plan(plan, engine: str, world: int, device: str, option: str, cpus_per_rank: int) -> None:
    """The checks every cluster launcher makes on the submitting machine, before submitting: the strategy
    can span processes, the world is the job's, the device is the job's, the options and (stnb's recipe)
    the model and data are fine, the results file and the save target too. ``option`` names how the
    user sets the world (e.g. 'nodes * tasks_per_node'); ``cpus_per_rank``, each CPU rank's torch threads unless
    ``threads_per_rank`` says otherwise. Completes ``plan.config``/``device`` and the build's model (``check_inputs``)."""
    from .. import strategies
    from ..errors import ConfigError
    from .base import check_plan, refuse_shared_gpus

    config = plan.config
    refuse_shared_gpus(config, engine)
    strategy = config.strategy_object()
    if not strategy.distributed:
        spans = ", ".join(repr(n) for n in strategies.distributed_names())
        raise ConfigError(f"strategy {config.strategy!r} trains in one process, so {engine} cannot spread it over "
                          f"its tasks or nodes; use a strategy whose ranks form a process group ({spans})")
    if config.num_processes not in (None, world):
        raise ConfigError(f"num_processes={config.num_processes} but the {engine} job has {world} ranks ({option}); "
                          f"leave num_processes out (the job decides it) or set {option} to {config.num_processes}")
    if config.device not in ("auto", device):
        raise ConfigError(f"device={config.device!r} but the {engine} job's ranks use {device!r} "
                          f"({'GPUs asked for' if device == 'cuda' else 'no GPU asked for'}); "
                          f"{'ask for GPUs' if config.device == 'cuda' else 'leave device out'} or set device={device!r}")
    if strategy.min_ranks and world < strategy.min_ranks:
        raise ConfigError(f"{config.strategy} needs at least {strategy.min_ranks} ranks to shard over; "
                          f"the {engine} job has {world} ({option})")
    config = config.replace(num_processes=world, device=device)
    check_plan(plan, config, device, machine=lambda c: c.check_device(device))  # the job's nodes: the launcher's
    if device == "cpu" and not config.threads_per_rank:  # a CPU rank uses the cores its task or worker got
        plan.config = config.replace(threads_per_rank=cpus_per_rank)


def check_int(engine: str, name: str, value, lo: int) -> None:
    """ConfigError unless ``value`` (the launcher's option ``name``) is an integer >= ``lo``."""
    from ..errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{engine}({name}=...) must be an integer >= {lo}, got {value!r}")
