"""The predictor against the sentence-transformers documentation's 4x V100 table, row by row.

The only measured input is their single-GPU row (``stnb.reference``: 2724 samples/s, batch 32 of
microsoft/mpnet-base). Everything else is a documented hardware number, the same for every row:

* link: the ``nvlink-v100`` preset (V100 datasheet, 150 GB/s per direction);
* the single step split: AdamW's update reads parameters, gradients and both moments and writes
  parameters and moments (28 bytes per parameter, fp32), at the V100's HBM2 bandwidth of 900 GB/s
  (V100 datasheet); the rest is forward:backward = 1:2 (their FLOPs);
* gradients and parameters in fp32 (mixed precision keeps fp32 master weights and gradients);
* mpnet-base's shape from its config.json (vocab 30527, hidden 768, 514 positions, 12 layers):
  the FSDP root holds the embeddings.

No constant is chosen per row. ``check()`` returns one dict per row with the error;
``python -m stnb predict --seed-table`` prints it and ``docs/scaling.md`` holds it.
"""

from __future__ import annotations

from .. import reference
from .model import Measured

V100_HBM_BYTES_PER_S = 900e9          # NVIDIA V100 datasheet: HBM2 900 GB/s
ADAMW_BYTES_PER_PARAM = 28            # fused AdamW, fp32: read p, g, m, v (16 B), write p, m, v (12 B)
MPNET = {"vocab": 30527, "hidden": 768, "positions": 514, "layers": 12}  # microsoft/mpnet-base config.json
LINK = "nvlink-v100"
STRATEGIES = tuple(reference.SAMPLES_PER_SECOND)  # the rows of their table


def measured() -> Measured:
    """Their single-GPU row as one device's Measured step, split by the documented numbers above."""
    p = reference.MODEL_PARAMETERS
    step = reference.PER_DEVICE_BATCH_SIZE / reference.ONE_GPU
    optimizer = ADAMW_BYTES_PER_PARAM * p / V100_HBM_BYTES_PER_S
    compute = step - optimizer
    h = MPNET["hidden"]
    root = (MPNET["vocab"] + MPNET["positions"]) * h / p  # embeddings (and the small rest) outside the layers
    return Measured(batch=reference.PER_DEVICE_BATCH_SIZE, forward=compute / 3, backward=2 * compute / 3,
                    optimizer=optimizer, other=0.0, grad_bytes=4 * p, param_bytes=4 * p, bucket_bytes=25 * 2**20,
                    layers=MPNET["layers"], root_fraction=root,
                    source=f"{reference.SOURCE}, single row: {reference.ONE_GPU:.0f} samples/s",
                    notes=(f"optimizer: fused AdamW moves {ADAMW_BYTES_PER_PARAM} B per parameter at the V100's "
                           f"{V100_HBM_BYTES_PER_S / 1e9:.0f} GB/s HBM2 (datasheet); forward:backward 1:2 (FLOPs)",
                           "gradients and parameters travel in fp32 (mixed precision keeps fp32 master copies)"))


def check(host_fraction=None) -> list:
    """One dict per row of their table: published and predicted samples/s and speed-up, and the error."""
    from . import predict

    pred = predict(None, devices=[reference.GPUS], link=LINK, strategies=STRATEGIES, measured=measured(),
                   host_fraction=host_fraction)
    rows = []
    for s in STRATEGIES:
        row = pred.row(s, reference.devices(s))
        published = reference.SAMPLES_PER_SECOND[s]
        rows.append({"strategy": s, "devices": reference.devices(s), "published": published,
                     "predicted": row["samples_per_second"],
                     "published_speedup": published / reference.ONE_GPU,
                     "predicted_speedup": row["speedup"],
                     "error": row["samples_per_second"] / published - 1,
                     "comm_exposed_ms": row["comm_exposed_ms"], "step_ms": row["step_ms"],
                     "would_match": would_match(s, published) if reference.devices(s) > 1 else "(the input)"})
    return rows, pred.assumptions


def would_match(strategy: str, published: float) -> str:
    """What the row would need to match (an explanation of the miss, never used to predict): the link
    bandwidth for DDP and FSDP, the host share for DP."""
    from dataclasses import replace

    from . import predict
    from .links import GB, PRESETS

    def sps(**kw):
        link = replace(PRESETS[LINK], bandwidth=kw.pop("bw")) if "bw" in kw else LINK
        pred = predict(None, devices=[reference.GPUS], link=link, strategies=[strategy], measured=measured(), **kw)
        return pred.row(strategy, reference.devices(strategy))["samples_per_second"]

    from .. import strategies

    key = strategies.get(strategy).miss_term
    if key == "host_fraction":
        lo, hi, unit = 0.0, 1.0, "the host busy {:.0%} of a single step (GIL-serialised)"
    else:
        lo, hi, unit = 0.1 * GB, 1000 * GB, "{:.0f} GB/s per direction"
    ask = (lambda v: sps(host_fraction=v)) if key == "host_fraction" else (lambda v: sps(bw=v))
    if not min(ask(lo), ask(hi)) <= published <= max(ask(lo), ask(hi)):
        return "nothing in range: the miss is not this term"
    for _ in range(60):  # bisection: samples/s falls as the host share grows, rises with bandwidth
        mid = (lo + hi) / 2
        too_fast = ask(mid) > published
        if (key == "host_fraction") == too_fast:
            lo = mid
        else:
            hi = mid
    value = (lo + hi) / 2
    return unit.format(value if key == "host_fraction" else value / GB)


def markdown(rows, assumptions) -> str:
    lines = ["| strategy | devices | published samples/s | predicted samples/s | published speed-up | "
             "predicted speed-up | error | it would match with |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['devices']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['published_speedup']:.2f} | {r['predicted_speedup']:.2f} | {r['error']:+.0%} | {r['would_match']} |")
    return "\n".join(lines) + "\n\nAssumptions:\n\n" + "\n".join(f"- {a}" for a in assumptions) + "\n"


def refresh_doc(path) -> bool:
    """Rewrite the block between ``<!-- seed-table -->`` and ``<!-- /seed-table -->`` in ``path``
    with the current table. Returns True when it changed."""
    import re
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    block = "<!-- seed-table -->\n" + markdown(*check()) + "<!-- /seed-table -->"
    new = re.sub(r"<!-- seed-table -->\n.*?<!-- /seed-table -->", lambda _: block, text, flags=re.S)
    if new != text:
        path.write_text(new)
    return new != text
