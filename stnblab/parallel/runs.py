"""One TP or PP run from a notebook cell: refuse bad input, run the reference, launch, compare.

Both return a result whose numbers are measured (the reference in this process, the parallel run on
CPU gloo ranks started by ``stnb.launch``) and raise ``VerificationError`` when the parallel run
differs from the reference by more than ``TOLERANCE`` or when TP's shards are not the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stnb.errors import ConfigError, VerificationError
from stnb.hardware import capacity_problem
from stnb.processes import launch
from stnb.models import resolve_model
from .oversubscribe import launch_oversubscribed
from .plans import check_pp, check_tp, layer_plan, model_shape, split_layers
from .pp import Layout, check_options, per_job, summary
from .pp import rank_main as pp_rank
from .tp import rank_main as tp_rank
from .single import make_batches, reference

#: max abs difference allowed against the single-process reference (fp32; measured values are ~1e-7)
TOLERANCE = dict(embeddings=1e-5, grads=1e-5, loss=1e-5)


@dataclass
class TPResult:
    degree: int
    plan: dict
    ranks: list
    reference: dict = field(repr=False)

    @property
    def embedding_diff(self) -> float:
        return max(r["embedding_diff"] for r in self.ranks)

    @property
    def grad_diff(self) -> float:
        return max(r["grad_diff"] for r in self.ranks)

    @property
    def loss_diff(self) -> float:
        return max(abs(a - b) for r in self.ranks for a, b in zip(r["losses"], self.reference["losses"]))

    def comm(self) -> dict:
        """Collectives of one training step (forward + backward) on rank 0: counts and payload bytes."""
        return self.ranks[0]["comm"]


def tensor_parallel(model: str = "tiny", degree: int = 2, pairs: int = 8, steps: int = 3, lr: float = 1e-4,
                    plan: dict | None = None, seed: int = 0, timeout: float = 600) -> TPResult:
    """Train ``steps`` MNRL steps with the encoder split over ``degree`` CPU ranks; check against one process.

    plan: overrides of the architecture's plan, {'<layer>.<module>' pattern: 'colwise' | 'rowwise' | None}
        (see ``stnblab.parallel.plans.layer_plan``); the shards are always checked against the architecture's plan.
    """
    path = resolve_model(model)
    shape = model_shape(path)
    check_tp(shape, degree)
    if capacity_problem("cpu", degree, "degree"):
        raise ConfigError(capacity_problem("cpu", degree, "degree"))
    per_layer = layer_plan(shape, plan)
    batches = make_batches(path, pairs, steps, seed)
    ref = reference(path, batches, lr, threads=1)
    ranks = launch(tp_rank, path, shape, per_layer, batches, ref, lr, num_processes=degree, device="cpu",
                   echo=False, timeout=timeout)
    problems = sorted({p for r in ranks for p in r["problems"]})
    if problems:
        raise VerificationError(f"the tensor-parallel shards are not the plan ({len(problems)} problems): "
                                + "; ".join(problems[:8]))
    result = TPResult(degree=degree, plan=per_layer, ranks=ranks, reference=ref)
    _within(dict(embeddings=result.embedding_diff, grads=result.grad_diff, loss=result.loss_diff), "TP")
    return result


def _within(diffs: dict, what: str) -> None:
    over = {k: v for k, v in diffs.items() if not v <= TOLERANCE[k]}
    if over:
        raise VerificationError(f"{what} differs from the single-process reference: "
                                + ", ".join(f"{k} max abs diff {v:.3g} > {TOLERANCE[k]:g}" for k, v in over.items()))


@dataclass
class PPResult:
    stages: int
    layers: list
    runs: list          # one dict per (schedule, microbatches)
    references: dict = field(repr=False)   # chunks -> reference whose loss is the mean MNRL over that many chunks
    layout: Layout = field(default_factory=Layout)

    def table(self):
        """One row per run: losses vs reference, max diffs, step time, idle fraction per stage vs the formula."""
        import pandas as pd

        return pd.DataFrame([summary(r, self.stages) for r in self.runs])


#: GPipe at 1, 2, 4 microbatches; 1F1B from 2 (torch's Schedule1F1B needs microbatches >= stages)
PP_RUNS = (("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4))


def pipeline_parallel(model: str = "tiny", stages: int = 2, runs=PP_RUNS, pairs: int = 8, steps: int = 3,
                      lr: float = 1e-4, loss: str = "full_batch", data_parallel: int = 1, tensor_parallel: int = 1,
                      oversubscribe: bool = False, seed: int = 0, timeout: float = 600) -> PPResult:
    """Train ``steps`` MNRL steps with the encoder's layers split into ``stages`` CPU ranks, once per
    (schedule, microbatches) in ``runs``; check each against one process.

    loss: 'full_batch' (every anchor sees all B positives of its pipeline: two passes, see
        ``stnblab.parallel.pp``) or 'per_microbatch' (the pipeline's own loss: B/m pairs per in-batch softmax).
    data_parallel: pipelines side by side (DP+PP), each with pairs/data_parallel pairs; their gradients
        are averaged, as DDP does (each replica's MNRL sees its own pairs, like stnb's DDP).
    tensor_parallel: each stage's layers sharded over this many ranks (with data_parallel > 1: 3D).
    Ranks: data_parallel x stages x tensor_parallel, started by ``stnb.launch`` (one core each), or with
    oversubscribe=True by ``stnblab.parallel.oversubscribe`` (any number of ranks: correct, but not timings).
    """
    path = resolve_model(model)
    shape = model_shape(path)
    runs = [(str(s), m) for s, m in runs]
    layout = Layout(dp=data_parallel, pp=stages, tp=tensor_parallel)
    check_layout_request(shape, layout, pairs, [m for _s, m in runs], oversubscribe)
    check_options(runs, loss, stages)
    split = split_layers(shape.layers, stages)
    plan = layer_plan(shape) if tensor_parallel > 1 else {}
    batches = make_batches(path, pairs, steps, seed)
    chunks = {1, data_parallel} | ({data_parallel * m for _s, m in runs} if loss == "per_microbatch" else set())
    refs = {c: reference(path, batches, lr, microbatches=c, threads=1) for c in sorted(chunks)}
    jobs = [dict(schedule=s, microbatches=m) for s, m in runs]
    start = launch_oversubscribed if oversubscribe else launch
    ranks = start(pp_rank, layout, path, split, jobs, batches, refs, lr, loss, shape, plan,
                  num_processes=layout.world, device="cpu", echo=False, timeout=timeout)
    merged = per_job(ranks, jobs, refs, loss, layout)
    result = PPResult(stages=stages, layers=[list(r) for r in split], runs=merged, references=refs, layout=layout)
    for r in merged:
        what = f"PP ({r['schedule']}, {r['microbatches']} microbatches)"
        if r["grads_compared"] != r["grads_expected"]:
            raise VerificationError(f"{what}: the stages hold gradients for {r['grads_compared']} tensors, the "
                                    f"reference for {r['grads_expected']}")
        _within(dict(embeddings=r["embedding_diff"], grads=r["grad_diff"], loss=r["loss_diff"]), what)
    return result


def check_layout_request(shape, layout, pairs: int, microbatches: list, oversubscribe: bool) -> None:
    """Refuse before launch: each replica's pairs split into whole microbatches; TP must divide the layer;
    the ranks fit the cores (unless oversubscribed)."""
    if not isinstance(layout.dp, int) or layout.dp < 1 or pairs % layout.dp:
        raise ConfigError(f"data_parallel={layout.dp!r} must be a positive divisor of the batch ({pairs} pairs): each "
                          "pipeline gets an equal share")
    check_pp(shape, layout.pp, pairs // layout.dp, microbatches)
    if layout.tp != 1:
        check_tp(shape, layout.tp)
    if not oversubscribe and capacity_problem("cpu", layout.world):
        raise ConfigError(f"{layout.dp} x {layout.pp} x {layout.tp} (data x pipeline x tensor) = {layout.world} ranks: "
                          + capacity_problem("cpu", layout.world, "ranks")
                          + "; or oversubscribe=True to run them anyway (correct results, meaningless timings)")
