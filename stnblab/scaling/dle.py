"""A second published table the predictor was not built from: NVIDIA DeepLearningExamples' BERT fine-tuning
throughput on a DGX-1 (8x V100 16G), 1, 4 and 8 GPUs, predicted from each setup's 1-GPU row.

Source (their numbers, never measured by stnb): github.com/NVIDIA/DeepLearningExamples,
PyTorch/LanguageModeling/BERT/README.md (commit 23a6382cbe8f77c22b0a7b7d263191ee6b947dfa), "Fine-tuning
NVIDIA DGX-1 With 16G": run_squad.sh in the pytorch:19.07-py3 NGC container, sequences/s averaged over a
predefined number of training iterations. Their setup, from the README and run_squad.py (commit
0663b67c1afe9979c9767ed63c7e719b1d0629b9): BERT-large (24 layers, hidden 1024, 16 heads, feed-forward 4096;
the pooler is not trained), SQuAD v1.1 features of a fixed length (384 tokens, the README's fine-tuning
sequence length), one call of the model per step; mixed precision is apex AMP O2 (an fp16 model, fp32
master weights) with apex FusedAdam (max_grad_norm 1.0), FP32 is BertAdam (a per-parameter loop, with
clipping); several GPUs run apex.parallel.DistributedDataParallel (gradient buckets of its default
message_size, 10M elements, all-reduced in the gradients' dtype while backward runs) — DDP's step model.

The inputs with their ranges, the same for every row: the link ``nvlink-v100`` (DGX-1's hybrid cube mesh;
4 GPUs are one quad); the optimizer's bytes per parameter through the V100's 900 GB/s HBM2 (FusedAdam
under AMP O2: 28 for the fused update alone, 36 with O2's unscaling of the fp16 gradients into fp32 master
gradients and the fp16 copy of the weights, 44 with the gradient norm and the overflow check; BertAdam in
FP32: about 116 with clipping, the two moments, the update and weight decay as separate kernels, +-20); a
rank's step spread 0 to 1% of the step (fixed-length features: only the clocks and the host vary);
forward:backward 1:2.
"""

from __future__ import annotations

from stnb.scaling.model import Measured, Range, Uncertain
from .seed import V100_HBM_BYTES_PER_S, split

URL = ("https://github.com/NVIDIA/DeepLearningExamples/blob/23a6382cbe8f77c22b0a7b7d263191ee6b947dfa/PyTorch/"
       "LanguageModeling/BERT/README.md#fine-tuning-nvidia-dgx-1-with-16g")
SOURCE = "NVIDIA DeepLearningExamples BERT-large fine-tuning, DGX-1 (8x V100 16G)"
LINK = "nvlink-v100"
STRATEGY = "ddp"  # apex.parallel.DistributedDataParallel: buckets all-reduced during backward
BERT_LARGE = {"vocab": 30522, "hidden": 1024, "layers": 24, "ffn": 4096, "positions": 512, "token_types": 2}
MESSAGE_SIZE = 10_000_000  # apex DDP's default bucket, in elements
STEP_SPREAD = (0.0, 0.005, 0.01)

# (setup, batch per GPU, bytes per gradient, optimizer bytes per parameter (low, mid, high), {GPUs: sequences/s})
TABLE = (
    ("mixed precision, batch 4", 4, 2, (28, 36, 44), {1: 35.88, 4: 120.00, 8: 227.84}),
    ("mixed precision, batch 10", 10, 2, (28, 36, 44), {1: 45.2, 4: 163.6, 8: 327.2}),
    ("FP32, batch 4", 4, 4, (96, 116, 136), {1: 8.96, 4: 31.04, 8: 64.64}),
)


def shape() -> tuple:
    """(trained parameters, the embeddings' share) of BertForQuestionAnswering-large without its pooler."""
    c = BERT_LARGE
    h, f = c["hidden"], c["ffn"]
    embeddings = (c["vocab"] + c["positions"] + c["token_types"]) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h
    params = embeddings + c["layers"] * layer + 2 * h + 2  # + the span head
    return params, embeddings / params


def measured(setup: str) -> Uncertain:
    """One setup's 1-GPU row as one device's step, with the ranges above."""
    _, batch, grad_size, opt_bytes, rows = next(t for t in TABLE if t[0] == setup)
    params, root = shape()
    step = batch / rows[1]
    ranges = (Range("optimizer", *opt_bytes, "optimizer bytes per parameter",
                    f"at the V100's {V100_HBM_BYTES_PER_S / 1e9:.0f} GB/s HBM2"),
              Range("spread", *(x * step for x in STEP_SPREAD), "a rank's step spread (s)",
                    "0 to 1% of the step: fixed-length features"))

    def build(values):
        fwd, bwd, opt = split(step, params, values["optimizer"])
        return Measured(batch=batch, forward=fwd, backward=bwd, optimizer=opt, other=0.0,
                        grad_bytes=grad_size * params, param_bytes=grad_size * params,
                        bucket_bytes=MESSAGE_SIZE * grad_size, layers=BERT_LARGE["layers"], root_fraction=root,
                        forward_calls=1, step_spread=values["spread"], fits=True,
                        source=f"{SOURCE}, {setup}, 1 GPU: {rows[1]:g} sequences/s",
                        notes=(f"gradients all-reduced in {grad_size * 8}-bit, apex DDP buckets of "
                               f"{MESSAGE_SIZE:,} elements",))

    return Uncertain(ranges, build)


def check() -> tuple:
    """One dict per multi-GPU row of their table (predicted from the same setup's 1-GPU row), and the
    assumptions of each setup's prediction."""
    from stnb.scaling import predict

    rows, notes = [], []
    for setup, _, _, _, published in TABLE:
        pred = predict(None, devices=[n for n in published if n > 1], link=LINK, strategies=[STRATEGY],
                       measured=measured(setup))
        notes.append((setup, pred.assumptions))
        for n, value in published.items():
            if n == 1:
                continue
            row = pred.row(STRATEGY, n)
            rows.append({"table": f"DLE BERT-large, {setup}", "strategy": STRATEGY, "devices": n,
                         "published": value, "low": row["low"], "predicted": row["samples_per_second"],
                         "high": row["high"], "dominant": row["dominant"], "suspect": row["suspect"],
                         "input": published[1]})
    return rows, notes
