"""The predictor against the sentence-transformers documentation's 4x V100 table, row by row.

The only measured input is their single-GPU row (``stnb.reference``: 2724 samples/s, batch 32 of
microsoft/mpnet-base). Everything else is a stated input with its range, the same for every row:

* link: ``nvlink-v100-4`` (a p3.8xlarge is one quad of the DGX-1's hybrid cube mesh; its bus bandwidth
  from the link count and NCCL's protocol efficiency, ``stnb.scaling.links``);
* the single step's split: the optimizer's update streams its bytes per parameter through the V100's
  HBM2 (900 GB/s, V100 datasheet): the trainer's default AdamW (``adamw_torch``: torch.optim.AdamW,
  foreach, not fused) moves about 72 B/param (low), with the trainer's default gradient clipping
  (max_grad_norm 1.0: the norm reads the gradients, the scaling reads and writes them) 84 (mid), and
  with fp16 mixed precision's unscaling (reads and writes the gradients, checks them for inf) 96
  (high), capped so that forward and backward keep at least a tenth of the step; the rest is
  forward:backward = 1:2 (their FLOPs);
* model calls per step: 2 (SoftmaxLoss and CosineSimilarityLoss embed each of their two text columns in
  its own call);
* a rank's step spread: 0 to 5% of the step (NLI and STS batches padded to their longest text; not
  published), mid 2.5%;
* DataParallel's host share: 0.25 to 0.75 of forward+backward (eager PyTorch launching a ~10 ms step's
  kernels; not measured), mid 0.5;
* gradients and parameters in fp32 (mixed precision keeps fp32 master weights and gradients);
* mpnet-base's shape from its config.json (vocab 30527, hidden 768, 514 positions, 12 layers):
  the FSDP root holds the embeddings.

No constant is chosen per row. ``check()`` returns one dict per row with the interval and the error;
``python -m stnblab.scaling.check`` prints it with the other published table and ``docs/scaling.md`` holds it.
"""

from __future__ import annotations

from stnb import reference
from stnb.scaling.model import Measured, Range, Uncertain

V100_HBM_BYTES_PER_S = 900e9          # NVIDIA V100 datasheet: HBM2 900 GB/s
ADAMW_BYTES_PER_PARAM = (72, 84, 96)  # foreach AdamW; + clipping; + fp16 unscaling (see above)
MIN_COMPUTE_SHARE = 0.1               # forward and backward keep at least this share of the step
FORWARD_CALLS = 2                     # two text columns, one call each
STEP_SPREAD = (0.0, 0.025, 0.05)      # a rank's step standard deviation, share of the step
HOST_FRACTION = (0.25, 0.5, 0.75)     # DataParallel's host share of forward+backward
MPNET = {"vocab": 30527, "hidden": 768, "positions": 514, "layers": 12}  # microsoft/mpnet-base config.json
LINK = "nvlink-v100-4"
STRATEGIES = tuple(reference.SAMPLES_PER_SECOND)  # the rows of their table


def split(step, params, bytes_per_param, hbm=V100_HBM_BYTES_PER_S, share=MIN_COMPUTE_SHARE) -> tuple:
    """(forward, backward, optimizer) seconds of a single step whose optimizer streams ``bytes_per_param``
    through memory at ``hbm``; forward and backward keep at least ``share`` of the step, 1:2."""
    optimizer = min(bytes_per_param * params / hbm, (1 - share) * step)
    compute = step - optimizer
    return compute / 3, 2 * compute / 3, optimizer


def measured() -> Uncertain:
    """Their single-GPU row as one device's step, with the ranges above."""
    p = reference.MODEL_PARAMETERS
    step = reference.PER_DEVICE_BATCH_SIZE / reference.ONE_GPU
    h = MPNET["hidden"]
    root = (MPNET["vocab"] + MPNET["positions"]) * h / p  # embeddings (and the small rest) outside the layers
    ranges = (Range("optimizer", *ADAMW_BYTES_PER_PARAM, "optimizer bytes per parameter",
                    "foreach AdamW 72; + gradient clipping 84; + fp16 unscaling 96; at the V100's 900 GB/s HBM2"),
              Range("spread", *(x * step for x in STEP_SPREAD), "a rank's step spread (s)",
                    "0 to 5% of the step, not published"))

    def build(values):
        fwd, bwd, opt = split(step, p, values["optimizer"])
        return Measured(batch=reference.PER_DEVICE_BATCH_SIZE, forward=fwd, backward=bwd, optimizer=opt, other=0.0,
                        grad_bytes=4 * p, param_bytes=4 * p, bucket_bytes=25 * 2**20, layers=MPNET["layers"],
                        root_fraction=root, forward_calls=FORWARD_CALLS, step_spread=values["spread"], fits=True,
                        source=f"{reference.SOURCE}, single row: {reference.ONE_GPU:.0f} samples/s",
                        notes=("forward:backward 1:2 (FLOPs); the optimizer streams its bytes through HBM2 at the "
                               "datasheet's 900 GB/s",
                               "gradients and parameters travel in fp32 (mixed precision keeps fp32 master copies)",
                               "model calls per step: 2 (SoftmaxLoss and CosineSimilarityLoss: one call per text "
                               "column)"))

    return Uncertain(ranges, build)


def check(host_fraction=None) -> tuple:
    """One dict per row of their table (the interval, the all-mid prediction, the dominant input, the
    suspect flag), and the prediction's assumptions."""
    from stnb.scaling import predict

    pred = predict(None, devices=[reference.GPUS], link=LINK, strategies=STRATEGIES, measured=measured(),
                   host_fraction=HOST_FRACTION if host_fraction is None else host_fraction)
    rows = []
    for s in STRATEGIES:
        row = pred.row(s, reference.devices(s))
        rows.append({"table": "sentence-transformers docs, mpnet-base", "strategy": s,
                     "devices": reference.devices(s), "published": reference.SAMPLES_PER_SECOND[s],
                     "low": row["low"], "predicted": row["samples_per_second"], "high": row["high"],
                     "dominant": row["dominant"], "suspect": row["suspect"], "input": reference.ONE_GPU})
    return rows, pred.assumptions


def would_match(strategy: str, published: float) -> str:
    """What the row would need to match (an explanation of the miss, never used to predict): the link
    bandwidth for DDP and FSDP, the host share for DP."""
    from dataclasses import replace

    from stnb.scaling import predict
    from stnb.scaling.links import GB, PRESETS

    def sps(**kw):
        link = (replace(PRESETS[LINK], bandwidth=kw.pop("bw"), bandwidth_range=None, tiers=()) if "bw" in kw
                else LINK)
        kw.setdefault("host_fraction", HOST_FRACTION)
        pred = predict(None, devices=[reference.GPUS], link=link, strategies=[strategy], measured=measured(), **kw)
        return pred.row(strategy, reference.devices(strategy))["samples_per_second"]

    from stnb import strategies

    key = strategies.get(strategy).miss_term
    if key == "host_fraction":
        lo, hi, unit = 0.0, 1.0, "the host busy {:.0%} of forward+backward (GIL-serialised)"
    else:
        lo, hi, unit = 0.1 * GB, 1000 * GB, "a bus bandwidth of {:.0f} GB/s"
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
