"""strategies.verify and the shard checks in this process, in seconds: what each strategy promises,
and every refusal's words (the 2-rank versions are in test_verification.py).

A world of one gloo process is made for the FSDP2 / DDP wrappers (fully_shard and
DistributedDataParallel need a process group) and destroyed after each test.
"""

from __future__ import annotations

import pytest
import torch

from stnb import checks, strategies
from stnb.errors import VerificationError

ALONE = {"process_group_size": 1, "processes": 1, "ranks": [0]}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 18 + 8 = 26 values


def _refused(strategy, wrapped, model, world_size=1, world=ALONE) -> str:
    with pytest.raises(VerificationError) as e:
        strategies.verify(strategy, wrapped, model, world_size, world=world)
    msg = str(e.value)
    assert msg.startswith(f"strategy {strategy!r} failed verification: ")
    return msg


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_single_reports_what_it_saw():
    m = _model()
    info = strategies.verify("single", m, m, 1, world=ALONE)
    assert info == {"wrapper": "Sequential", "world_size_requested": 1, "world_size_seen": 1, "processes_seen": 1,
                    "backend": None, "local_param_count": 26, "total_param_count": 26, "local_param_fraction": 1.0,
                    "problems": [], "ok": True}
    assert strategies.param_counts(m) == (26, 26)


def test_single_refuses_a_wrapper():
    m = _model()
    assert "single run was wrapped in DataParallel" in _refused("single", torch.nn.DataParallel(m), m)


def test_dp_needs_data_parallel_over_two_devices():
    m = _model()
    assert "expected torch.nn.DataParallel, the trainer used Sequential" in _refused("dp", m, m)
    assert "DataParallel over 0 device(s); needs >= 2" in _refused("dp", torch.nn.DataParallel(m), m)


def test_ddp_needs_distributed_data_parallel():
    m = _model()
    assert "expected DistributedDataParallel, the trainer used Sequential" in _refused("ddp", m, m)


def test_the_world_requested_is_compared_with_the_one_seen():
    m = _model()
    msg = _refused("single", m, m, world_size=2)
    assert "world size 2 was requested, but the process group has 1 rank(s)" in msg
    assert "world size 2 was requested, but 1 process(es) answered in the group" in msg
    # every problem is named, joined by '; '
    assert msg.count("; ") == 1


def test_fsdp_refuses_a_plain_model_naming_what_is_missing():
    m = _model()
    msg = _refused("fsdp", m, m)
    assert "root module is Sequential, not an FSDP2 module (fully_shard)" in msg
    assert "4 parameter(s) are not sharded, e.g. ['0.weight', '0.bias', '1.weight']" in msg


def test_fsdp_and_ddp_verified_in_a_world_of_one(world_of_one):
    from torch.distributed.fsdp import fully_shard

    m = _model()
    fully_shard(m)
    info = strategies.verify("fsdp", m, m, 1, world=ALONE)
    assert info["ok"] and info["backend"] == "gloo" and info["ideal_fraction"] == 1.0
    assert info["wrapper"] == "FSDPSequential" and info["local_param_count"] == info["total_param_count"] == 26
    assert checks.shard_problems(m, 1) == []
    assert [checks.expected_local_numel(p) for p in m.parameters()] == [15, 3, 6, 2]

    plain = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    assert strategies.verify("ddp", ddp, plain, 1, world=ALONE)["wrapper"] == "DistributedDataParallel"
    assert "the model was wrapped in DistributedDataParallel: FSDP silently became DDP" in _refused("fsdp", ddp, m)
    assert "single run was wrapped in DistributedDataParallel" in _refused("single", ddp, plain)


def test_shard_problems_name_the_mesh_the_size_and_whole_parameters(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,))
    m = _model()
    w, b = m[0].weight, m[0].bias  # (3, 5) and (3,)
    # a shard of 2 rows where its layout gives this rank all 3 (a mesh of 1): too small, named
    m[0].weight = torch.nn.Parameter(DTensor.from_local(w[:2].detach().clone(), mesh, [Shard(0)], run_check=False,
                                                        shape=w.shape, stride=w.stride()))
    m[0].bias = torch.nn.Parameter(DTensor.from_local(b.detach().clone(), mesh, [Replicate()], run_check=False))
    problems = checks.shard_problems(m, 1)
    assert problems == [
        "1 parameter(s) are not split by any placement (every rank holds them whole), e.g. ['0.bias']",
        "rank holds 13 parameter values where its shards hold exactly 18: 1 parameter(s) differ, "
        "e.g. ['0.weight holds 10, its shard is 15']",
    ]
    assert checks.shard_problems(m, 2)[0] == ("2 parameter(s) are sharded over a mesh other than the 2 ranks "
                                              "requested, e.g. ['0.weight (1)', '0.bias (1)']")
    assert checks.expected_local_numel(m[1].weight) == 6  # not a DTensor: the whole tensor
    msg = _refused("fsdp", m, m)
    assert "its shard is 15" in msg and "not split by any placement" in msg
