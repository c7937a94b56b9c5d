"""RunResult and results files (JSONL, appended one run at a time, written atomically)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .files import write_atomic
from .errors import ResultsFileError
from .rankreport import check_reports

#: how an STS evaluator's primary metric ends (``RunResult.spearman_before`` / ``spearman_after`` read it)
SPEARMAN = "spearman_cosine"


@dataclass
class RunResult:
    strategy: str
    world_size: int
    per_device_batch_size: int
    global_batch_size: int
    steps: int
    samples_per_second: float | None
    step_times: list
    losses: list
    peak_memory_bytes: list            # per rank, the training steps (CUDA: max allocated; CPU: RSS growth)
    local_param_count: list            # per rank
    total_param_count: int
    verified: bool
    verification: dict
    model: str
    device: str
    versions: dict
    memory_breakdown: list = field(default_factory=list)   # per rank {params, grads, optimizer_state}
    peak_memory_run_bytes: list = field(default_factory=list)  # per rank, the whole run (evaluation, save...)
    memory_split: list = field(default_factory=list)  # per rank: where the peak went (stnb.memsplit)
    dev_metric: str | None = None      # the dev evaluator's primary metric, e.g. 'dev_spearman_cosine'
    dev_metric_before: float | None = None
    dev_metric_after: float | None = None
    dev_curve: list = field(default_factory=list)  # [(step, value)]: (0, before), the trainer's evals, (steps, after)
    time_to_first_step_s: float | None = None
    wall_time_s: float | None = None
    launcher: str = "stnb"
    cluster: dict = field(default_factory=dict)  # slurm / ray: job id, nodes and ranks seen, where the logs are
    start_method: str | None = None    # how stnb started the ranks, as they observed it: fork | spawn
    mfu: dict | None = None            # model FLOPs utilisation and its inputs (stnb.mfu.summarize)
    time_split: list = field(default_factory=list)  # per rank: where each step's time went (stnb.timesplit)
    collectives: list = field(default_factory=list)  # per rank: collective calls per step, by kind (count, bytes)
    outside_steps: list = field(default_factory=list)  # per rank: step spread; evaluation / saves between steps
    status: str = "ok"                 # ok | not runnable here | failed
    reason: str = ""
    saved_to: str | None = None
    # checkpoints (stnb.checkpoints): each saved one {step, path, seconds (the slowest rank), bytes_written (per
    # rank)}; the one this run resumed from {path, step, written_by, written_strategy, read_by, read_strategy,
    # started_at_step, and on another layout loaded: {how, model_tensors_checked, optimizer_tensors_checked, rng}}
    checkpoints: list = field(default_factory=list)
    resumed_from: dict | None = None
    build: str | None = None           # the user's build function (stnb.run(build, ...)); None: stnb's recipe
    overridden_args: dict = field(default_factory=dict)  # {argument: {"from", "to", "why"}} a strategy owns
    config: dict = field(default_factory=dict)
    run_id: str = ""
    timestamp: float = field(default_factory=time.time)

    @property
    def spearman_before(self) -> float | None:
        """``dev_metric_before`` when the dev metric is a Spearman correlation (an STS evaluator's), else None."""
        return self.dev_metric_before if self._spearman else None

    @property
    def spearman_after(self) -> float | None:
        """``dev_metric_after`` when the dev metric is a Spearman correlation (an STS evaluator's), else None."""
        return self.dev_metric_after if self._spearman else None

    @property
    def _spearman(self) -> bool:
        return (self.dev_metric or "").endswith(SPEARMAN)

    def to_dict(self) -> dict:
        """Every field, and ``spearman_before`` / ``spearman_after`` (results files and tables keep their columns)."""
        d = {**asdict(self), "spearman_before": self.spearman_before, "spearman_after": self.spearman_after}
        return json.loads(json.dumps(d, default=_jsonable))

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        known = {f for f in cls.__dataclass_fields__}
        kept = {k: v for k, v in d.items() if k in known}
        if "dev_metric" not in d and d.get("spearman_after") is not None:  # an stnb older than dev_metric_*
            kept.update(dev_metric=f"dev_{SPEARMAN}", dev_metric_before=d.get("spearman_before"),
                        dev_metric_after=d["spearman_after"])
        if kept.get("dev_curve"):  # JSON holds each (step, value) as a list
            kept["dev_curve"] = [tuple(p) for p in kept["dev_curve"]]
        return cls(**kept)

    def to_frame(self):
        """One-row pandas DataFrame (lists kept as objects)."""
        import pandas as pd

        return pd.DataFrame([self.to_row()])

    def to_row(self) -> dict:
        d = self.to_dict()
        cfg = d.get("config") or {}
        d["peak_memory_max_bytes"] = max(self.peak_memory_bytes) if self.peak_memory_bytes else None
        d["local_param_fraction"] = (max(self.local_param_count) / self.total_param_count
                                     if self.local_param_count and self.total_param_count else None)
        d["final_loss"] = self.losses[-1] if self.losses else None
        from .strategies import options

        for k in ("loss", "learning_rate", "threads_per_rank", "gradient_accumulation_steps", "gather_across_devices",
                  "reuse_freed_memory", *options()):  # and every strategy's own options
            d.setdefault(k, cfg.get(k))
        return d

    @classmethod
    def unavailable(cls, config, reason: str, build=None) -> "RunResult":
        """A 'not runnable here' row: the comparison shows it with its reason.

        build: what the run would have trained (``stnb.builds``; default stnb's recipe): its batch, model and
        config in the row (``unavailable_row``: a user's build function is named instead of the recipe's model,
        and its batch is the override's when one was given, else unknown, 0)."""
        from .builds import RecipeBuild
        from .hardware import versions

        row = (build or RecipeBuild()).unavailable_row(config)
        return cls(strategy=config.strategy, world_size=config.world_size(), steps=0, samples_per_second=None,
                   step_times=[], losses=[], peak_memory_bytes=[], local_param_count=[],
                   total_param_count=0, verified=False, verification={},
                   device=config.resolved_device(), versions=versions(), status="not runnable here",
                   reason=reason, **row)


# ---- merging the ranks' measurements -----------------------------------------------------

def merge(config, rank_results: list, device: str, n_gpu: int = 0, wall_time_s: float | None = None,
          launcher: str = "stnb", cluster: dict | None = None, build=None) -> RunResult:
    """Combine every rank's measurements (``stnb.training.train_rank``'s RankReports) into one RunResult.

    config: the run's TrainConfig. cluster: what a cluster launcher saw (job id, nodes, ranks, logs).
    build: what the ranks trained (``stnb.builds``; default stnb's recipe): it says what the result's ``config``
    holds (``result_config``)."""
    import uuid

    from .builds import RecipeBuild
    from .hardware import versions

    rank_results = check_reports(rank_results)
    r0 = rank_results[0]
    training = r0.training or {}  # a user's trainer: what it trains with (not the recipe's fields)
    n_steps = min(len(r.step_times) for r in rank_results)
    step_times = [max(r.step_times[i] for r in rank_results) for i in range(n_steps)]
    warm = min(config.warmup_steps_excluded, max(0, n_steps - 1))
    gbs = r0.global_batch_size
    # the slowest rank's own time for the measured steps (the sum of per-step maxima would also add
    # the ranks' timing jitter, which is not time the job spent)
    span = max(sum(r.step_times[warm:n_steps]) for r in rank_results)
    sps = gbs * (n_steps - warm) / span if n_steps > warm and span > 0 else None
    from .mfu import summarize as mfu_summary
    from .timesplit import combine as combine_time_split

    mfu = mfu_summary(rank_results, warm, n_steps, span, gbs * (n_steps - warm),
                      devices=config.strategy_object().devices(n_gpu))
    verification, problems = cross_rank_checks(config, rank_results, device)
    ok = not problems
    return RunResult(
        strategy=config.strategy,
        world_size=len(rank_results) if config.strategy_object().distributed else 1,
        per_device_batch_size=training.get("per_device_batch_size", config.per_device_batch_size),
        global_batch_size=gbs,
        steps=n_steps,
        samples_per_second=sps,
        step_times=step_times,
        losses=r0.losses,
        peak_memory_bytes=[r.peak_memory_bytes for r in rank_results],
        peak_memory_run_bytes=[r.peak_memory_run_bytes for r in rank_results],
        local_param_count=[r.verification.get("local_param_count") for r in rank_results],
        total_param_count=r0.verification.get("total_param_count") or 0,
        verified=ok,
        verification=verification,
        reason="" if ok else "not verified: " + "; ".join(problems),
        model=training.get("model", config.model),
        device=r0.device,
        versions=versions(),
        memory_breakdown=[r.memory_breakdown for r in rank_results],
        memory_split=[r.memory_split for r in rank_results],
        dev_metric=r0.dev_metric,
        dev_metric_before=r0.dev_metric_before,
        dev_metric_after=r0.dev_metric_after,
        dev_curve=list(r0.dev_curve),
        time_to_first_step_s=max((r.time_to_first_step_s for r in rank_results
                                  if r.time_to_first_step_s is not None), default=None),
        wall_time_s=wall_time_s,
        launcher=launcher,
        cluster=dict(cluster or {}),
        start_method=verification.get("start_method", {}).get("seen"),
        mfu=mfu,
        time_split=combine_time_split([r.time_split for r in rank_results]),
        collectives=[r.collectives for r in rank_results],
        outside_steps=[r.outside_steps for r in rank_results],
        saved_to=(r0.saved_model or {}).get("saved_to"),
        checkpoints=[{**c, "seconds": max(r.checkpoints[i]["seconds"] for r in rank_results)}
                     for i, c in enumerate(r0.checkpoints)],
        resumed_from=r0.resumed_from,
        build=r0.build,
        overridden_args=r0.overridden_args or {},
        config=(build or RecipeBuild()).result_config(config, training),
        run_id=uuid.uuid4().hex[:12],
    )


def side_by_side(runs: list) -> RunResult:
    """N independent runs at once (each ``merge``d alone, one report each) as one RunResult: their samples/s
    and global batches summed, one world (no communication), verified only when every run is."""
    from dataclasses import replace

    bad = [f"run {i}: {r.reason or 'not verified'}" for i, r in enumerate(runs) if not r.verified]
    return replace(
        runs[0], world_size=1, samples_per_second=sum(r.samples_per_second or 0.0 for r in runs),
        global_batch_size=sum(r.global_batch_size for r in runs),
        verification={"independent_runs": [r.samples_per_second for r in runs],
                      "ranks": [r.verification.get("ranks", [{}])[0] for r in runs]},
        verified=not bad, reason="; ".join(bad),
        peak_memory_bytes=[r.peak_memory_bytes[0] for r in runs],
        peak_memory_run_bytes=[r.peak_memory_run_bytes[0] for r in runs])


def cross_rank_checks(config, rank_results: list, device: str | None = None) -> tuple:
    """(verification dict, problems): every rank's own verification, plus what needs all ranks:
    the number of ranks against the requested world size, per-tensor identical replicated weights (every
    parameter the optimizer updates that is not sharded: the model's and the loss's own), the strategy's
    own cross-rank checks (shards adding up, optimizer partitions), and the saved model's check (rank 0)."""
    from .checks import compare_digests

    rank_results = check_reports(rank_results)
    requested = config.world_size()
    ranks = [r.verification for r in rank_results]
    verification = {"ranks": ranks, "world_size_requested": requested,
                    "world_size_seen": sorted({v.get("world_size_seen") for v in ranks}, key=str),
                    "model_shape": rank_results[0].model_shape,
                    "peak_memory_method": rank_results[0].peak_memory_method}
    never = "no training step began, so the prepared model was never verified"
    problems = [f"rank {i}: " + "; ".join(v.get("problems") or [never]) for i, v in enumerate(ranks) if not v.get("ok")]
    strategy = config.strategy_object()
    if strategy.distributed and len(rank_results) != requested:
        problems.append(f"{requested} ranks were requested, {len(rank_results)} returned a result")
    from .strategies import verify_ranks

    own, own_problems = verify_ranks(strategy, rank_results, requested)
    verification.update(own)
    problems += own_problems
    problems += _device_problems(device, rank_results, verification)
    started = [r.start_method for r in rank_results]
    asked = rank_results[0].start_method_requested
    if asked is not None:  # stnb started the ranks: each saw how it was started
        same = len(set(started)) == 1
        verification["start_method"] = {"requested": asked, "seen": started[0] if same else None,
                                        "per_rank": started}
        if not same or started[0] != asked:
            problems.append(f"start method {asked!r} was requested, the ranks were started by {started}")
    saved = rank_results[0].saved_model
    if saved is not None:
        verification["saved_model"] = saved
        problems += [f"save_to: {p}" for p in saved.get("problems") or []]
    # the data reached the loss whole: every text column as an input, the score as the label
    cols = rank_results[0].data_columns
    if cols is not None:  # None: a trainer whose dataset has no column names
        seen = [r.loss_inputs for r in rank_results]
        verification["data_columns"] = cols
        verification["loss_inputs"] = seen
        if isinstance(cols, dict):  # one dataset per loss: checked per dataset
            verification["loss_inputs_per_dataset"] = per = {
                name: _columns_reached(c, [(s or {}).get(name) for s in seen]) for name, c in cols.items()}
            for name, check in per.items():
                if check["ok"] is False:
                    problems.append(f"dataset {name!r}: the loss received {check['seen']} but the data has "
                                    f"columns {check['columns']} (expected {check['expected']})")
            verification["loss_received_all_columns"] = all(c["ok"] is not False for c in per.values())
        else:
            check = _columns_reached(cols, seen)  # one loss runs in every step: on every rank
            verification["loss_received_all_columns"] = check["ok"] is True and None not in seen
            if not verification["loss_received_all_columns"]:
                problems.append(f"the loss received {seen[0]} but the data has columns {cols} "
                                f"(expected {check['expected']})")
    verification["problems"] = problems
    return verification, problems


def _device_problems(asked: str | None, rank_results: list, verification: dict) -> list:
    """The device the run asked for (``device``: 'cpu' / 'cuda', resolved before launch) against the one each
    rank's module that trains received its first batch on (``FirstStepChecks.device_seen``): a rank that
    could not start CUDA and trained on the CPU instead is named, never merged as verified."""
    seen = [(r.verification or {}).get("device_seen") for r in rank_results]
    if asked is None or not any(seen):  # no step began (reported as never verified), or an older report
        return []
    verification["device"] = {"requested": asked, "per_rank": seen}
    return [f"rank {i}: device {asked!r} was requested, its model trained on {'/'.join(s) if s else 'nothing'}"
            for i, s in enumerate(seen) if s is not None and s != [asked]]


def _columns_reached(cols: list, seen: list) -> dict:
    """What a loss should receive from columns ``cols`` against what each rank's loss received (``seen``,
    None where that loss never ran): ok True / False, or None when it ran on no rank (nothing to compare;
    a multi-dataset sampler may not pick a dataset in a short run)."""
    from .columns import LABEL_COLUMNS

    expected = {"texts": len([c for c in cols if c not in LABEL_COLUMNS]), "label": any(c in LABEL_COLUMNS for c in cols)}
    ran = [x for x in seen if x is not None]
    return {"columns": cols, "expected": expected, "seen": seen,
            "ok": all(x == expected for x in ran) if ran else None,
            **({} if ran else {"note": "its loss did not run in this run's steps"})}


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return repr(o)


# ---- results files --------------------------------------------------------------------

def append_result(path, result) -> None:
    """Append one run to a JSONL results file, atomically.

    The existing file is validated first (a corrupted file raises ResultsFileError and is
    left untouched); the old bytes plus the new line are written to a temporary file in the
    same folder and renamed over the old one, so a crash leaves either the old or the new
    file, never half. A lock file next to it serialises appends from threads and processes
    (two notebooks writing one file lose no run).
    """
    path = Path(path)
    row = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    line = json.dumps(row, default=_jsonable) + "\n"  # before anything is touched
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsFileError(f"cannot write results file {path}: {e}; choose a writable path") from e
    with _append_lock(path):
        old = ""
        if path.exists():
            old = _read_text(path)
            _parse(path, old)  # raises ResultsFileError naming the bad line; the file stays as it is
            if old and not old.endswith("\n"):
                old += "\n"
        # mkstemp makes the file 0600; keep the old file's mode (or the usual 0666 & ~umask)
        mode = stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o666 & ~_umask()
        write_atomic(path, old + line, mode, on_open_error=lambda e: ResultsFileError(
            f"cannot write results file {path}: {e}; choose a writable path"))


@contextlib.contextmanager
def _append_lock(path: Path):
    """An exclusive flock on ``.<name>.lock`` beside the results file (no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ResultsFileError(f"cannot write results file {path}: {e}; choose a writable path") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def check_writable(path) -> None:
    """Raise ResultsFileError now (before a run) if `path` cannot be written or is corrupted."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.exists():
        load_results(path, as_frame=False)
        if not os.access(path, os.W_OK) or not os.access(parent, os.W_OK):
            raise ResultsFileError(f"results file {path} is not writable; fix its permissions or choose another path")
        return
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise ResultsFileError(f"cannot create results file {path}: {probe} is not a writable folder; "
                               "choose a writable path")


def load_results(path, as_frame: bool = True):
    """Read a JSONL results file. A corrupted line raises ResultsFileError naming the line."""
    path = Path(path)
    rows = _parse(path, _read_text(path))
    if not as_frame:
        return rows
    return results_frame(rows)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsFileError(f"cannot read results file {path}: {e}") from e


def _parse(path: Path, text: str) -> list:
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise ResultsFileError(
                f"results file {path} is corrupted at line {i} ({e}); it was not modified. "
                f"Move it aside or repair that line, then run again") from e
        rows.append(row)
    return rows


def results_frame(results):
    """A pandas DataFrame, one row per run, from RunResults or dicts."""
    import pandas as pd

    rows = []
    for r in results:
        rr = r if isinstance(r, RunResult) else RunResult.from_dict(r)
        rows.append(rr.to_row())
    return pd.DataFrame(rows)
