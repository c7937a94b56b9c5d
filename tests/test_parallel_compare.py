"""The TP/PP demonstrations' comparison with one process, in the test process (fast).

``tests/test_parallel.py`` runs tensor and pipeline parallelism on real gloo ranks and checks they match
the single-process reference. These state how that comparison is made, so mutation testing
(``make mutants``) can hold it: the largest difference of two tensors (``single.max_diff``), the slice
of the reference's gradient a tensor-parallel rank's shard is compared with (``tp.local_part``, on a
real DTensor of a gloo group of one), how every rank's view of a pipeline run becomes one run's
differences (``pp.per_job``), the row of the table a reader sees (``pp.summary``, ``pp.idle_fraction``),
and the tolerance check that raises (``runs._within``). The rank views are dicts shaped as
``pp.run_job`` returns them, with differences the test chooses.
"""

from __future__ import annotations

import pytest
import torch

from stnb.errors import VerificationError
from stnblab.parallel.pp import Layout, idle_fraction, per_job, summary
from stnblab.parallel.runs import TOLERANCE, _within
from stnblab.parallel.single import max_diff
from stnblab.parallel.tp import local_part


# ---- the tolerance check ------------------------------------------------------------------------

def test_differences_within_the_tolerance_pass_at_the_tolerance_itself():
    _within(dict(TOLERANCE), "TP")
    _within(dict(embeddings=0.0, grads=0.0, loss=0.0), "TP")


def test_a_difference_over_the_tolerance_raises_naming_each_over_and_the_run():
    with pytest.raises(VerificationError) as e:
        _within(dict(embeddings=1e-6, grads=2.5e-5, loss=0.125), "PP (gpipe, 2 microbatches)")
    assert str(e.value) == ("PP (gpipe, 2 microbatches) differs from the single-process reference: grads max abs "
                            "diff 2.5e-05 > 1e-05, loss max abs diff 0.125 > 1e-05")
    with pytest.raises(VerificationError) as e:
        _within(dict(embeddings=1.00001e-5, grads=0.0, loss=0.0), "TP")
    assert str(e.value) == "TP differs from the single-process reference: embeddings max abs diff 1e-05 > 1e-05"


def test_a_nan_difference_is_over_the_tolerance():
    """A run that produced NaN compares as NaN, which no tolerance admits."""
    with pytest.raises(VerificationError, match=r"^TP differs from the single-process reference: loss max abs "
                                                r"diff nan > 1e-05$"):
        _within(dict(embeddings=0.0, grads=0.0, loss=float("nan")), "TP")


# ---- the largest difference ---------------------------------------------------------------------

def test_max_diff_is_the_largest_absolute_difference():
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert max_diff(a, torch.tensor([1.0, 5.0, 2.5])) == 3.0  # below: |2 - 5|, not 3 - 2.5
    assert max_diff(torch.tensor([[0.5, -4.0]]), torch.tensor([[0.25, -1.0]])) == 3.0
    assert max_diff(torch.tensor([7.0]), torch.tensor([7.0])) == 0.0


def test_max_diff_compares_in_fp32():
    """A bf16 tensor is widened before the difference: 1 + 2**-12 vs 1 is 2**-12, not bf16's rounding of it."""
    assert max_diff(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0 + 2 ** -12])) == 2 ** -12
    assert max_diff(torch.tensor([1.0 + 2 ** -12]), torch.tensor([1.0], dtype=torch.bfloat16)) == 2 ** -12


# ---- the slice of the reference a tensor-parallel shard is compared with -------------------------

@pytest.fixture
def mesh(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_a_sharded_gradient_is_compared_with_its_rank_slice_of_the_reference(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(24.0).reshape(4, 6)  # the reference's whole gradient
    for dim in (0, 1):
        grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(dim)])
        for rank in (0, 1):
            mine, ref = local_part(full, grad, rank, 2)
            assert type(mine) is torch.Tensor and torch.equal(mine, torch.ones(4, 6))
            assert torch.equal(ref, full.chunk(2, dim=dim)[rank]), (dim, rank)
    mine, ref = local_part(full, distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)]), 2, 3)
    assert torch.equal(ref, full[:, 4:6])


def test_a_replicated_gradient_is_compared_whole(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    full = torch.arange(6.0)
    mine, ref = local_part(full, distribute_tensor(torch.full((6,), 2.0), mesh, [Replicate()]), 1, 2)
    assert type(mine) is torch.Tensor and torch.equal(mine, torch.full((6,), 2.0)) and ref is full


def test_a_plain_gradient_is_compared_whole():
    full, grad = torch.arange(6.0), torch.zeros(6)
    mine, ref = local_part(full, grad, 1, 2)
    assert mine is grad and ref is full


# ---- a pipeline run: every rank's view, one run's differences ------------------------------------

def view(job, replica, stage, shard, *, losses=None, emb=None, grad=0.0, compared=0, step=1.0, total=2.0,
         events=()):
    """One rank's record of one job, shaped as pp.run_job returns it."""
    v = dict(job, rank=None, replica=replica, stage=stage, shard=shard, layers=[stage], losses=losses or [],
             step_s=[9.0, 8.0, step], total_s=[9.0, 8.0, total], events=list(events), grad_diff=grad,
             grads_compared=compared)  # (3 steps, the last one's timeline: the events)
    if emb is not None:
        v["embedding_diff"] = emb
    return v


REF1 = dict(losses=[2.0, 1.5, 1.0], grads={"a": None, "b": None, "c": None})


def test_a_pipelines_differences_come_from_its_last_stage_and_every_ranks_gradients():
    jobs = [dict(schedule="gpipe", microbatches=2), dict(schedule="1f1b", microbatches=4)]
    ranks = [  # rank order: stage 1 first, so the stages must be sorted
        [view(jobs[0], 0, 1, 0, losses=[2.0, 1.5, 1.25], emb=3e-7, grad=1e-7, compared=1),
         view(jobs[1], 0, 1, 0, losses=[2.5, 1.5, 1.0], emb=4e-7, grad=5e-7, compared=1)],
        [view(jobs[0], 0, 0, 0, grad=2e-7, compared=2),
         view(jobs[1], 0, 0, 0, grad=1e-7, compared=2)],
    ]
    runs = per_job(ranks, jobs, {1: REF1, 2: None}, "full_batch", Layout(dp=1, pp=2, tp=1))
    assert [(r["schedule"], r["microbatches"]) for r in runs] == [("gpipe", 2), ("1f1b", 4)]
    first, second = runs
    assert [s["stage"] for s in first["stages"]] == [0, 1]
    assert first["losses"] == [2.0, 1.5, 1.25] and first["reference_losses"] == [2.0, 1.5, 1.0]
    assert first["loss_diff"] == 0.25 and second["loss_diff"] == 0.5
    assert (first["embedding_diff"], first["grad_diff"]) == (3e-7, 2e-7)
    assert (second["embedding_diff"], second["grad_diff"]) == (4e-7, 5e-7)
    assert (first["grads_compared"], first["grads_expected"]) == (3, 3)


def test_replicas_and_shards_each_count_once_and_every_one_is_compared():
    """dp 2 x pp 2 x tp 2: the stages' gradient counts are replica 0 shard 0's; the losses and embeddings of
    every last-stage rank and the gradients of every rank are compared."""
    job = dict(schedule="gpipe", microbatches=2)
    ranks = []
    for d in (0, 1):
        for s in (0, 1):
            for t in (0, 1):
                last = s == 1
                ranks.append([view(job, d, s, t, losses=[1.5, 1.0] if last else None,
                                   emb=1e-7 if last else None, grad=1e-7, compared=5 + s)])
    at = {(d, s, t): i for i, (d, s, t) in enumerate((d, s, t) for d in (0, 1) for s in (0, 1) for t in (0, 1))}
    ranks[at[1, 1, 1]][0]["losses"] = [1.5, 1.125]  # another replica's and shard's last stage: its loss is off
    ranks[at[1, 1, 0]][0]["embedding_diff"] = 6e-7
    ranks[at[0, 1, 0]][0]["grad_diff"] = 7e-7
    ranks[at[0, 0, 1]][0]["grad_diff"] = 8e-7  # a shard outside "stages": compared all the same
    ranks[at[1, 0, 0]][0]["grads_compared"] = 100  # replica 1 and shard 1 hold copies and pieces: not counted
    ranks[at[0, 0, 1]][0]["grads_compared"] = 50
    refs = {2: dict(losses=[1.5, 1.0], grads=dict.fromkeys("abcdefghijk"))}
    run, = per_job(ranks, [job], refs, "full_batch", Layout(dp=2, pp=2, tp=2))
    assert [(s["replica"], s["stage"], s["shard"]) for s in run["stages"]] == [(0, 0, 0), (0, 1, 0)]
    assert run["losses"] == [1.5, 1.0] and run["loss_diff"] == 0.125
    assert run["embedding_diff"] == 6e-7 and run["grad_diff"] == 8e-7
    assert (run["grads_compared"], run["grads_expected"]) == (11, 11)


def test_the_per_microbatch_loss_is_compared_with_its_own_reference():
    job = dict(schedule="gpipe", microbatches=4)
    ranks = [[view(job, 0, 0, 0, compared=1)], [view(job, 0, 1, 0, losses=[0.5], emb=0.0, compared=1)]]
    refs = {1: dict(losses=[2.0], grads={"a": 0}), 4: dict(losses=[0.75], grads={"a": 0, "b": 0})}
    run, = per_job(ranks, [job], refs, "per_microbatch", Layout(dp=1, pp=2, tp=1))
    assert run["reference_losses"] == [0.75] and run["loss_diff"] == 0.25 and run["grads_expected"] == 2
    run, = per_job(ranks, [job], refs, "full_batch", Layout(dp=1, pp=2, tp=1))
    assert run["reference_losses"] == [2.0] and run["loss_diff"] == 1.5 and run["grads_expected"] == 1
    # data parallel: the reference is the mean over each replica's (micro)batches
    refs = {2: dict(losses=[1.0], grads={}), 8: dict(losses=[0.25], grads={})}
    ranks = [[view(job, d, s, 0, losses=[0.5] if s else None, emb=0.0)] for d in (0, 1) for s in (0, 1)]
    assert per_job(ranks, [job], refs, "per_microbatch", Layout(dp=2, pp=2, tp=1))[0]["loss_diff"] == 0.25
    assert per_job(ranks, [job], refs, "full_batch", Layout(dp=2, pp=2, tp=1))[0]["loss_diff"] == 0.5


# ---- the table's row -------------------------------------------------------------------------------

def test_a_stage_idles_for_the_part_of_the_step_outside_its_forwards_and_backwards():
    stage = dict(step_s=[9.0, 8.0, 2.0], events=[("F", 0, 10.0, 10.25), ("F", 1, 10.5, 10.75), ("B", 0, 11.0, 11.5)])
    assert idle_fraction(stage) == 0.5  # 1 s busy of the last step's 2 s


def test_the_table_row_of_a_pipeline_run():
    job = dict(schedule="1f1b", microbatches=4)
    s0 = view(job, 0, 0, 0, step=2.0, total=2.5, events=[("F", 0, 0.0, 0.5)])
    s1 = view(job, 0, 1, 0, step=1.0, total=3.0, events=[("F", 0, 0.0, 0.5), ("B", 0, 0.5, 1.0)])
    run = dict(job, stages=[s0, s1], losses=[2.0, 1.5, 0.875], loss_diff=1e-7, embedding_diff=2e-7, grad_diff=3e-7)
    assert summary(run, 2) == dict(schedule="1f1b", microbatches=4, loss=0.875, loss_diff=1e-7, embedding_diff=2e-7,
                                   grad_diff=3e-7, schedule_ms=2000.0, step_ms=3000.0, bubble_formula=1 / 5,
                                   idle_stage0=0.75, idle_stage1=0.0)
    assert summary(dict(run, microbatches=2), 3)["bubble_formula"] == 2 / 4
