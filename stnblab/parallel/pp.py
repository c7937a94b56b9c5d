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
from dataclasses import dataclass

import torch

from stnb.errors import ConfigError, VerificationError
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


def timed_stage(module, index: int, stages: int, group=None):
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

    stage = TimedStage(module, index, stages, torch.device("cpu"), group=group)
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


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged: dp pipelines (replicas) x pp stages x tp shards per stage (3D when all > 1)."""
    dp: int = 1
    pp: int = 2
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


def replica_rows(pairs: int, dp: int, d: int) -> torch.Tensor:
    """Rows of replica d: its anchors, then their positives (each replica gets pairs/dp pairs)."""
    r = pairs // dp
    return torch.cat([torch.arange(d * r, (d + 1) * r), pairs + torch.arange(d * r, (d + 1) * r)])


def build_stage(path: str, split: list, mesh, shape, plan: dict):
    """This rank's model and pipeline stage; with a TP dimension its layers are sharded first (and checked)."""
    from .tp import apply, check_layout

    s, tp = mesh["pp"].get_local_rank(), mesh["tp"].size()
    model = load(path)
    if tp > 1:
        apply(model, mesh["tp"], shape, {k: v for k, v in plan.items() if int(k.split(".")[0]) in split[s]})
        problems = check_layout(model, shape, tp, layers=split[s])
        if problems:
            raise VerificationError("the tensor-parallel shards of this stage are not the plan: " + "; ".join(problems))
    return model, timed_stage(Stage(model, split[s]), s, len(split), mesh["pp"].get_group())


def run_job(mesh, path: str, split: list, job: dict, batches: list, refs: dict, lr: float, loss_kind: str,
            shape, plan: dict) -> dict:
    """Build this rank's stage from a fresh model and train one step per batch."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from .tp import local_part

    m, dp, tp = job["microbatches"], mesh["dp"].size(), mesh["tp"].size()
    d, s, t = (mesh[k].get_local_rank() for k in ("dp", "pp", "tp"))
    model, stage = build_stage(path, split, mesh, shape, plan)
    per_mb = loss_kind == "per_microbatch"
    loss_fn = (lambda out, _t: mnrl(out[:len(out) // 2], out[len(out) // 2:]) / m) if per_mb \
        else (lambda out, grad: (out * grad).sum())
    make = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[job["schedule"]]
    schedule = make(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    params = list(stage.submod.parameters())
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    ref = refs[dp * m if per_mb else dp]   # replicas average their own losses, as DDP does
    mine = {id(p) for p in params}
    out = dict(job, rank=dist.get_rank(), replica=d, stage=s, shard=t, layers=list(split[s]), losses=[], step_s=[],
               total_s=[], local_params=sum(getattr(p, "to_local", lambda: p)().numel() for p in params))
    for i, features in enumerate(batches):
        pairs = len(features["input_ids"]) // 2
        rows = replica_rows(pairs, dp, d)
        order = rows[row_order(pairs // dp, m)] if per_mb else rows
        t0 = time.perf_counter()
        loss, emb, took = one_step(schedule, stage, {k: v[order] for k, v in features.items()}, loss_kind, m)
        if dp > 1:  # data parallel across replicas: average the gradients (and the loss) of this stage's copies
            for p in params:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(local, group=mesh["dp"].get_group())
                local /= dp
            if loss is not None:
                total = torch.tensor([loss])
                dist.all_reduce(total, group=mesh["dp"].get_group())
                loss = total.item() / dp
        out["total_s"].append(time.perf_counter() - t0)
        out["step_s"].append(took)
        out["events"] = list(stage.events)         # the last step's timeline
        if i == 0:
            named = [(n, p) for n, p in model.named_parameters() if id(p) in mine and p.grad is not None]
            out["grad_diff"] = max(max_diff(*local_part(ref["grads"][n], p.grad, t, tp)) for n, p in named)
            out["grads_compared"] = len(named)
            if emb is not None:  # row j of this pipeline's output is row order[j] of the batch
                out["embedding_diff"] = max_diff(emb, ref["embeddings"][order])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            out["losses"].append(loss)
    return out


def rank_main(layout: Layout, path: str, split: list, jobs: list, batches: list, refs: dict, lr: float,
              loss_kind: str, shape, plan: dict) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (layout.dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
    return [run_job(mesh, path, split, job, batches, refs, lr, loss_kind, shape, plan) for job in jobs]


def per_job(ranks: list, jobs: list, refs: dict, loss_kind: str, layout: Layout) -> list:
    """One dict per job from every rank's view: the last stage's loss and embeddings, all ranks' gradients.
    ``stages`` keeps replica 0's shard 0 of each stage (its timeline and idle time)."""
    runs = []
    for j, job in enumerate(jobs):
        views = [r[j] for r in ranks]
        stages = sorted((v for v in views if v["replica"] == 0 and v["shard"] == 0), key=lambda v: v["stage"])
        last = [v for v in views if v["stage"] == layout.pp - 1]
        m = job["microbatches"]
        ref = refs[layout.dp * m if loss_kind == "per_microbatch" else layout.dp]
        runs.append(dict(job, stages=stages, losses=last[0]["losses"], reference_losses=ref["losses"],
                         loss_diff=max(abs(a - b) for v in last for a, b in zip(v["losses"], ref["losses"])),
                         embedding_diff=max(v["embedding_diff"] for v in last),
                         grad_diff=max(v["grad_diff"] for v in views),
                         grads_compared=sum(v["grads_compared"] for v in stages),
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
        row[f"idle_stage{s['stage']}"] = idle_fraction(s)
    return row


def timeline(run: dict):
    """The last step's forward / backward of every microbatch on every stage, in ms from the step's first one
    (perf_counter is the machine's monotonic clock, the same in every process)."""
    import pandas as pd

    rows = [dict(stage=f"stage {s['stage']}", kind={"F": "forward", "B": "backward"}[k], microbatch=c, start=t0, end=t1)
            for s in run["stages"] for k, c, t0, t1 in s["events"]]
    df = pd.DataFrame(rows)
    zero = df.start.min()
    return df.assign(start_ms=1000 * (df.start - zero), ms=1000 * (df.end - df.start),
                     schedule=f"{run['schedule']}, {run['microbatches']} microbatches").drop(columns=["start", "end"])
