"""One baseline for notebooks 05, 06 and 08: DDP beside the single runs it can be compared with.

``baseline(prof, device)`` runs the bench's knobs section with DDP's defaults only (``knobs=("defaults",)``)
plus, on CPU, one process with every core at DDP's global batch (``BenchOptions.whole_machine``): single
with 1 thread (one rank's share), DDP with N ranks, N single runs at once with no communication (the
ceiling on CPU) and single with the whole machine, one after another in one call. It saves the numbers
(with the profile, model, device, steps, batch, the machine's cores and when they were measured) to a
small JSON file, ``$STNB_BASELINE`` or ``<stnb cache>/baseline.json``. ``baseline(..., reuse=True)`` loads
the saved one when it was measured for the same profile, model, device, steps, batch and cores, and says
where it came from; otherwise it measures and says why. The path is never printed (it names the machine's
home folder).

The baseline itself (what "faster" means) is the whole machine in one process on CPU (what one would run
without ranks) and one GPU on GPUs.

A notebook that reuses the table and then measures runs of its own (08's DDP knobs) measures the baseline's
variants again beside them (``remeasured``) and compares with those; ``drift`` says how far the machine moved
since the saved table (on a shared machine a quarter was seen between two notebooks: every run slower alike).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the environment variable that moves the saved baseline
ENV = "STNB_BASELINE"
DDP = "ddp defaults"
#: the keys a saved baseline must match to be reused
MATCH = ("profile", "model", "device", "steps", "batch_size", "cores")
#: how far the variants measured again may move (their median ratio) for the machine to count as unchanged
DRIFT = 0.10


def baseline_path() -> Path:
    """Where the baseline is saved: ``$STNB_BASELINE`` or ``baseline.json`` in stnb's cache folder."""
    from stnb.models import cache_dir

    return Path(os.environ.get(ENV) or Path(cache_dir()) / "baseline.json")


@dataclass
class Baseline:
    """The side-by-side numbers: samples/s per variant, which one is the baseline, where they came from."""

    samples_per_second: dict                 # variant -> samples/s
    name: str                                # the variant every speedup divides by
    key: dict                                # what was measured (MATCH and the number of ranks)
    measured_at: float                       # time.time() when the measurement ended
    seconds: float                           # how long it took
    notebook: str | None = None              # the notebook that measured it
    source: str = ""                         # one sentence: measured now (and why) or reused from where
    batch: dict = field(default_factory=dict)  # variant -> samples per optimizer step (all its processes)
    other_load: dict = field(default_factory=dict)  # variant -> share of the CPUs other programs used meanwhile

    def __getitem__(self, variant: str) -> float:
        return self.samples_per_second[variant]

    @property
    def ranks(self) -> int:
        return int(self.key.get("ranks") or 2)

    @property
    def ddp(self) -> float:
        return self.samples_per_second[DDP]

    @property
    def ceiling(self) -> str | None:
        """CPU only: the variant of N independent processes at once (no communication)."""
        from .planning import is_concurrent

        return next((v for v in self.samples_per_second if is_concurrent(v)), None)

    @property
    def table(self):
        """A DataFrame: samples/s and the speedup over the baseline, one row per variant."""
        import pandas as pd

        sps = pd.Series(self.samples_per_second, name="samples_per_second")
        frame = sps.to_frame()
        if self.batch:
            frame.insert(0, "batch", pd.Series(self.batch).reindex(sps.index))
        frame["vs_baseline"] = sps / sps[self.name]
        if self.other_load:   # a busy machine slows one multi-threaded process most (notebook 05)
            frame["other_load"] = pd.Series(self.other_load, dtype=float).reindex(sps.index)
        frame.index.name = "variant"
        return frame

    def speedup(self, samples_per_second: float) -> float:
        return samples_per_second / self.samples_per_second[self.name]

    def against(self, samples_per_second: float) -> str:
        """"faster than", "slower than" or "about as fast as" the baseline: within 5 % counts as the same."""
        s = self.speedup(samples_per_second)
        return "faster than" if s > 1.05 else "slower than" if s < 0.95 else "about as fast as"

    def verdict(self) -> str:
        """Sentences computed from the numbers: DDP against each single run and the ceiling's share."""
        lines = [f"DDP x{self.ranks} is {self.ddp / sps:.2f}x {name}" + (" (the baseline)" if name == self.name else "")
                 for name, sps in self.samples_per_second.items() if name != DDP]
        lines.append(f"so on this machine DDP with {self.ranks} ranks is {self.against(self.ddp)} the baseline, "
                     f"{self.name}")
        if self.ceiling:
            lost = 1 - self.ddp / self.samples_per_second[self.ceiling]
            lines.append(f"against {self.ranks} independent processes, communication and waiting cost DDP "
                         f"{lost:.0%} here")
        from .load import NOISY

        busy = max((v for v in self.other_load.values() if v is not None), default=0.0)
        if busy > NOISY:
            lines.append(f"other programs used up to {busy:.0%} of the CPUs meanwhile: a quiet machine may give "
                         "other numbers")
        return "\n".join(lines)

    def remeasured(self, frame) -> "Baseline":
        """The same variants measured again beside a notebook's own runs: ``frame``, a bench's knobs frame
        (``variant``, ``samples_per_second``) that has this baseline's variant (CPU: ``whole_machine=True``)."""
        sps = {v: float(x) for v, x in zip(frame["variant"], frame["samples_per_second"])
               if v in self.samples_per_second}
        if self.name not in sps:
            from stnb.errors import ConfigError

            raise ConfigError(f"the bench measured no {self.name!r} run to compare with: run it with "
                              "whole_machine=True (one process with every core)")
        return Baseline(samples_per_second=sps, name=self.name, key=dict(self.key), measured_at=time.time(),
                        seconds=0.0, source="measured now, beside these runs")

    def drift(self, now: "Baseline") -> str:
        """How ``now`` (``remeasured``) compares with this saved table: each variant both measured, and whether
        the machine runs as fast as it did (the median ratio within ``DRIFT``)."""
        import statistics

        both = [v for v in self.samples_per_second if v in now.samples_per_second]
        ratio = {v: now[v] / self[v] for v in both}
        then = f"notebook {self.notebook}'s" if self.notebook else "the saved table's"
        table = f"notebook {self.notebook}'s table" if self.notebook else "the saved table"
        lines = [f"{v}: {now[v]:.1f} samples/s now, {ratio[v]:.2f}x {then} {self[v]:.1f}" for v in both]
        m = statistics.median(ratio.values())
        if abs(m - 1) <= DRIFT:
            lines.append(f"this machine runs as it did for {table} (within {DRIFT:.0%})")
        else:
            lines.append(f"this machine runs {abs(1 - m):.0%} {'slower' if m < 1 else 'faster'} now than for "
                         f"{table} (other programs, another host): a ratio of a run now to that table carries it")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"key": self.key, "samples_per_second": self.samples_per_second, "baseline": self.name,
                "measured_at": self.measured_at, "seconds": self.seconds, "notebook": self.notebook,
                "batch": self.batch, "other_load": self.other_load}

    @classmethod
    def from_dict(cls, d: dict) -> "Baseline":
        return cls(samples_per_second=dict(d["samples_per_second"]), name=d["baseline"], key=dict(d["key"]),
                   measured_at=float(d["measured_at"]), seconds=float(d.get("seconds") or 0.0),
                   notebook=d.get("notebook"), batch=dict(d.get("batch") or {}),
                   other_load=dict(d.get("other_load") or {}))


def wanted_key(prof, device: str) -> dict:
    """What a baseline for this profile and device is: the values a saved one must match (``MATCH``)."""
    from stnb.hardware import cpu_cores

    return {"profile": prof.name, "model": prof.model, "device": device, "steps": prof.bench_steps,
            "batch_size": prof.per_device_batch_size, "cores": cpu_cores()}


def load(path: Path | None = None) -> Baseline | None:
    """The saved baseline, or None when there is none or it cannot be read."""
    path = Path(path or baseline_path())
    try:
        return Baseline.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mismatch(saved: Baseline | None, key: dict) -> str | None:
    """Why ``saved`` cannot stand for a baseline with ``key`` (None when it can)."""
    if saved is None:
        return "no saved baseline (notebook 05 measures and saves it)"
    for k in MATCH:
        if saved.key.get(k) != key[k]:
            return f"the saved baseline was measured with {k} {saved.key.get(k)!r}, this notebook has {key[k]!r}"
    return None


def baseline(prof, device: str = "cpu", *, reuse: bool = False, notebook: str | None = None,
             path: str | Path | None = None, echo: bool = True) -> Baseline:
    """Measure the side-by-side baseline and save it, or (``reuse=True``) load the saved one if it matches.

    prof: the notebook's profile (``stnb.setup()``): model, bench steps, per-device batch, train size.
    device: where the ranks run ('cpu' or 'cuda'). notebook: who measures (named when another reuses it).
    Prints one line saying which variant is the baseline and where the numbers came from.
    """
    path = Path(path or baseline_path())
    key = wanted_key(prof, device)
    base, why = None, None
    if reuse:
        saved = load(path)
        why = mismatch(saved, key)
        if why is None:
            base = saved
            at = time.strftime("%H:%M", time.localtime(saved.measured_at))
            if time.strftime("%Y-%m-%d", time.localtime(saved.measured_at)) != time.strftime("%Y-%m-%d"):
                at += time.strftime(" on %Y-%m-%d", time.localtime(saved.measured_at))
            base.source = f"measured in notebook {saved.notebook} at {at}" if saved.notebook else f"measured at {at}"
            base.source += ", reused"
    if base is None:
        base = _measure(prof, device, key)
        base.notebook = notebook
        base.source = f"measured now, in {base.seconds:.0f} s" + (f" ({why})" if why else "")
        _save(base, path)
    if echo:
        print(f"baseline: {base.name}; {base.source}")
    return base


def _save(base: Baseline, path: Path) -> None:
    """Write ``path`` whole or not at all: a temporary file of this writer's own, then renamed (two notebooks
    that measure at once, as under make test's workers, never share one)."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(base.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _measure(prof, device: str, key: dict) -> Baseline:
    """One bench call: DDP's defaults, single with one rank's share, N single at once, the whole machine."""
    import tempfile

    from .planning import whole_machine_name
    from .session import bench
    from .summary import knobs_frame

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="stnb-baseline-") as tmp:
        report = bench(model=prof.model, sections=("knobs",), knobs=("defaults",), device=device,
                       batch_size=prof.per_device_batch_size, steps=prof.bench_steps, warmup=2, repeats=1,
                       train_size=prof.train_size, whole_machine=True, results=str(Path(tmp) / "runs.jsonl"),
                       report=str(Path(tmp) / "runs.html"), echo=False)
    rows = knobs_frame(report)
    bad = rows[~(rows.ok.astype(bool) & rows.verified.fillna(False).astype(bool))]   # failed or not verified
    if len(bad):
        from stnb.errors import ConfigError

        raise ConfigError("the baseline could not be measured: " +
                          "; ".join(f"{r.variant}: {r.status} {r.reason or ''}".strip() for r in bad.itertuples()))
    sps = {r.variant: float(r.samples_per_second) for r in rows.itertuples()}
    whole = whole_machine_name(key["cores"])
    name = whole if whole in sps else next(v for v in sps if v.startswith("single"))
    variants = report.summary["sections"]["knobs"]["variants"]
    ranks = next((int(r["world_size"]) for r in variants if r["variant"] == DDP and r.get("world_size")), 2)
    batch = {r["variant"]: int(r["global_batch_size"]) for r in variants if r.get("global_batch_size")}
    other_load = {r["variant"]: r["other_load"] for r in variants if r.get("other_load") is not None}
    return Baseline(samples_per_second=sps, name=name, key={**key, "ranks": ranks}, measured_at=time.time(),
                    seconds=time.time() - t0, batch=batch, other_load=other_load)
