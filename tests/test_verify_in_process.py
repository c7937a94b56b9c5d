"""strategies.verify and stnb.checks in this process, in seconds: what each strategy promises, every
refusal's words, the digests and world checks (the 2-rank versions are in test_verification.py).

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


def _row_shard(p, mesh, rows: int | None = None):
    """A DTensor of ``p``'s global shape, split by rows (``Shard(0)``), whose local shard holds its first
    ``rows`` rows (all of them by default), whatever its layout gives this rank."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(p[:rows].detach().clone(), mesh, [Shard(0)], run_check=False, shape=p.shape,
                              stride=p.stride())


def test_single_reports_what_it_saw():
    m = _model()
    info = strategies.verify("single", m, m, 1, world=ALONE)
    assert info == {"strategy": "single", "wrapper": "Sequential", "world_size_requested": 1, "world_size_seen": 1, "processes_seen": 1,
                    "backend": None, "local_param_count": 26, "total_param_count": 26, "local_param_fraction": 1.0,
                    "problems": [], "ok": True}
    assert strategies.param_counts(m) == (26, 26)


def test_the_world_given_is_the_one_compared_and_without_one_it_is_observed():
    m = _model()
    two = {"process_group_size": 2, "processes": 2, "ranks": [0, 1]}
    assert strategies.verify("single", m, m, 2, world=two)["world_size_seen"] == 2
    assert strategies.verify("single", m, m, 1)["world_size_seen"] == 1  # observed: no process group, this process
    empty = torch.nn.Sequential()
    assert strategies.verify("single", empty, empty, 1, world=ALONE)["local_param_fraction"] is None


def test_dp_reads_the_devices_data_parallel_drives():
    m = _model()
    dp = torch.nn.DataParallel(m)
    dp.device_ids = [0, 1]  # what DataParallel holds on a machine with two GPUs
    assert strategies.verify("dp", dp, m, 1, world=ALONE)["device_ids"] == [0, 1]
    dp.device_ids = [0]
    assert "DataParallel over 1 device(s); needs >= 2" in _refused("dp", dp, m)


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
    # every problem is named, joined by '; '
    assert _refused("single", m, m, world_size=2) == (
        "strategy 'single' failed verification: world size 2 was requested, but the process group has 1 rank(s); "
        "world size 2 was requested, but 1 process(es) answered in the group")


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

    # a DTensor's digest is its local shard's (here, a mesh of one: the whole tensor)
    assert checks.tensor_digests(m) == checks.tensor_digests(_model())

    plain = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    assert strategies.verify("ddp", ddp, plain, 1, world=ALONE)["wrapper"] == "DistributedDataParallel"
    assert _refused("fsdp", ddp, m) == ("strategy 'fsdp' failed verification: the model was wrapped in "
                                        "DistributedDataParallel: FSDP silently became DDP")
    assert "single run was wrapped in DistributedDataParallel" in _refused("single", ddp, plain)


def test_shard_problems_name_the_mesh_the_size_and_whole_parameters(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    m = _model()
    w, b = m[0].weight, m[0].bias  # (3, 5) and (3,)
    # a shard of 2 rows where its layout gives this rank all 3 (a mesh of 1): too small, named
    m[0].weight = torch.nn.Parameter(_row_shard(w, mesh, 2))
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


# ---- weights compared across ranks, world observed: the pure parts ------------------------------


def test_compare_digests_names_each_differing_tensor_and_the_ranks_in_rank_0_order():
    same = checks.compare_digests([{"a": "1", "b": "2"}, {"a": "1", "b": "2"}])
    assert same["identical"] is True and same["differing"] == [] and same["first_differing"] is None
    assert same["tensors"] == 2 and len(set(same["model_digests"])) == 1
    rep = checks.compare_digests([{"b": "2", "a": "1"}, {"b": "2", "a": "X"}, {"b": "Y", "a": "X"},
                                  {"b": "2", "a": "1"}])
    assert rep["identical"] is False and rep["tensors"] == 2
    # rank 0's order of tensors, and only the ranks that differ from rank 0 (rank 3 does not)
    assert rep["differing"] == [{"tensor": "b", "ranks": [2]}, {"tensor": "a", "ranks": [1, 2]}]
    assert rep["first_differing"] == "b"
    d = rep["model_digests"]
    assert len(d) == 4 and d[0] == d[3] and len({d[0], d[1], d[2]}) == 3


def test_compare_digests_a_tensor_missing_on_a_rank_differs():
    rep = checks.compare_digests([{"a": "1"}, {"a": "1", "z": "3"}, {"a": "1", "c": "4"}])
    assert rep["tensors"] == 3 and rep["first_differing"] == "c"  # extra names sorted after rank 0's
    assert rep["differing"] == [{"tensor": "c", "ranks": [2]}, {"tensor": "z", "ranks": [1]}]
    gone = checks.compare_digests([{"a": "1", "b": "2"}, {"a": "1"}])
    assert gone["differing"] == [{"tensor": "b", "ranks": [1]}]


def test_model_digest_depends_on_names_and_digests_not_on_order():
    assert checks.model_digest({"a": "1", "b": "2"}) == checks.model_digest({"b": "2", "a": "1"})
    assert checks.model_digest({"a": "1"}) != checks.model_digest({"b": "1"})
    assert checks.model_digest({"a": "1"}) != checks.model_digest({"a": "2"})
    # a name and a digest never run together: ('ab', 'c') is not ('a', 'bc')
    assert checks.model_digest({"ab": "c"}) != checks.model_digest({"a": "bc"})
    assert checks.model_digest({"a": "b", "c": "d"}) != checks.model_digest({"a": "b\0c", "": "d"})


def test_tensor_digests_see_values_dtype_and_shape():
    m, same = _model(), _model()
    d = checks.tensor_digests(m)
    assert list(d) == ["0.weight", "0.bias", "1.weight", "1.bias"] and d == checks.tensor_digests(same)
    with torch.no_grad():
        same[1].bias[0] += 1e-6
    assert [n for n in d if d[n] != checks.tensor_digests(same)[n]] == ["1.bias"]
    holder = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3, 2))])
    a, b = checks.tensor_digests(holder).values()
    assert a != b  # same bytes, other shape
    ints = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.int32), requires_grad=False)])
    assert next(iter(checks.tensor_digests(ints).values())) != a  # same bytes, other dtype


def test_without_a_process_group_the_world_is_this_process():
    assert checks.observe_world() == ALONE
    m = _model()
    assert checks.gather_digests(m) == [checks.tensor_digests(m)]


def test_world_and_digests_observed_in_a_world_of_one(world_of_one):
    assert checks.observe_world() == ALONE
    m = _model()
    assert checks.gather_digests(m) == [checks.tensor_digests(m)]


@pytest.mark.parametrize("requested, observed, words", [
    (2, {"process_group_size": 2, "processes": 2, "ranks": [0, 1]}, []),
    (3, {"process_group_size": 2, "processes": 2, "ranks": [0, 1]},
     ["world size 3 was requested, but the process group has 2 rank(s)",
      "world size 3 was requested, but 2 process(es) answered in the group"]),
    (2, {"process_group_size": 2, "processes": 1, "ranks": [0, 1]},
     ["world size 2 was requested, but 1 process(es) answered in the group"]),
    (2, {"process_group_size": 2, "processes": 2, "ranks": [0, 2]}, ["the group's ranks are [0, 2], not 0..1"]),
])
def test_world_problems_name_each_mismatch(requested, observed, words):
    assert checks.world_problems(requested, observed) == words


def test_shard_problems_name_three_examples_and_check_every_parameter(world_of_one):
    """A plain parameter first does not end the check; four wrong parameters: counted, three named."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Linear(2, 2)
    m = torch.nn.Sequential(plain, torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    for layer in list(m)[1:]:
        for leaf in ("weight", "bias"):
            p = getattr(layer, leaf)
            setattr(layer, leaf, torch.nn.Parameter(_row_shard(p, mesh, 1)))
    problems = checks.shard_problems(m, 2)
    assert problems[0] == ("4 parameter(s) are sharded over a mesh other than the 2 ranks requested, e.g. "
                           "['1.weight (1)', '1.bias (1)', '2.weight (1)']")
    assert problems[1] == ("rank holds 10 parameter values where its shards hold exactly 26: 4 parameter(s) differ, "
                           "e.g. ['1.weight holds 5, its shard is 15', '1.bias holds 1, its shard is 3', "
                           "'2.weight holds 3, its shard is 6']")
    for layer in list(m)[1:]:
        for leaf in ("weight", "bias"):
            p = getattr(layer, leaf)
            setattr(layer, leaf, torch.nn.Parameter(DTensor.from_local(torch.zeros(p.shape), mesh, [Replicate()],
                                                                       run_check=False)))
    assert checks.shard_problems(m, 1) == ["4 parameter(s) are not split by any placement (every rank holds them "
                                           "whole), e.g. ['1.weight', '1.bias', '2.weight']"]


def test_ipython_shows_an_exported_script_as_its_commands():
    from IPython.lib.pretty import pretty

    from stnb.export import ExportedScript

    s = ExportedScript(path="t.py", nproc_per_node=1, num_nodes=2, master_addr="h", master_port=1,
                       commands={"python": "python t.py"})
    assert pretty(s) == str(s)


def test_shard_problems_name_layouts_stnb_cannot_check_and_go_on_checking_the_rest(world_of_one):
    """A strided shard (FSDP inside tensor parallelism) has no exact size stnb knows: named, three examples,
    and the parameters after it are still checked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (1,))
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    layers = list(m)
    for layer in layers[:2]:  # four parameters of a layout stnb does not know, first
        for leaf in ("weight", "bias"):
            p = getattr(layer, leaf)
            setattr(layer, leaf, torch.nn.Parameter(DTensor.from_local(p.detach().clone(), mesh,
                                                                       [_StridedShard(0, split_factor=2)],
                                                                       run_check=False, shape=p.shape,
                                                                       stride=p.stride())))
    w = layers[2].weight  # then one shard too small
    layers[2].weight = torch.nn.Parameter(_row_shard(w, mesh, 1))
    problems = checks.shard_problems(m, 1)
    # (this torch's strided shard is no Shard subclass: it also counts as held whole; either way, refused)
    assert problems[:2] == ["4 parameter(s) are not split by any placement (every rank holds them whole), e.g. "
                            "['0.weight', '0.bias', '1.weight']",
                            "rank holds 2 parameter values where its shards hold exactly 4: 1 parameter(s) differ, "
                            "e.g. ['2.weight holds 2, its shard is 4']"]
    assert problems[2].startswith("4 parameter(s) have a layout stnb cannot check, e.g. ['0.weight: no exact size "
                                  "known for placement ")
    assert [s.split(":")[0].strip("'") for s in problems[2].split("e.g. [")[1].split("', '")] == \
        ["0.weight", "0.bias", "1.weight"]
    assert len(problems) == 3  # the plain bias of the last layer is not a DTensor: not a shard problem


def test_replicated_digests_cover_every_tensor_not_sharded_and_the_extra_ones(world_of_one):
    """What must be identical on every rank: plain parameters, replicated DTensors and the loss's own
    parameters; not a DTensor shard (the shard checks own it) nor a ZeRO-3 partitioned parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    w = m[0].weight
    m[0].weight = torch.nn.Parameter(_row_shard(w, mesh))
    m[0].bias = torch.nn.Parameter(DTensor.from_local(m[0].bias.detach().clone(), mesh, [Replicate()],
                                                      run_check=False))
    m[1].weight.ds_tensor = torch.zeros(1)  # what DeepSpeed ZeRO-3 puts on a partitioned parameter
    loss_param = torch.nn.Parameter(torch.ones(4))
    got = checks.replicated_digests(m, [("loss.scale", loss_param)])
    assert list(got) == ["0.bias", "1.bias", "2.weight", "2.bias", "loss.scale"]
    everything = checks.tensor_digests(m)
    assert all(got[n] == everything[n] for n in ("0.bias", "1.bias", "2.weight", "2.bias"))
    assert got["loss.scale"] == checks.digests_of([("x", torch.ones(4))])["x"]
    assert list(checks.replicated_digests(torch.nn.Linear(2, 2))) == ["weight", "bias"]


def test_differing_tensors_name_missing_ones_and_a_dtype_change_with_equal_values():
    a = {"w": torch.zeros(2), "only_a": torch.ones(1), "same": torch.ones(3)}
    b = {"w": torch.zeros(2, dtype=torch.int64), "same": torch.ones(3), "only_b": torch.ones(1)}
    assert checks.differing_tensors(a, b) == ["w", "only_a", "only_b"]  # a's order, then b's extra names


def test_saved_model_problems_name_the_first_differing_tensor_and_an_untrained_save():
    trained = {f"t{i:02d}": torch.full((2,), float(i)) for i in range(12)}
    initial = {k: v - 1 for k, v in trained.items()}
    off = {k: v + 1 for k, v in trained.items()}  # every tensor differs from the trained ones
    problems, details = checks.saved_model_problems(off, trained, initial)
    assert problems == ["the saved model's weights are not the trained ones: 12 tensor(s) differ, first 't00'"]
    assert details == {"tensors": 12, "differing_from_trained": [f"t{i:02d}" for i in range(10)],
                       "equals_trained": False, "changed_from_initial": 12, "differs_from_initial": True}
    problems, details = checks.saved_model_problems(dict(initial), trained, initial)  # the untrained model saved
    assert problems[1] == ("the saved model's weights equal the initial (untrained) model's: nothing shows that "
                           "training changed it (was the untrained model saved, or did training change no weight?)")
    assert (details["changed_from_initial"], details["differs_from_initial"]) == (0, False)
    assert checks.saved_model_problems(dict(trained), trained, initial) == (
        [], {"tensors": 12, "differing_from_trained": [], "equals_trained": True, "changed_from_initial": 12,
             "differs_from_initial": True})


def test_gradient_shards_are_checked_against_their_layout_and_plain_ones_named(world_of_one):
    """FSDP's gradient check (strategies.tensors.shard_problems): each gradient's local shard against
    the size its placements give this rank; a gradient that is no DTensor is not sharded at all."""
    from torch.distributed.device_mesh import init_device_mesh

    from stnb.strategies.tensors import shard_problems

    mesh = init_device_mesh("cpu", (1,))
    w, b = torch.ones(3, 5), torch.ones(3)
    right = _row_shard(w, mesh, 3)
    assert shard_problems([("w", right), ("b", _row_shard(b, mesh, 3))]) == (18, [])
    plain = [(name, torch.ones(1)) for name in ("c", "d", "e")]
    expected, problems = shard_problems([("a", torch.ones(2)), ("w", _row_shard(w, mesh, 2)), ("ok", right),
                                         ("b", _row_shard(b, mesh, 1)), *plain], what="gradient")
    assert expected == 15 + 15 + 3  # the sharded ones only, as their layout gives them
    assert problems == [
        "4 gradient(s) are not sharded, e.g. ['a', 'c', 'd']",
        "gradient 'w': this rank holds 10 values, its shard ([Shard(dim=0)] of global shape [3, 5]) holds 15",
        "gradient 'b': this rank holds 1 values, its shard ([Shard(dim=0)] of global shape [3]) holds 3",
    ]
    assert shard_problems([("a", torch.ones(2))])[1] == ["1 parameter(s) are not sharded, e.g. ['a']"]


def test_local_and_total_counts_read_a_shard_and_a_zero3_partition(world_of_one):
    """local_numel / param_counts: a DTensor counts its local shard, locally, and its global shape in the
    total; a DeepSpeed ZeRO-3 parameter (the attributes its ``zero.Init`` sets: an empty tensor, its
    size in ``ds_numel``, this rank's partition in ``ds_tensor``) counts the partition and ``ds_numel``."""
    from torch.distributed.device_mesh import init_device_mesh

    from stnb.strategies.tensors import local_numel, param_counts

    mesh = init_device_mesh("cpu", (1,))
    m = _model()  # 26 values: (3, 5) + 3 + (2, 3) + 2
    m[0].weight = torch.nn.Parameter(_row_shard(m[0].weight, mesh, 2))
    assert local_numel(m[0].weight) == 10 and m[0].weight.numel() == 15
    zero3 = torch.nn.Parameter(torch.empty(0))
    zero3.ds_numel, zero3.ds_tensor = 6, torch.zeros(4)
    m[1].weight = zero3
    assert local_numel(zero3) == 4
    assert param_counts(m) == (10 + 3 + 4 + 2, 26)
