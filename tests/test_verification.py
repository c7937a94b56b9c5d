"""stnb's own checks catch the faults they name (issue 12): each test provokes the fault.

Cross-rank checks run in real 2-rank launches (gloo, tiny model); the fault is made by the test's
rank function (rank 1 changes its weights), never by a switch in stnb.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import stnb
from stnb import checks, saving, strategies
from stnb.models import load_model, tiny_path
from stnb.rankreport import RankReport
from stnb.results import merge

EMB = "0.model.embeddings.word_embeddings.weight"
QUERY = "0.model.encoder.layer.0.attention.self.query.weight"


# ---------------------------------------------------------------------------------------
# rank functions (run inside stnb.launch)


def perturbed_weights_rank(model_path: str) -> dict:
    """Every rank loads the same model; rank 1 then swaps two embedding rows, or nudges one weight."""
    import torch
    import torch.distributed as dist

    out = {}
    for case in ("identical", "swap_rows", "nudge_3e-4"):
        model = load_model(model_path)
        params = dict(model.named_parameters())
        if dist.get_rank() == 1:
            with torch.no_grad():
                if case == "swap_rows":
                    w = params[EMB]
                    w[[3, 7]] = w[[7, 3]]
                elif case == "nudge_3e-4":
                    params[QUERY][0, 0] += 3e-4
        digests = checks.gather_digests(model)
        out[case] = {"report": checks.compare_digests(digests), "mine": checks.tensor_digests(model)}
    return out


def world_rank() -> dict:
    import torch.distributed as dist

    whole = checks.observe_world()
    alone = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]  # every rank creates both groups
    return {"whole": whole, "as_requested": checks.world_problems(2, whole),
            "three_requested": checks.world_problems(3, whole),
            "each_alone": checks.world_problems(2, checks.observe_world(alone))}


def fsdp_shard_rank(model_path: str) -> dict:
    from torch.distributed.tensor import DTensor

    model = load_model(model_path)
    strategies.shard_fsdp(model, "cpu", 2)
    info = strategies.verify("fsdp", model, model, 2)
    by_hand = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
    exact = {n: (p.to_local().numel(), checks.expected_local_numel(p)) for n, p in model.named_parameters()}
    # dimensions that do not divide: 3 rows over 2 ranks are 2 rows and 1 row
    import torch
    from torch.distributed.fsdp import fully_shard

    odd = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    fully_shard(odd)
    uneven = {n: (p.to_local().numel(), checks.expected_local_numel(p)) for n, p in odd.named_parameters()}
    return {"info": info, "local_by_hand": by_hand, "exact": exact, "problems": checks.shard_problems(model, 2),
            "three_requested": checks.shard_problems(model, 3), "uneven": uneven,
            "uneven_problems": checks.shard_problems(odd, 2)}


def _reshard(model, name, local_of):
    """Replace parameter ``name`` of an FSDP-sharded model by a DTensor of the same global shape and
    placements whose local piece is ``local_of(full tensor)``: a rank holding the wrong piece."""
    import torch
    from torch.distributed.tensor import DTensor

    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, leaf)
    full = p.full_tensor().detach()  # a collective: every rank reshards the same parameters
    local = local_of(full)
    if local is None:
        return
    bad = DTensor.from_local(local.contiguous(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                             stride=p.stride())
    module._parameters[leaf] = torch.nn.Parameter(bad)


def fsdp_wrong_shard_rank(model_path: str) -> dict:
    """verify on FSDP models where a rank holds more (or other) than its shard, made after fully_shard."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    rank = dist.get_rank()
    cases = {
        # every rank holds the first three quarters of every parameter (0.75 of the model)
        "three_quarters": lambda name, full: full[:math.ceil(0.75 * full.shape[0])],
        # rank 0 holds one row more of one parameter than its shard: 0.5 + a few values
        "one_extra_row": lambda name, full: (full[:full.shape[0] // 2 + 1] if rank == 0 and name == QUERY
                                             else None),
    }
    out = {}
    for case, local_of in cases.items():
        model = load_model(model_path)
        strategies.shard_fsdp(model, "cpu", 2)
        for name, _ in list(model.named_parameters()):
            _reshard(model, name, lambda full, name=name: local_of(name, full))
        out[case] = _verify_message(model)
    model = load_model(model_path)  # every rank holds the whole model, laid out as replicated
    strategies.shard_fsdp(model, "cpu", 2)
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(p.redistribute(p.device_mesh, [Replicate()]))
    out["replicated"] = _verify_message(model)
    return out


def _verify_message(model):
    try:
        strategies.verify("fsdp", model, model, 2)
    except strategies.VerificationError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------
# helpers


def _rank_result(rank, digests=None, verification=None, **kw):
    v = {"ok": True, "problems": [], "world_size_seen": 2, "local_param_count": 10, "total_param_count": 10}
    v.update(verification or {})
    return RankReport(rank=rank, device="cpu", global_batch_size=8, step_times=[1.0, 1.0, 1.0], losses=[0.5] * 3,
                      verification=v, memory_breakdown={}, peak_memory_bytes=1, time_to_first_step_s=1.0,
                      weight_digests=digests or {"w": "a"}, **kw)


def _cfg(strategy="ddp", **kw):
    return stnb.TrainConfig(strategy=strategy, num_processes=None if strategy == "single" else 2, model="tiny",
                            steps=3, warmup_steps_excluded=1, **kw)


# ---------------------------------------------------------------------------------------
# weights identical across DDP ranks


@pytest.fixture(scope="module")
def perturbed():
    return stnb.launch(perturbed_weights_rank, tiny_path(), num_processes=2, device="cpu", timeout=180,
                       echo=False)


def test_identical_weights_pass_the_exact_check(perturbed):
    for rank in perturbed:
        rep = rank["identical"]["report"]
        assert rep["identical"] is True and rep["differing"] == [] and rep["tensors"] > 30
        assert len(set(rep["model_digests"])) == 1
    res = merge(_cfg(), [_rank_result(r, rank["identical"]["mine"]) for r, rank in enumerate(perturbed)],
                device="cpu")
    assert res.verified and res.verification["weights_identical_across_ranks"] is True


@pytest.mark.parametrize("case, tensor", [("swap_rows", EMB), ("nudge_3e-4", QUERY)])
def test_weights_check_names_the_tensor_rank_1_changed(perturbed, case, tensor):
    """Swapping two embedding rows, or adding 3e-4 to one weight, on rank 1 is a mismatch, named."""
    for rank in perturbed:  # every rank sees the same verdict from the all-gather
        rep = rank[case]["report"]
        assert rep["identical"] is False
        assert rep["differing"] == [{"tensor": tensor, "ranks": [1]}]
        assert rep["first_differing"] == tensor
    res = merge(_cfg(), [_rank_result(r, rank[case]["mine"]) for r, rank in enumerate(perturbed)], device="cpu")
    assert res.verified is False and res.verification["weights_identical_across_ranks"] is False
    assert res.verification["weights_differing"] == [{"tensor": tensor, "ranks": [1]}]
    assert tensor in res.reason and "weights differ across ranks" in res.reason


# ---------------------------------------------------------------------------------------
# world size: requested vs observed


def test_world_size_requested_is_compared_with_the_group_each_rank_is_in():
    ranks = stnb.launch(world_rank, num_processes=2, device="cpu", timeout=120, echo=False)
    for r in ranks:
        assert r["whole"]["process_group_size"] == 2 and r["whole"]["processes"] == 2
        assert r["as_requested"] == []
        assert any("world size 3 was requested, but the process group has 2" in p for p in r["three_requested"])
        assert any("2 was requested, but 1 process(es) answered" in p for p in r["each_alone"])


def test_launch_refuses_a_world_other_than_the_one_requested():
    """An env that makes each rank a world of its own: the launcher's own check sees it."""
    with pytest.raises(stnb.LaunchError, match="world size 2 was requested, but the process group has 1"):
        stnb.launch(os.getpid, num_processes=2, device="cpu", env={"WORLD_SIZE": "1", "RANK": "0"}, timeout=120,
                    echo=False)


def test_train_rank_compares_the_requested_world_with_its_process_group():
    """A DDP config for 2 ranks trained in a world of 1: verification names the mismatch."""
    from stnb.builds import RecipeBuild
    from stnb.training import train_rank

    cfg = _cfg(per_device_batch_size=4, train_size=32, dev_size=8, evaluate=False)
    with pytest.raises(stnb.LaunchError, match="world size 2 was requested, but the process group has 1"):
        stnb.launch(train_rank, cfg, RecipeBuild(tiny_path()), None, 2, num_processes=1, device="cpu", timeout=180, echo=False)


def test_merge_compares_the_device_each_rank_trained_on_with_the_one_asked():
    """In-process (the 2-rank test below does it on real ranks): merge hands the device it was asked to the check."""
    reports = [_rank_result(r, verification={"device_seen": ["cpu"]}) for r in range(2)]
    assert merge(_cfg(), reports, device="cpu").verified
    asked_cuda = merge(_cfg(), reports, device="cuda")
    assert not asked_cuda.verified and "rank 1: device 'cuda' was requested, its model trained on cpu" in \
        asked_cuda.reason


def test_merge_counts_the_ranks_against_the_requested_world():
    res = merge(_cfg(), [_rank_result(0)], device="cpu")
    assert not res.verified and "2 ranks were requested, 1 returned a result" in res.reason


def test_each_rank_reports_the_device_its_batches_reached_and_merge_compares_it_with_the_one_asked():
    """A rank that could not start CUDA and trained on the CPU is named (issue 32, 4.7): the device comes
    from the first batch the module that trains received, and merge compares it with the device asked."""
    from stnb.builds import RecipeBuild
    from stnb.training import train_rank

    cfg = _cfg(per_device_batch_size=4, train_size=32, dev_size=8, evaluate=False)
    reports = stnb.launch(train_rank, cfg, RecipeBuild(tiny_path()), None, 2, num_processes=2, device="cpu",
                          timeout=180, echo=False)
    assert [r.verification["device_seen"] for r in reports] == [["cpu"], ["cpu"]]
    assert merge(cfg, reports, device="cpu").verified
    asked_cuda = merge(cfg, reports, device="cuda")
    assert not asked_cuda.verified
    assert "rank 0: device 'cuda' was requested, its model trained on cpu" in asked_cuda.reason
    assert "rank 1: device 'cuda' was requested" in asked_cuda.reason
    assert asked_cuda.verification["device"] == {"requested": "cuda", "per_rank": [["cpu"], ["cpu"]]}


# ---------------------------------------------------------------------------------------
# FSDP shards


def test_fsdp_fractions_come_from_the_local_shards():
    ranks = stnb.launch(fsdp_shard_rank, tiny_path(), num_processes=2, device="cpu", timeout=180, echo=False)
    total = ranks[0]["info"]["total_param_count"]
    for r in ranks:
        assert r["info"]["local_param_count"] == r["local_by_hand"]
        assert r["info"]["local_param_fraction"] == pytest.approx(0.5, abs=0.05)
    assert sum(r["info"]["local_param_count"] for r in ranks) == total


def test_fsdp_shards_are_exactly_the_pieces_their_layout_gives_each_rank():
    ranks = stnb.launch(fsdp_shard_rank, tiny_path(), num_processes=2, device="cpu", timeout=180, echo=False)
    for r in ranks:
        assert r["problems"] == [] and r["info"]["ok"] and r["info"]["ideal_fraction"] == 0.5
        assert all(have == want for have, want in r["exact"].values()), r["exact"]
        assert "sharded over a mesh other than the 3 ranks requested" in r["three_requested"][0]
    # the two ranks' pieces of each parameter make the whole
    assert sum(want for r in ranks for _, want in r["exact"].values()) == ranks[0]["info"]["total_param_count"]
    # where a dimension does not divide, FSDP's pieces are torch.chunk's: the last rank's is smaller or empty
    for r in ranks:
        assert r["uneven_problems"] == [] and all(have == want for have, want in r["uneven"].values())
    assert [r["uneven"]["0.weight"][0] for r in ranks] == [10, 5]  # 3 rows of 5: 2 rows, 1 row
    assert [r["uneven"]["1.weight"][0] for r in ranks] == [3, 0]  # 1 row of 3: rank 1 holds nothing
    assert [r["uneven"]["1.bias"][0] for r in ranks] == [1, 0]


@pytest.fixture(scope="module")
def wrong_shards():
    return stnb.launch(fsdp_wrong_shard_rank, tiny_path(), num_processes=2, device="cpu", timeout=180, echo=False)


def test_verify_refuses_a_rank_holding_three_quarters_of_an_fsdp_model(wrong_shards):
    for r in wrong_shards:
        msg = r["three_quarters"]
        assert msg and "strategy 'fsdp' failed verification" in msg
        held, exact = map(int, re.search(r"rank holds (\d+) parameter values where its shards hold exactly (\d+)",
                                         msg).groups())
        assert held / (2 * exact) == pytest.approx(0.75, abs=0.01)  # the two ranks' shards make the model


def test_verify_refuses_one_row_more_than_the_shard(wrong_shards):
    """Exact, not within a tolerance: one extra row of one weight on rank 0 is refused, on rank 0 only."""
    msg = wrong_shards[0]["one_extra_row"]
    assert msg and "1 parameter(s) differ" in msg and QUERY in msg
    assert wrong_shards[1]["one_extra_row"] is None


def test_verify_refuses_parameters_every_rank_holds_whole(wrong_shards):
    for r in wrong_shards:
        assert r["replicated"] and "not split by any placement" in r["replicated"]


@pytest.mark.parametrize("n", range(0, 12))
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5])
def test_chunk_size_is_torch_chunk(n, chunks):
    import torch

    pieces = [len(c) for c in torch.arange(n).chunk(chunks)] if n else []
    pieces += [0] * (chunks - len(pieces))  # torch.chunk leaves out the empty pieces at the end
    assert [checks.chunk_size(n, chunks, i) for i in range(chunks)] == pieces


def test_shard_numel_last_rank_smaller_or_empty():
    from torch.distributed.tensor import Partial, Replicate, Shard

    # 5 rows of 3 over 2 ranks: 3 rows and 2 rows; over 4 ranks: 2, 2, 1, 0 rows
    assert [checks.shard_numel((5, 3), [Shard(0)], (r,), (2,)) for r in range(2)] == [9, 6]
    assert [checks.shard_numel((5, 3), [Shard(0)], (r,), (4,)) for r in range(4)] == [6, 6, 3, 0]
    assert [checks.shard_numel((3, 7), [Shard(1)], (r,), (2,)) for r in range(2)] == [12, 9]
    assert checks.shard_numel((5, 3), [Replicate()], (1,), (2,)) == 15
    assert checks.shard_numel((5, 3), [Partial()], (1,), (2,)) == 15
    # a 2 x 3 mesh: dim 0 over the first mesh dimension, dim 1 over the second
    sizes = {(i, j): checks.shard_numel((5, 7), [Shard(0), Shard(1)], (i, j), (2, 3)) for i in range(2) for j in range(3)}
    assert sizes == {(0, 0): 9, (0, 1): 9, (0, 2): 3, (1, 0): 6, (1, 1): 6, (1, 2): 2}
    assert sum(sizes.values()) == 35
    # twice along one dimension: the second split applies to the first one's piece
    assert [checks.shard_numel((7,), [Shard(0), Shard(0)], (i, j), (2, 2)) for i in range(2) for j in range(2)] \
        == [2, 2, 2, 1]


def test_shard_numel_refuses_a_layout_it_does_not_know():
    class Strided:
        pass

    with pytest.raises(ValueError, match="no exact size known"):
        checks.shard_numel((4,), [Strided()], (0,), (2,))


def test_merge_refuses_fsdp_ranks_that_each_hold_the_whole_model():
    full = {"local_param_count": 10, "total_param_count": 10}
    res = merge(_cfg("fsdp"), [_rank_result(0, verification=full), _rank_result(1, verification=full)],
                device="cpu")
    assert not res.verified and res.verification["shards_add_up"] is False
    assert "local shards hold 20 parameter values, the model has 10" in res.reason


# ---------------------------------------------------------------------------------------
# saved model


def test_saving_a_model_other_than_the_trained_one_is_caught(tmp_path):
    import torch

    initial_model = load_model(tiny_path())
    initial = checks.state_of(initial_model)
    trained_model = load_model(tiny_path())
    with torch.no_grad():  # stands in for training: every weight moved
        for p in trained_model.parameters():
            p.add_(1e-3)
    trained = checks.state_of(trained_model)

    untrained = saving.save_checked(initial_model, str(tmp_path / "untrained"), "cpu", trained, initial)
    assert untrained["ok"] is False and untrained["saved_to"] is None
    assert untrained["equals_trained"] is False and untrained["differing_from_trained"]
    assert "not the trained ones" in untrained["problems"][0]
    assert not (tmp_path / "untrained").exists(), "a wrong model never lands at save_to"

    # training that changed nothing (or a 'trained' reference that is the initial model) is caught too
    unchanged = saving.save_checked(initial_model, str(tmp_path / "unchanged"), "cpu", initial, initial)
    assert unchanged["ok"] is False and unchanged["differs_from_initial"] is False
    assert "equal the initial (untrained) model's" in unchanged["problems"][0]

    good = saving.save_checked(trained_model, str(tmp_path / "good"), "cpu", trained, initial)
    assert good["ok"] and good["equals_trained"] and good["changed_from_initial"] == len(trained)
    assert good["saved_to"] == str(tmp_path / "good") and (tmp_path / "good").is_dir()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".stnb-save-")]

    res = merge(_cfg("single"), [_rank_result(0, saved_model=untrained)], device="cpu")
    assert not res.verified and "save_to: the saved model's weights are not the trained ones" in res.reason


def test_the_save_check_reads_the_saved_folder_not_the_model_in_memory(tmp_path):
    """A save that writes other weights than the model holds (one tensor changed on its way to disk) is
    caught: the check compares the model reloaded from the folder with the trained weights. Comparing the
    model in memory (or the reloaded model with itself) would pass it."""
    import torch
    from safetensors.torch import load_file, save_file

    initial = checks.state_of(load_model(tiny_path()))
    model = load_model(tiny_path())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    trained = checks.state_of(model)
    real_save = model.save

    def save_one_tensor_changed(path, *a, **kw):
        real_save(path, *a, **kw)
        f = os.path.join(path, "model.safetensors")
        tensors = load_file(f)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 1e-4
        save_file(tensors, f, metadata={"format": "pt"})

    model.save = save_one_tensor_changed
    out = saving.save_checked(model, str(tmp_path / "saved"), "cpu", trained, initial)
    assert out["ok"] is False and out["equals_trained"] is False and len(out["differing_from_trained"]) == 1
    assert "not the trained ones: 1 tensor(s) differ" in out["problems"][0]
    assert not (tmp_path / "saved").exists(), "a wrong model never lands at save_to"
    model.save = real_save
    assert saving.save_checked(model, str(tmp_path / "good"), "cpu", trained, initial)["ok"]


# ---------------------------------------------------------------------------------------
# exit codes (real subprocesses)

CLI = [sys.executable, "-m", "stnb"]


def test_cli_run_exits_nonzero_for_an_unverified_result(tmp_path):
    """A learning rate too small to change any fp32 weight: the saved model equals the initial one."""
    target = tmp_path / "model"
    out = subprocess.run(CLI + ["run", "--strategy", "single", "--model", "tiny", "--steps", "3", "--batch-size", "4",
                                "--train-size", "32", "--no-eval", "--lr", "1e-300", "--save-to", str(target),
                                "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "not verified" in out.stderr and "equal the initial (untrained) model's" in out.stderr
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["verified"] is False and d["verification"]["saved_model"]["differs_from_initial"] is False
    assert not target.exists()


def test_cli_bench_exits_nonzero_and_names_the_failed_runs(tmp_path):
    """Seven pairs: one process trains on them, two ranks of batch 4 get no full batch and train nothing."""
    data = tmp_path / "small.csv"
    data.write_text("sentence1,sentence2,score\n" + "".join(f"sentence {i} a,sentence {i} b,0.{i}\n"
                                                            for i in range(7)))
    out = subprocess.run(CLI + ["bench", "--sweep", "--strategies", "single,ddp", "--batch-sizes", "4", "--nprocs",
                                "2", "--data", str(data), "--model", "tiny", "--steps", "3", "--warmup", "1",
                                "--train-size", "64", "--results", str(tmp_path / "runs.jsonl"),
                                "--report", str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    failed = out.stderr.split("run(s) failed:", 1)[1]
    assert "sweep: ddp x2 b4: not verified" in failed and "no training step began" in failed
    assert "single b4" not in failed
    rows = {json.loads(line)["config"]["extra"]["bench"]["name"]: json.loads(line)
            for line in (tmp_path / "runs.jsonl").read_text().splitlines()}
    assert rows["single b4"]["status"] == "ok" and rows["ddp x2 b4"]["status"] == "failed"
