"""``python -m stnb predict``: the scaling predictor from the command line.

    python -m stnb predict --seed-table            the published tables (ST docs 4x V100, DLE BERT on a DGX-1),
                                                   predicted row by row as intervals (stnblab.scaling.check)
    python -m stnb predict --calibrate             this machine's loopback link, measured
    python -m stnb predict --results runs.jsonl --run-id ID --link nvlink-a100 --devices 2,4,8
    python -m stnb predict --check-here            measure single, 2-rank DDP and FSDP here and compare
"""

from __future__ import annotations

import json


def add_cli(subparsers) -> None:
    from stnb.scaling.links import KNOWN

    p = subparsers.add_parser("predict", help="predict samples/s on N devices from one measured run")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--seed-table", action="store_true",
                      help="check against the published tables (ST docs' 4x V100, DLE BERT on a DGX-1)")
    what.add_argument("--calibrate", action="store_true", help="measure this machine's loopback link")
    what.add_argument("--results", help="a results file (JSONL); predicts from its run --run-id (default: last)")
    what.add_argument("--check-here", action="store_true",
                      help="run single (1 thread), 2-rank DDP and FSDP here; print predicted vs measured")
    p.add_argument("--run-id", default=None)
    p.add_argument("--link", default="loopback", help=f"one of {', '.join(KNOWN)}")
    p.add_argument("--devices", default="2,4,8", help="comma-separated device counts")
    p.add_argument("--model", default="minilm", help="--check-here: the model (default minilm)")
    p.add_argument("--steps", type=int, default=12, help="--check-here: steps per run")
    p.add_argument("--batch", type=int, default=16, help="--check-here: per-device batch")
    p.add_argument("--write", default=None, help="--seed-table: refresh the table in this markdown file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)


def cmd_predict(a) -> int:
    from stnb.scaling import predict
    from . import check
    from stnb.scaling.links import resolve

    if a.seed_table:
        from pathlib import Path

        rows, notes = check.rows()
        print(json.dumps(rows, indent=1) if a.json else check.document(rows, notes))
        if a.write:
            changed = check.refresh(a.write, table_only=Path(a.write).name == "README.md")
            print(f"{a.write}: {'updated' if changed else 'already current'}")
        return 0
    if a.calibrate:
        print(resolve("loopback").describe())
        return 0
    devices = [int(x) for x in a.devices.split(",") if x.strip()]
    if a.results:
        from stnb.results import load_results

        rows = load_results(a.results, as_frame=False)
        pick = [r for r in rows if a.run_id in (None, r.get("run_id"))]
        if not pick:
            from stnb.errors import ConfigError

            raise ConfigError(f"no run {a.run_id!r} in {a.results}; run ids there: "
                              f"{', '.join(r.get('run_id', '?') for r in rows)}")
        pred = predict(pick[-1], devices=devices, link=a.link)
        print(pred.table.to_string(index=False))
        print("\n".join(f"- {x}" for x in pred.assumptions))
        return 0
    rows = check_here(a.model, a.steps, a.batch)
    print(json.dumps(rows, indent=1) if a.json else "\n".join(
        f"{r['strategy']:>5} on 2 ranks: measured {r['measured']:.2f} samples/s; predicted from the single run "
        f"{r['predicted']:.2f} ({r['error']:+.0%}), from the run's own compute split {r['predicted_own']:.2f} "
        f"({r['error_own']:+.0%}); compute per rank {r['compute_ratio']:.2f}x the single run's" for r in rows))
    return 0


def check_here(model: str = "minilm", steps: int = 12, batch: int = 16, strategies=None) -> list:
    """Measure a single run (one thread: what each of 2 ranks gets on 2 cores) and 2-rank runs here;
    predict the 2-rank runs from the single one on the measured loopback. One dict per strategy;
    ``strategies`` None: the bench's distributed ones (``Strategy.bench``; ddp and fsdp)."""
    import os

    from stnb import strategies as registry
    from stnb.config import TrainConfig
    from stnb.runner import run
    from stnb.scaling import compare, from_result, predict

    if strategies is None:
        strategies = [s.name for s in registry.all_strategies() if s.bench and s.distributed]

    threads = max(1, (os.cpu_count() or 2) // 2)
    base = dict(model=model, steps=steps, per_device_batch_size=batch, evaluate=False, device="cpu",
                threads_per_rank=threads)
    single = run(TrainConfig(strategy=registry.baseline_name(), **base), echo=False)
    out = []
    for s in strategies:
        measured = run(TrainConfig(strategy=s, num_processes=2, **base), echo=False)
        one, own = (compare(predict(r, devices=[2], link="loopback", strategies=[s]), measured)
                    for r in (single, measured))
        m1, m2 = from_result(single), from_result(measured)
        out.append({**one, "predicted_own": own["predicted"], "error_own": own["error"],
                    "compute_ratio": (m2.forward + m2.backward) / (m1.forward + m1.backward),
                    registry.baseline_name(): single.samples_per_second, "threads_per_rank": threads})
    return out
