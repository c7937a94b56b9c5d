"""results.merge: the ranks' measurements become the one RunResult a user reads (throughput, steps,
memory, verification and its reason), from hand-built rank results, in this process."""

from __future__ import annotations

from dataclasses import replace

import pytest

import stnb
from stnb.rankreport import RankReport
from stnb.results import merge


def _cfg(strategy="ddp", **kw):
    kw = {"model": "tiny", "steps": 4, "warmup_steps_excluded": 1, **kw}
    return stnb.TrainConfig(strategy=strategy, num_processes=None if strategy in ("single", "dp") else 2, **kw)


def _rank(rank, step_times, verification=None, **kw):
    v = {"ok": True, "problems": [], "world_size_seen": 2, "local_param_count": 10 + rank, "total_param_count": 21}
    v.update(verification or {})
    out = {"rank": rank, "device": f"cpu{rank}", "global_batch_size": 8, "step_times": step_times,
           "losses": [0.9 - 0.1 * i - rank for i in range(len(step_times))], "verification": v,
           "memory_breakdown": {"rank": rank}, "peak_memory_bytes": 100 + rank, "peak_memory_run_bytes": 50 + rank,
           "time_to_first_step_s": 1.5 + rank, "weight_digests": {"w": "a"}}
    out.update(kw)
    return RankReport(**out)


def test_throughput_counts_the_measured_steps_of_the_slowest_rank():
    r0, r1 = _rank(0, [5.0, 1.0, 2.0, 3.0]), _rank(1, [4.0, 2.0, 1.0, 4.0, 9.0])
    res = merge(_cfg(), [r0, r1], device="cpu", wall_time_s=12.5)
    assert res.steps == 4  # the steps every rank took
    assert res.step_times == [5.0, 2.0, 2.0, 4.0]  # per step, the slowest rank
    # one warm-up step left out; rank 1 spent 2 + 1 + 4 = 7 s on the 3 measured steps of 8 samples
    assert res.samples_per_second == pytest.approx(8 * 3 / 7.0)
    assert res.world_size == 2 and res.global_batch_size == 8
    assert res.per_device_batch_size == _cfg().per_device_batch_size  # stnb's recipe: the config's
    assert res.losses == r0.losses and res.device == "cpu0"
    assert res.peak_memory_bytes == [100, 101] and res.peak_memory_run_bytes == [50, 51]
    assert res.local_param_count == [10, 11] and res.total_param_count == 21
    assert res.memory_breakdown == [{"rank": 0}, {"rank": 1}]
    assert res.time_to_first_step_s == 2.5 and res.wall_time_s == 12.5 and res.launcher == "stnb"
    assert res.config == _cfg().to_dict() and res.build is None and res.model == "tiny"
    assert res.verified and res.reason == "" and len(res.run_id) == 12


def test_warm_up_leaves_the_last_step_and_no_time_means_no_throughput():
    one = merge(_cfg(), [_rank(0, [3.0]), _rank(1, [2.0])], device="cpu")
    assert one.steps == 1 and one.samples_per_second == pytest.approx(8 / 3.0)  # warm-up never takes the last step
    zero = merge(_cfg(), [_rank(0, [1.0, 0.0, 0.0]), _rank(1, [1.0, 0.0, 0.0])], device="cpu")
    assert zero.samples_per_second is None
    two = merge(_cfg(warmup_steps_excluded=5), [_rank(0, [1.0, 2.0]), _rank(1, [1.0, 4.0])], device="cpu")
    assert two.samples_per_second == pytest.approx(8 / 4.0)  # warm-up capped: the last step is measured


def test_one_process_strategies_are_a_world_of_one_and_first_step_ignores_ranks_that_measured_none():
    res = merge(_cfg("single"), [_rank(0, [1.0, 2.0], time_to_first_step_s=None)], device="cpu")
    assert res.world_size == 1 and res.time_to_first_step_s is None
    res = merge(_cfg(), [_rank(0, [1.0, 2.0], time_to_first_step_s=None), _rank(1, [1.0, 2.0])], device="cpu")
    assert res.time_to_first_step_s == 2.5


def test_mfu_counts_every_gpu_data_parallel_drives():
    peak = {"flops_per_s": 1e12, "source": "table", "gpu": "X", "precision": "fp32"}
    r = _rank(0, [1.0, 2.0, 2.0], train_flops=[1e12, 2e12, 2e12], train_tokens=[10, 20, 20], peak=peak)
    dp = merge(_cfg("dp"), [r], device="cuda", n_gpu=2).mfu
    assert dp["achieved_tflops"] == pytest.approx(1.0) and dp["peak_tflops"] == pytest.approx(2.0)
    assert dp["mfu"] == pytest.approx(0.5)
    single = merge(_cfg("single"), [r], device="cuda", n_gpu=2).mfu
    assert single["mfu"] == pytest.approx(1.0)


def _users_build():  # never called: merge only names it
    raise AssertionError("not called")


def test_dev_metrics_and_what_a_users_trainer_trained_with():
    from stnb.builds import UserBuild

    own = UserBuild(_users_build)  # the plan's build object: it says what the result's config holds
    r = _rank(0, [1.0, 2.0], dev_metric="sts-dev_spearman_cosine", dev_metric_before=0.1, dev_metric_after=0.7,
              dev_curve=[(0, 0.1), (1, 0.4), (2, 0.7)], build=own.name, training={"per_device_batch_size": 3, "model": "my-model", "loss": "X"},
              overridden_args={"a": 1}, saved_model={"saved_to": "/m", "problems": []},
              start_method="fork", start_method_requested="fork")
    res = merge(_cfg("single"), [r], device="cpu", build=own)
    assert (res.spearman_before, res.spearman_after) == (0.1, 0.7)
    assert (res.dev_metric, res.dev_metric_before, res.dev_metric_after) == ("sts-dev_spearman_cosine", 0.1, 0.7)
    assert res.dev_curve == [(0, 0.1), (1, 0.4), (2, 0.7)]  # rank 0's curve, the result's
    assert res.per_device_batch_size == 3 and res.model == "my-model" and res.build == own.name
    assert res.config["build"] == own.name and res.config["loss"] == "X" and res.config["per_device_batch_size"] == 3
    assert res.config["strategy"] == "single" and "learning_rate" not in res.config
    assert res.overridden_args == {"a": 1} and res.saved_to == "/m" and res.start_method == "fork"
    ir = merge(_cfg("single"), [replace(r, dev_metric="ir_cosine_ndcg@10")], device="cpu")
    assert ir.spearman_before is None and ir.spearman_after is None and ir.dev_metric_after == 0.7
    # one copy: spearman_* are the dev metric when it is a Spearman; results files and tables keep the columns
    d = res.to_dict()
    assert (d["spearman_before"], d["spearman_after"]) == (0.1, 0.7) and ir.to_dict()["spearman_after"] is None
    assert stnb.RunResult.from_dict(d).spearman_after == 0.7
    older = {k: v for k, v in d.items() if not k.startswith("dev_")}  # a results file of an stnb before dev_metric
    older = stnb.RunResult.from_dict(older)
    assert (older.dev_metric, older.dev_metric_before, older.spearman_after) == ("dev_spearman_cosine", 0.1, 0.7)


def test_every_problem_is_in_the_reason():
    bad = _rank(1, [1.0, 2.0], verification={"ok": False, "problems": ["p1", "p2"]}, weight_digests={"w": "b"})
    silent = _rank(0, [1.0, 2.0], verification={"ok": False, "problems": []})
    res = merge(_cfg(), [silent, bad], device="cpu")
    assert not res.verified
    assert res.reason == ("not verified: rank 0: no training step began, so the prepared model was never "
                          "verified; rank 1: p1; p2; weights differ across ranks in 1 of 1 tensor(s), first 'w' "
                          "(ranks [1])")
    v = res.verification
    assert v["weights_identical_across_ranks"] is False and v["weights_tensors_compared"] == 1
    assert v["weights_differing"] == [{"tensor": "w", "ranks": [1]}] and len(v["weights_checksums"]) == 2
    assert v["world_size_requested"] == 2 and v["problems"] == [
        "rank 0: no training step began, so the prepared model was never verified", "rank 1: p1; p2",
        "weights differ across ranks in 1 of 1 tensor(s), first 'w' (ranks [1])"]


def test_cross_rank_checks_start_method_saved_model_and_columns():
    kw = dict(start_method_requested="spawn", saved_model={"saved_to": None, "problems": ["not trained"]},
              data_columns=["anchor", "positive", "score"], loss_inputs={"texts": 2, "label": True})
    r0 = _rank(0, [1.0, 2.0], start_method="spawn", **kw)
    r1 = _rank(1, [1.0, 2.0], start_method="fork", **dict(kw, loss_inputs={"texts": 1, "label": True}))
    res = merge(_cfg(), [r0, r1], device="cpu")
    v = res.verification
    assert v["start_method"] == {"requested": "spawn", "seen": None, "per_rank": ["spawn", "fork"]}
    assert res.start_method is None
    assert v["saved_model"]["problems"] == ["not trained"] and v["loss_received_all_columns"] is False
    assert v["data_columns"] == ["anchor", "positive", "score"]
    assert v["loss_inputs"] == [{"texts": 2, "label": True}, {"texts": 1, "label": True}]
    assert res.reason == ("not verified: start method 'spawn' was requested, the ranks were started by "
                          "['spawn', 'fork']; save_to: not trained; the loss received {'texts': 2, 'label': True} "
                          "but the data has columns ['anchor', 'positive', 'score'] (expected {'texts': 2, "
                          "'label': True})")
    same = merge(_cfg(), [replace(r0, saved_model=None), replace(r1, start_method="fork", loss_inputs=r0.loss_inputs,
                                                             saved_model=None)],
                 device="cpu")
    assert same.verification["start_method"]["seen"] is None  # spawn asked, one rank forked: both differ
    both = [replace(r, start_method="spawn", saved_model=None, loss_inputs={"texts": 2, "label": True}) for r in (r0, r1)]
    ok = merge(_cfg(), both, device="cpu")
    assert ok.verified and ok.start_method == "spawn" and ok.verification["loss_received_all_columns"] is True
    forked = merge(_cfg(), [replace(r, start_method="fork") for r in both], device="cpu")
    assert forked.reason == ("not verified: start method 'spawn' was requested, the ranks were started by "
                             "['fork', 'fork']")


def test_fsdp_shards_must_add_up_to_the_model():
    ok = merge(_cfg("fsdp"), [_rank(0, [1.0, 2.0]), _rank(1, [1.0, 2.0])], device="cpu")
    assert ok.verified and ok.verification["shards_add_up"] is True
    # the shards differ by design and are not in weight_digests; what a rank reports there is replicated
    # (a loss's own classifier, say) and must match across ranks under fsdp too
    assert ok.verification["weights_identical_across_ranks"] is True
    drift = merge(_cfg("fsdp"), [_rank(0, [1.0, 2.0]), _rank(1, [1.0, 2.0], weight_digests={"w": "b"})], device="cpu")
    assert not drift.verified and "weights differ across ranks in 1 of 1 tensor(s), first 'w'" in drift.reason
    bad = merge(_cfg("fsdp"), [_rank(0, [1.0, 2.0]), _rank(0, [1.0, 2.0])], device="cpu")
    assert bad.reason == "not verified: the ranks' local shards hold 20 parameter values, the model has 21"


def test_verification_keeps_each_ranks_record_what_they_saw_and_how_memory_was_read():
    shape = {"params": 21, "hidden": 32, "layers": 2}
    r0 = _rank(0, [1.0, 2.0], verification={"world_size_seen": 2, "mark": "zero"}, model_shape=shape,
               peak_memory_method="cuda.max_memory_allocated")
    r1 = _rank(1, [1.0, 2.0], verification={"world_size_seen": 1, "mark": "one"}, model_shape={"params": 0},
               peak_memory_method="rss")
    v = merge(_cfg(), [r0, r1], device="cpu").verification
    assert [x["mark"] for x in v["ranks"]] == ["zero", "one"]  # every rank's own record, in rank order
    assert v["ranks"][1]["local_param_count"] == 11
    assert v["world_size_requested"] == 2 and v["world_size_seen"] == [1, 2]  # each size a rank was in, once
    assert v["model_shape"] == {"params": 21, "hidden": 32, "layers": 2}  # rank 0's: the model before sharding
    assert v["peak_memory_method"] == "cuda.max_memory_allocated"
    # a rank that never checked its group (no step began) reads None beside the others, without a crash
    unseen = _rank(1, [1.0, 2.0], verification={"ok": False, "world_size_seen": None})
    v = merge(_cfg(), [r0, unseen], device="cpu").verification
    assert v["world_size_seen"] == [2, None]


def test_a_rank_that_returned_no_result_is_named_and_fails_the_run():
    res = merge(_cfg(), [_rank(0, [1.0, 2.0])], device="cpu")
    assert not res.verified and res.world_size == 1  # the world the results came from, not the one asked
    assert res.reason == "not verified: 2 ranks were requested, 1 returned a result"
    assert res.verification["problems"] == ["2 ranks were requested, 1 returned a result"]


def test_zero1_optimizer_partitions_are_checked_against_the_requested_world():
    def part(rank, names, numel):
        return _rank(rank, [1.0, 2.0], verification={
            "optimizer_partition": names, "optimizer_partition_numel": numel, "optimizer_all_numel": 1000,
            "largest_param_numel": 10, "optimizer_state_params": len(names)})

    even = merge(_cfg("zero1"), [part(0, ["a"], 500), part(1, ["b"], 500)], device="cpu")
    assert even.verified and even.verification["optimizer_partition_fractions"] == [0.5, 0.5]
    lopsided = merge(_cfg("zero1"), [part(0, ["a"], 900), part(1, ["b"], 100)], device="cpu")
    ideal = 1000 / 2
    assert not lopsided.verified and lopsided.verification["optimizer_partition_fractions"] == [0.9, 0.1]
    assert lopsided.reason == (f"not verified: a rank's optimizer partition holds 900 of 1000 values; over 2 ranks "
                               f"it should hold about {ideal:.0f}")


def test_each_dataset_is_checked_for_the_columns_its_loss_received():
    cols = {"nli": ["anchor", "positive", "negative"], "sts": ["s1", "s2", "score"], "qa": ["q", "a"]}
    nli, sts = {"texts": 3, "label": False}, {"texts": 2, "label": True}
    r0 = _rank(0, [1.0, 2.0], data_columns=cols, loss_inputs={"nli": nli, "sts": sts})
    r1 = _rank(1, [1.0, 2.0], data_columns=cols, loss_inputs={"nli": nli, "sts": {"texts": 1, "label": True}})
    res = merge(_cfg(), [r0, r1], device="cpu")
    per = res.verification["loss_inputs_per_dataset"]
    assert set(per) == {"nli", "sts", "qa"}
    assert per["nli"] == {"columns": cols["nli"], "expected": nli, "seen": [nli, nli], "ok": True}
    assert per["sts"]["ok"] is False and per["sts"]["seen"] == [sts, {"texts": 1, "label": True}]
    # qa's loss ran on no rank in these steps: nothing to compare, said so, and not a failure
    assert per["qa"]["ok"] is None and per["qa"]["seen"] == [None, None] and "did not run" in per["qa"]["note"]
    assert per["qa"]["expected"] == {"texts": 2, "label": False}
    assert res.verification["loss_received_all_columns"] is False and not res.verified
    assert res.reason == ("not verified: dataset 'sts': the loss received [{'texts': 2, 'label': True}, {'texts': 1, "
                          "'label': True}] but the data has columns ['s1', 's2', 'score'] (expected {'texts': 2, "
                          "'label': True})")
    # rank 1's losses never ran (no inputs recorded): rank 0's are compared, and all are whole
    whole = merge(_cfg(), [r0, replace(r1, loss_inputs=None)], device="cpu")
    assert whole.verified and whole.verification["loss_received_all_columns"] is True
    assert whole.verification["loss_inputs_per_dataset"]["sts"]["seen"] == [sts, None]
    assert whole.verification["loss_inputs_per_dataset"]["sts"]["ok"] is True


def test_merge_names_the_strategy_launcher_versions_and_keeps_each_ranks_time_and_memory_split():
    import importlib.metadata as md

    def split(end):
        return {"steps": [{"backward_compute_end": end, "comm_exposed": 0.4}]}

    def calls(n):
        return {"per_step": [{"all_gather": {"count": n, "bytes": 8 * n}}]}

    r0 = _rank(0, [1.0, 2.0], time_split=split(1.0), memory_split={"peak": 100, "params": 60, "other": 40},
               collectives=calls(2))
    r1 = _rank(1, [1.0, 2.0], time_split=split(1.5), memory_split={"peak": 101, "params": 30, "other": 71},
               collectives=calls(3))
    res = merge(_cfg("zero2"), [r0, r1], device="cpu", launcher="torchrun")
    assert res.strategy == "zero2" and res.launcher == "torchrun"
    assert [m["params"] for m in res.memory_split] == [60, 30]  # where each rank's own peak went
    assert res.collectives == [calls(2), calls(3)]  # each rank's own collective calls, in rank order
    assert res.versions["torch"] == md.version("torch")
    # rank 0 finished its backward 0.5 s before rank 1: 0.4 s of its exposed communication was waiting
    assert [s["steps"][0]["wait"] for s in res.time_split] == [pytest.approx(0.4), 0.0]
    assert [s["steps"][0]["comm_exposed"] for s in res.time_split] == [pytest.approx(0.0), pytest.approx(0.4)]


def test_sub_second_steps_have_a_throughput_and_unverified_ranks_count_no_parameters():
    r0 = _rank(0, [0.5, 0.1, 0.2], verification={"ok": False, "total_param_count": None})
    r1 = _rank(1, [0.5, 0.1, 0.3], verification={"ok": False, "total_param_count": None})
    res = merge(_cfg(), [r0, r1], device="cpu")
    assert res.samples_per_second == pytest.approx(8 * 2 / (0.1 + 0.3))
    assert res.total_param_count == 0 and res.to_row()["local_param_fraction"] is None


def test_mfu_counts_the_flops_of_the_measured_steps_every_rank_took_per_sample():
    r0 = _rank(0, [1.0, 1.0, 1.0], train_flops=[5.0, 2.0, 4.0], train_tokens=[50, 20, 40])
    r1 = _rank(1, [1.0, 1.0, 1.0, 1.0], train_flops=[5.0, 3.0, 1.0, 100.0], train_tokens=[50, 30, 10, 1000])
    mfu = merge(_cfg(), [r0, r1], device="cpu").mfu
    samples = 8 * 2  # steps 1 and 2 (step 0 is warm-up; rank 1's step 3 is past the steps every rank took)
    assert mfu["flops_per_sample"] == pytest.approx((2.0 + 4.0 + 3.0 + 1.0) / samples)
    assert mfu["tokens_per_sample"] == pytest.approx((20 + 40 + 30 + 10) / samples)
    assert mfu["mfu"] is None and mfu["peak_source"].startswith("none: CPU run")


def test_checkpoints_merge_with_the_slowest_ranks_seconds_and_every_ranks_bytes():
    """RunResult.checkpoints: rank 0's list of saves, each with the slowest rank's seconds and rank 0's record of
    the bytes every rank wrote; resumed_from is rank 0's."""
    saves = [[{"step": 2, "path": "c-2", "seconds": 0.5, "bytes_written": [10, 1]},
              {"step": 4, "path": "c-4", "seconds": 0.2, "bytes_written": [11, 1]}],
             [{"step": 2, "path": "c-2", "seconds": 0.3, "bytes_written": None},
              {"step": 4, "path": "c-4", "seconds": 0.9, "bytes_written": None}]]
    resumed = {"path": "c-0", "step": 0, "started_at_step": 0}
    res = merge(_cfg(), [_rank(0, [1.0, 1.0], checkpoints=saves[0], resumed_from=resumed),
                         _rank(1, [1.0, 1.0], checkpoints=saves[1])], device="cpu")
    assert res.checkpoints == [{"step": 2, "path": "c-2", "seconds": 0.5, "bytes_written": [10, 1]},
                               {"step": 4, "path": "c-4", "seconds": 0.9, "bytes_written": [11, 1]}]
    assert res.resumed_from == resumed
