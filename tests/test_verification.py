"""stnb's own checks catch the faults they name (issue 12): each test provokes the fault.

Cross-rank checks run in real 2-rank launches (gloo, tiny model); the fault is made by the test's
rank function (rank 1 changes its weights), never by a switch in stnb.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import stnb
from stnb import checks, saving, strategies
from stnb.models import load_model, tiny_path
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
    return {"info": info, "local_by_hand": by_hand}


# ---------------------------------------------------------------------------------------
# helpers


def _rank_result(rank, digests=None, verification=None, **kw):
    v = {"ok": True, "problems": [], "world_size_seen": 2, "local_param_count": 10, "total_param_count": 10}
    v.update(verification or {})
    return {"rank": rank, "device": "cpu", "global_batch_size": 8, "step_times": [1.0, 1.0, 1.0],
            "losses": [0.5] * 3, "verification": v, "memory_breakdown": {}, "peak_memory_bytes": 1,
            "time_to_first_step_s": 1.0, "weight_digests": digests or {"w": "a"}, **kw}


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
    from stnb.training import train_rank

    cfg = _cfg(per_device_batch_size=4, train_size=32, dev_size=8, evaluate=False)
    with pytest.raises(stnb.LaunchError, match="world size 2 was requested, but the process group has 1"):
        stnb.launch(train_rank, cfg, tiny_path(), None, 2, num_processes=1, device="cpu", timeout=180, echo=False)


def test_merge_counts_the_ranks_against_the_requested_world():
    res = merge(_cfg(), [_rank_result(0)], device="cpu")
    assert not res.verified and "2 ranks were requested, 1 returned a result" in res.reason


# ---------------------------------------------------------------------------------------
# FSDP shards


def test_fsdp_fractions_come_from_the_local_shards():
    ranks = stnb.launch(fsdp_shard_rank, tiny_path(), num_processes=2, device="cpu", timeout=180, echo=False)
    total = ranks[0]["info"]["total_param_count"]
    for r in ranks:
        assert r["info"]["local_param_count"] == r["local_by_hand"]
        assert r["info"]["local_param_fraction"] == pytest.approx(0.5, abs=0.05)
    assert sum(r["info"]["local_param_count"] for r in ranks) == total


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
