"""Pipeline parallelism (PP) inside each rank: one stage of the encoder's layers, a schedule, timing.

Stage s holds a contiguous run of layers (the first also the embeddings, the last also pooling and
normalisation) and sends its activations to stage s+1 with ``torch.distributed.pipelining``. The
batch is cut into m microbatches; GPipe runs all forwards then all backwards, 1F1B alternates
once the pipe is full (less activation memory, the same bubble). While the pipe fills and drains a
stage waits: the bubble, ideally (p-1)/(m+p-1) of the step for p stages.

MNRL and pipelines: the pipeline calls its loss once per microbatch, but MNRL compares every
anchor with every positive of the batch. Two ways, both here (``loss=``):

* 'per_microbatch': the loss of each microbatch uses only its own B/m pairs as negatives: a smaller
  effective batch (a different, usually weaker, loss); the rows are ordered so that each microbatch
  holds its anchors and their positives.
* 'full_batch' (default): two passes, the GradCache idea. Pass 1 runs forward only and collects all
  2B embeddings at the last stage, which computes the full-batch MNRL and its gradient G with
  respect to the embeddings. Pass 2 runs the schedule with the per-microbatch loss <e_k, G_k>, whose
  gradient is exactly G_k: the full-batch gradient, at the cost of one more forward.
"""

from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from .single import encode, load, max_diff, mnrl, mnrl_per_microbatch

SCHEDULES = ("gpipe", "1f1b")
LOSSES = ("full_batch", "per_microbatch")


def check_options(jobs: list, loss: str, stages: int) -> None:
    """jobs: [(schedule, microbatches), ...]"""
    if loss not in LOSSES:
        raise ConfigError(f"loss {loss!r}: use one of {list(LOSSES)}")
    for schedule, m in jobs:
        if schedule not in SCHEDULES:
            raise ConfigError(f"schedule {schedule!r}: use one of {list(SCHEDULES)}")
        if schedule == "1f1b" and m < stages:
            raise ConfigError(f"1F1B with {m} microbatches for {stages} stages: torch's Schedule1F1B needs at least as "
                              f"many microbatches as stages (with fewer it is GPipe). Fix: microbatches >= {stages}, "
                              "or schedule 'gpipe'")


class Stage(torch.nn.Module):
    """Layers ``layers`` of a BERT-style SentenceTransformer; the first stage embeds, the last pools."""

    def __init__(self, model, layers: range):
        super().__init__()
        bert = model[0].auto_model
        self.config = bert.config
        self.first, self.last = layers.start == 0, layers.stop == len(bert.encoder.layer)
        self.embeddings = bert.embeddings if self.first else None
        self.layers = torch.nn.ModuleList(bert.encoder.layer[i] for i in layers)
        self.tail = torch.nn.ModuleList(list(model)[1:]) if self.last else None  # Pooling, Normalize
        self.dim = model.get_sentence_embedding_dimension()

    def forward(self, x, attention_mask, token_type_ids=None):
        from transformers.masking_utils import create_bidirectional_mask

        if self.first:
            x = self.embeddings(input_ids=x, token_type_ids=token_type_ids)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask)
        for layer in self.layers:
            x = layer(x, mask)
        if not self.last:
            return x
        features = {"token_embeddings": x, "attention_mask": attention_mask}
        for module in self.tail:
            features = module(features)
        return features["sentence_embedding"]


def timed_stage(module, index: int, stages: int):
    """A PipelineStage that records when each microbatch's forward and backward ran on this rank."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        events: list = []

        def forward_one_chunk(self, chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().forward_one_chunk(chunk, *args, **kwargs)
            self.events.append(("F", chunk, t0, time.perf_counter()))
            return out

        def backward_one_chunk(self, chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().backward_one_chunk(chunk, *args, **kwargs)
            self.events.append(("B", chunk, t0, time.perf_counter()))
            return out

    stage = TimedStage(module, index, stages, torch.device("cpu"))
    stage.events = []
    return stage


def row_order(pairs: int, microbatches: int) -> torch.Tensor:
    """Rows so that microbatch k holds anchors k*b..(k+1)*b-1 and then their positives (b = pairs/m)."""
    b = pairs // microbatches
    return torch.cat([torch.cat([torch.arange(k * b, (k + 1) * b), pairs + torch.arange(k * b, (k + 1) * b)])
                      for k in range(microbatches)])


def one_step(schedule, stage, features: dict, loss_kind: str, m: int) -> tuple:
    """One training step of this rank: (loss or None, embeddings or None, seconds of the schedule's F+B pass)."""
    ids, kw = features["input_ids"], {k: v for k, v in features.items() if k != "input_ids"}
    pairs = len(ids) // 2
    args = (ids,) if stage.is_first else ()
    if loss_kind == "per_microbatch":
        losses = []
        stage.events.clear()
        t0 = time.perf_counter()
        out = schedule.step(*args, **kw, losses=losses, target=torch.zeros(2 * pairs)) if stage.is_last \
            else schedule.step(*args, **kw)  # the target is unused: the pairs are in the microbatch itself
        took = time.perf_counter() - t0
        if not stage.is_last:
            return None, None, took
        return sum(x.item() for x in losses), out.detach(), took
    # pass 1: forward only; the last stage gets all embeddings (its loss_fn sees a zero target: no effect)
    emb = schedule.eval(*args, **kw, target=torch.zeros(2 * pairs, stage.submod.dim)) if stage.is_last \
        else schedule.eval(*args, **kw)
    target = loss = None
    if stage.is_last:
        emb = emb.detach().requires_grad_()
        loss = mnrl(emb[:pairs], emb[pairs:])
        loss.backward()
        target = emb.grad                           # dLoss/dEmbeddings of the whole batch
    stage.events.clear()
    t0 = time.perf_counter()
    schedule.step(*args, **kw, target=target) if stage.is_last else schedule.step(*args, **kw)  # pass 2
    took = time.perf_counter() - t0
    return (loss.item(), emb.detach(), took) if stage.is_last else (None, None, took)


def run_job(path: str, split: list, job: dict, batches: list, refs: dict, lr: float, loss_kind: str) -> dict:
    """Build this rank's stage from a fresh model and train one step per batch."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    rank, m = dist.get_rank(), job["microbatches"]
    model = load(path)
    stage = timed_stage(Stage(model, split[rank]), rank, len(split))
    per_mb = loss_kind == "per_microbatch"
    loss_fn = (lambda out, _t: mnrl(out[:len(out) // 2], out[len(out) // 2:]) / m) if per_mb \
        else (lambda out, grad: (out * grad).sum())
    make = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[job["schedule"]]
    schedule = make(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    params = list(stage.submod.parameters())
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    ref = refs[m if per_mb else 1]
    mine = {id(p) for p in params}
    out = dict(job, rank=rank, layers=list(split[rank]), losses=[], step_s=[], local_params=sum(p.numel() for p in params))
    for i, features in enumerate(batches):
        pairs = len(features["input_ids"]) // 2
        order = row_order(pairs, m) if per_mb else torch.arange(2 * pairs)
        t0 = time.perf_counter()
        loss, emb, took = one_step(schedule, stage, {k: v[order] for k, v in features.items()}, loss_kind, m)
        out.setdefault("total_s", []).append(time.perf_counter() - t0)
        out["step_s"].append(took)
        out["events"] = list(stage.events)         # the last step's timeline
        if i == 0:
            named = [(n, p) for n, p in model.named_parameters() if id(p) in mine and p.grad is not None]
            out["grad_diff"] = max(max_diff(p.grad, ref["grads"][n]) for n, p in named)
            out["grads_compared"] = len(named)
            if emb is not None:
                restored = torch.empty_like(emb)
                restored[order] = emb
                out["embedding_diff"] = max_diff(restored, ref["embeddings"])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            out["losses"].append(loss)
    return out


def rank_main(path: str, split: list, jobs: list, batches: list, refs: dict, lr: float, loss_kind: str) -> list:
    return [run_job(path, split, job, batches, refs, lr, loss_kind) for job in jobs]


def merge(ranks: list, jobs: list, refs: dict, loss_kind: str) -> list:
    """One dict per job from every stage's view: the last stage's loss and embeddings, all stages' gradients."""
    runs = []
    for j, job in enumerate(jobs):
        per_stage = [r[j] for r in ranks]
        last = per_stage[-1]
        ref = refs[job["microbatches"] if loss_kind == "per_microbatch" else 1]
        runs.append(dict(job, stages=per_stage, losses=last["losses"], reference_losses=ref["losses"],
                         loss_diff=max(abs(a - b) for a, b in zip(last["losses"], ref["losses"])),
                         embedding_diff=last["embedding_diff"],
                         grad_diff=max(s["grad_diff"] for s in per_stage),
                         grads_compared=sum(s["grads_compared"] for s in per_stage),
                         grads_expected=len(ref["grads"])))
    return runs


def idle_fraction(stage: dict) -> float:
    """1 - (time in this stage's forward and backward) / (the step's time), over the last step."""
    busy = sum(t1 - t0 for _k, _c, t0, t1 in stage["events"])
    return 1.0 - busy / stage["step_s"][-1]


def summary(run: dict, stages: int) -> dict:
    m = run["microbatches"]
    row = dict(schedule=run["schedule"], microbatches=m, loss=run["losses"][-1],
               loss_diff=run["loss_diff"], embedding_diff=run["embedding_diff"], grad_diff=run["grad_diff"],
               schedule_ms=1000 * max(s["step_s"][-1] for s in run["stages"]),
               step_ms=1000 * max(s["total_s"][-1] for s in run["stages"]),
               bubble_formula=(stages - 1) / (m + stages - 1))
    for s in run["stages"]:
        row[f"idle_stage{s['rank']}"] = idle_fraction(s)
    return row
