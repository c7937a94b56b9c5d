"""``stnb.parity``'s verdict in this process, no rank started: what it says of runs it is handed.

The slow tests/test_parity.py trains real runs; here the runs are what ``stnb.parity`` reads back from them
(``_Run``: a real ``RunResult``, the tensors before and after training), made up with values whose
differences are exact in float32 (sums of powers of two, 3-4-5 triangles), so every ratio below is derived
by hand, not recomputed with parity's formula. Each threshold is met exactly (within: ``<=``) and missed by
the smallest step; each way a run fails is stated word for word, and a NaN never passes.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from stnb.parity import (DEFAULT_TOLERANCE, ROUNDING_FACTOR, Parity, _compare, _loss_apart, _overall, _ratio, _Run,
                         _verdict)
from stnb.results import RunResult

WORDS = "embeddings.word_embeddings.weight"        # moved 100 by the reference: [0, 0] -> [60, 80]
KEY = "encoder.layer.0.attention.self.key.bias"    # moved 1.25: [0, 0] -> [0.75, 1]; rounding moves it 0.25
CLS = "loss/loss.classifier.weight"                # the loss's own; moved 0.5: [1, 1] -> [1, 1.5]
START = {WORDS: [0.0, 0.0], KEY: [0.0, 0.0], CLS: [1.0, 1.0]}
END = {WORDS: [60.0, 80.0], KEY: [0.75, 1.0], CLS: [1.0, 1.5]}
OWNERS = {WORDS: "model", KEY: "model", CLS: "loss"}
LOSSES = [1.25, 1.0, 0.5]  # the reference's logged losses, one per step


def _result(strategy="single", world=1, global_batch=8, losses=LOSSES, verified=True, reason=""):
    return RunResult(strategy=strategy, world_size=world, per_device_batch_size=global_batch // world,
                     global_batch_size=global_batch, steps=len(losses), samples_per_second=12.5,
                     step_times=[0.1] * len(losses), losses=list(losses), peak_memory_bytes=[0] * world,
                     local_param_count=[3] * world, total_param_count=6, verified=verified, verification={},
                     model="tiny", device="cpu", versions={}, reason=reason)


def _tensors(values: dict) -> dict:
    return {n: torch.tensor(v, dtype=torch.float32) for n, v in values.items()}


def _run(name="ddp", trained=None, initial=None, reason="", **result):
    """A run as ``_train`` returns it: ``trained`` the reference's ends with these tensors replaced."""
    world = 1 if name.startswith("single") else 2
    return _Run(name, result=_result(strategy=name.split(",")[0], world=world, **result), reason=reason,
                initial=_tensors({**START, **(initial or {})}), trained=_tensors({**END, **(trained or {})}),
                owners=dict(OWNERS))


def _ref():
    return _run("single")


def _rounding(key=(0.75, 1.25)):
    """The rows-reversed run: KEY ends 0.25 from the reference (its allowance 10 x 0.25 = 2.5, twice its
    movement), everything else exactly where the reference ended."""
    return _run("single, rows reversed", trained={KEY: list(key)})


# ---- _ratio, _loss_apart, _overall ----------------------------------------------------------------

def test_ratio_is_a_share_and_nothing_over_nothing_is_zero_but_something_over_nothing_is_infinite():
    assert _ratio(1.0, 4.0) == 0.25
    assert _ratio(0.25, 0.5) == 0.5  # a movement under 1 divides too
    assert _ratio(0.0, 0.0) == 0.0  # a tensor that neither moved nor ended apart
    assert _ratio(1e-30, 0.0) == math.inf  # apart from a tensor one device never moved: never within
    assert _ratio(0.5, -1.0) == math.inf  # only a positive movement divides
    assert math.isnan(_ratio(math.nan, 2.0))


def test_loss_apart_is_the_largest_relative_difference_of_the_steps_losses():
    # step by step: |1.25-1.25|/1.25 = 0, |1.2-1|/1 = 0.2 (rounded), |0.625-0.5|/0.5 = 0.25
    assert _loss_apart(_run(losses=[1.25, 1.2, 0.625]), _ref()) == 0.25
    assert _loss_apart(_run(losses=[1.25, 1.25, 0.5]), _ref()) == 0.25  # the largest is the middle step's
    assert _loss_apart(_run(losses=LOSSES), _ref()) == 0.0
    # relative to the size of the reference's loss, negative losses too (|-1.5 - -2| / 2)
    assert _loss_apart(_run(losses=[-1.5]), _run("single", losses=[-2.0])) == 0.25
    # a reference loss of 0 is divided by 1e-12, not by 0
    assert _loss_apart(_run(losses=[1e-12]), _run("single", losses=[0.0])) == 1.0


def test_loss_apart_is_none_without_the_same_steps_to_compare_and_nan_when_a_loss_is_nan():
    assert _loss_apart(_run(losses=[1.25, 1.0]), _ref()) is None  # other steps logged
    assert _loss_apart(_run(losses=[]), _ref()) is None
    assert _loss_apart(_run(), _run("single", losses=[])) is None
    assert _loss_apart(_Run("ddp", reason="refused before launch: no"), _ref()) is None
    assert _loss_apart(_run(), _Run("single", reason="LaunchError: rank 0 failed")) is None
    # a NaN step is the largest difference, wherever it is, never hidden behind the others
    assert math.isnan(_loss_apart(_run(losses=[1.25, math.nan, 1.0]), _ref()))
    assert math.isnan(_loss_apart(_run(losses=[math.nan, 1.0, 1.0]), _ref()))


def test_overall_is_all_tensors_apart_over_all_tensors_moved():
    # apart: WORDS 3 ([60, 83]), KEY 4 ([4.75, 1]), CLS 0 -> sqrt(9 + 16) = 5; moved: sqrt(100^2 + 1.25^2 + 0.5^2)
    run = _run(trained={WORDS: [60.0, 83.0], KEY: [4.75, 1.0]})
    assert _overall(run, _ref()) == pytest.approx(5 / math.sqrt(10001.8125), rel=1e-6)
    assert _overall(_ref(), _ref()) == 0.0
    assert math.isnan(_overall(_run(trained={KEY: [math.nan, 1.0]}), _ref()))


def test_overall_is_none_when_there_is_nothing_to_compare():
    assert _overall(_Run("ddp", reason="refused before launch: no"), _ref()) is None
    assert _overall(_run(), _Run("single", reason="LaunchError: rank 0 failed")) is None
    other = _run()
    other.trained["loss/loss.temperature"] = torch.tensor([1.0])
    assert _overall(other, _ref()) is None  # other tensors than the reference's
    empty = _run()
    empty.trained = {}
    assert _overall(empty, _ref()) is None


def test_overall_of_a_reference_that_did_not_move():
    still = _run("single", trained=START)
    assert _overall(still, still) == 0.0
    assert _overall(_run(), still) == math.inf


# ---- _compare: one run against the reference --------------------------------------------------------

def _row(run, tolerance=DEFAULT_TOLERANCE, rounding=None):
    row, per_param = _compare(run, _ref(), rounding, tolerance)
    return row, {p["parameter"]: p for p in per_param}


def test_a_tensor_exactly_at_the_tolerance_is_within_and_the_row_passes():
    # WORDS ends 1 from the reference's [60, 80]: tolerance 0.01 x moved 100 = 1, exactly what is allowed
    row, p = _row(_run(trained={WORDS: [60.0, 81.0]}))
    assert p[WORDS] == {"strategy": "ddp", "parameter": WORDS, "owner": "model", "moved": 100.0, "apart": 1.0,
                        "rounding": 0.0, "relative": 0.01, "allowed": 0.01, "within": True}
    assert (p[KEY]["moved"], p[KEY]["apart"], p[KEY]["relative"], p[KEY]["within"]) == (1.25, 0.0, 0.0, True)
    assert (p[CLS]["owner"], p[CLS]["moved"], p[CLS]["within"]) == ("loss", 0.5, True)
    assert row == {"strategy": "ddp", "verified": True, "world_size": 2, "global_batch_size": 8, "parameters": 3,
                   "over_tolerance": 0, "max_relative": 0.01, "allowed": 0.01, "worst_parameter": WORDS,
                   "loss_apart": 0.0, "reason": "", "passed": True}


def test_a_tensor_past_the_tolerance_fails_the_row_naming_it_word_for_word():
    # 1 + 1/128 from the reference: 0.010078125 of its movement, over 0.01
    row, p = _row(_run(trained={WORDS: [60.0, 81.0078125]}))
    assert p[WORDS]["apart"] == 1.0078125 and not p[WORDS]["within"]
    assert (row["passed"], row["over_tolerance"], row["parameters"]) == (False, 1, 3)
    assert row["reason"] == ("1 parameter(s) ended further from one device than 0.01 of how far training moved "
                             f"them (and than 10 x rounding): model: {WORDS} (0.01)")
    # the same tensor with a tolerance a hair above its share passes; one a hair below fails
    assert _row(_run(trained={WORDS: [60.0, 81.0078125]}), tolerance=0.0100782)[0]["passed"]
    assert not _row(_run(trained={WORDS: [60.0, 81.0]}), tolerance=0.0099999)[0]["passed"]


def test_the_rounding_allowance_at_ten_times_the_rounding_runs_distance_and_just_past_it():
    # KEY: rounding ended 0.25 from the reference, so 2.5 apart is allowed: twice its movement of 1.25
    row, p = _row(_run(trained={KEY: [0.75, 3.5]}), rounding=_rounding())
    assert ROUNDING_FACTOR == 10
    assert p[KEY] == {"strategy": "ddp", "parameter": KEY, "owner": "model", "moved": 1.25, "apart": 2.5,
                      "rounding": 0.25, "relative": 2.0, "allowed": 2.0, "within": True}
    assert row["passed"] and row["worst_parameter"] == KEY and (row["max_relative"], row["allowed"]) == (2.0, 2.0)
    # the tolerance still applies where it allows more than rounding does (WORDS: rounding 0, allowed 0.01)
    assert (p[WORDS]["rounding"], p[WORDS]["allowed"]) == (0.0, 0.01)
    row, p = _row(_run(trained={KEY: [0.75, 3.5078125]}), rounding=_rounding())
    assert not p[KEY]["within"] and p[KEY]["relative"] == 2.00625
    assert row["reason"] == ("1 parameter(s) ended further from one device than 0.01 of how far training moved "
                             f"them (and than 10 x rounding): model: {KEY} (2)")
    # without the rounding run the same tensor is judged against the tolerance alone
    row, p = _row(_run(trained={KEY: [0.75, 3.5]}))
    assert not row["passed"] and (p[KEY]["rounding"], p[KEY]["allowed"]) == (0.0, 0.01)


def test_a_rounding_run_without_the_tensor_gives_it_no_allowance():
    rounding = _rounding()
    del rounding.trained[KEY]
    _, p = _row(_run(trained={KEY: [0.75, 3.5]}), rounding=rounding)
    assert (p[KEY]["rounding"], p[KEY]["within"]) == (0.0, False)
    rounding.trained = {}
    _, p = _row(_run(trained={KEY: [0.75, 3.5]}), rounding=rounding)
    assert (p[KEY]["rounding"], p[KEY]["within"]) == (0.0, False)


def test_a_tensor_one_device_did_not_move_must_end_exactly_where_it_started():
    ref = _run("single", trained={KEY: [0.0, 0.0]})
    row, per_param = _compare(_run(trained={KEY: [0.0, 0.0]}), ref, None, DEFAULT_TOLERANCE)
    key = next(p for p in per_param if p["parameter"] == KEY)
    assert (key["moved"], key["apart"], key["relative"], key["allowed"], key["within"]) == (0.0, 0.0, 0.0, 0.0, True)
    assert row["passed"]
    row, per_param = _compare(_run(trained={KEY: [0.0, 2.0 ** -20]}), ref, None, DEFAULT_TOLERANCE)
    key = next(p for p in per_param if p["parameter"] == KEY)
    assert (key["relative"], key["within"]) == (math.inf, False) and not row["passed"]
    assert row["reason"].endswith(f"model: {KEY} (inf)")


def test_the_worst_parameter_is_the_largest_share_of_what_it_is_allowed():
    # KEY 2.5 apart: 2 of its movement, allowed 2 (rounding) -> share 1; WORDS 0.5 apart: 0.005, allowed 0.01 ->
    # share 0.5. KEY is the worst, though its relative difference is 400 times WORDS'
    row, _ = _row(_run(trained={KEY: [0.75, 3.5], WORDS: [60.0, 80.5]}), rounding=_rounding())
    assert (row["worst_parameter"], row["max_relative"], row["allowed"]) == (KEY, 2.0, 2.0)
    # KEY at 1 apart (0.8 of its movement, share 0.4) is now less of its allowance than WORDS (0.5)
    row, _ = _row(_run(trained={KEY: [0.75, 2.0], WORDS: [60.0, 80.5]}), rounding=_rounding())
    assert (row["worst_parameter"], row["max_relative"], row["allowed"]) == (WORDS, 0.005, 0.01)


@pytest.mark.parametrize("n", [5, 6, 7])
def test_the_loss_own_tensors_are_named_first_then_at_most_five_of_the_model_worst_first(n):
    names = [f"encoder.layer.{i}.output.dense.weight" for i in range(n)]
    start = {n: [0.0, 0.0] for n in names}
    end = {n: [3.0, 4.0] for n in names}  # each moved 5
    # layer i ends i + 1 apart: relative (i + 1) / 5, all over 0.01
    trained = {**end, **{n: [3.0, 5.0 + i] for i, n in enumerate(names)}, CLS: [1.0, 2.0]}
    ref = _Run("single", result=_result(), initial=_tensors({**START, **start}), trained=_tensors({**END, **end}),
               owners={**OWNERS, **{n: "model" for n in names}})
    run = _Run("zero1", result=_result("zero1", world=2), initial=_tensors({**START, **start}),
               trained=_tensors({**END, **trained}), owners=ref.owners)
    row, _ = _compare(run, ref, None, DEFAULT_TOLERANCE)
    worst = ", ".join(f"{names[i]} ({(i + 1) / 5:.2g})" for i in range(n - 1, n - 6, -1))
    more = {5: "", 6: " and 1 more", 7: " and 2 more"}[n]
    assert row["reason"] == (f"{n + 1} parameter(s) ended further from one device than 0.01 of how far training moved "
                             f"them (and than 10 x rounding): loss: {CLS} (1); model: {worst}{more}")
    assert (row["over_tolerance"], row["parameters"], row["worst_parameter"]) == (n + 1, n + 3, names[-1])


def test_a_run_that_was_not_verified_fails_even_with_every_tensor_within():
    run = _run(reason="not verified: replicated weights differ across ranks (embeddings.word_embeddings.weight)",
               verified=False)
    row, p = _row(run)
    assert all(x["within"] for x in p.values()) and not row["verified"] and not row["passed"]
    assert row["reason"] == "not verified: replicated weights differ across ranks (embeddings.word_embeddings.weight)"


def test_another_global_batch_fails_naming_both():
    row, _ = _row(_run(global_batch=4))
    assert not row["passed"] and row["global_batch_size"] == 4
    assert row["reason"] == "global batch 4, not the one-device run's 8"


def test_other_tensors_than_the_reference_fail_naming_them():
    run = _run()
    run.trained["loss/loss.temperature"] = torch.tensor([0.05])
    del run.trained[CLS]
    row, p = _row(run)
    assert sorted(p) == [WORDS, KEY]  # the tensors both have are still compared
    assert not row["passed"] and row["parameters"] == 2
    assert row["reason"] == f"other tensors than the one-device run: ['{CLS}', 'loss/loss.temperature']"
    many = _run()
    many.trained.update({f"extra.{i}": torch.tensor([0.0]) for i in range(7)})
    assert _row(many)[0]["reason"] == ("other tensors than the one-device run: "
                                       "['extra.0', 'extra.1', 'extra.2', 'extra.3', 'extra.4']")


def test_a_run_with_none_of_the_reference_tensors_compares_nothing_and_fails():
    run = _Run("ddp", result=_result("ddp", world=2), initial=_tensors({"other.weight": [0.0]}),
               trained=_tensors({"other.weight": [1.0]}), owners={"other.weight": "model"})
    row, per_param = _compare(run, _ref(), None, DEFAULT_TOLERANCE)
    assert per_param == [] and not row["passed"] and (row["parameters"], row["over_tolerance"]) == (0, 0)
    assert row["worst_parameter"] is None and math.isnan(row["max_relative"]) and math.isnan(row["allowed"])
    assert row["reason"] == f"other tensors than the one-device run: ['{WORDS}', '{KEY}', '{CLS}', 'other.weight']"


@pytest.mark.parametrize("initial", [{WORDS: [0.0, 2.0 ** -10]}, {WORDS: [0.0, 0.0, 0.0]}, {WORDS: [math.nan, 0.0]}],
                         ids=["another-value", "another-shape", "nan"])
def test_a_run_that_started_elsewhere_fails_naming_the_tensor(initial):
    row, p = _row(_run(initial=initial))
    assert all(x["within"] for x in p.values())  # it ended where one device did, but did not start there
    assert not row["passed"] and row["reason"] == f"{WORDS} did not start from the one-device run's values"


def test_a_run_without_the_tensors_initial_values_fails_naming_it():
    run = _run()
    del run.initial[KEY]
    row, _ = _row(run)
    assert not row["passed"] and row["reason"] == f"{KEY} did not start from the one-device run's values"


def test_every_problem_is_said_in_the_order_found():
    run = _run(reason="not verified: world size 1, asked 2", verified=False, global_batch=16,
               trained={WORDS: [60.0, 82.0]}, initial={KEY: [0.0, 1.0]})
    row, _ = _row(run)
    assert row["reason"] == ("not verified: world size 1, asked 2; global batch 16, not the one-device run's 8; "
                             f"{KEY} did not start from the one-device run's values; 1 parameter(s) ended further "
                             "from one device than 0.01 of how far training moved them (and than 10 x rounding): "
                             f"model: {WORDS} (0.02)")


def test_a_nan_tensor_is_never_within_and_is_named_as_the_worst():
    row, p = _row(_run(trained={KEY: [math.nan, 1.0], WORDS: [60.0, 80.5]}))
    assert math.isnan(p[KEY]["apart"]) and not p[KEY]["within"] and p[WORDS]["within"]
    assert not row["passed"] and row["worst_parameter"] == KEY and math.isnan(row["max_relative"])
    assert row["reason"].endswith(f"(and than 10 x rounding): model: {KEY} (nan)")
    # NaN named before a tensor that is far over, and first in the failures
    row, _ = _row(_run(trained={KEY: [math.nan, 1.0], WORDS: [60.0, 180.0]}))
    assert row["worst_parameter"] == KEY and row["reason"].endswith(f"model: {KEY} (nan), {WORDS} (1)")
    # a reference that ended NaN passes nothing, itself included
    nan_ref = _run("single", trained={KEY: [math.nan, 1.0]})
    for run in (nan_ref, _run(trained={KEY: [math.nan, 1.0]}), _run()):
        row, per_param = _compare(run, nan_ref, None, DEFAULT_TOLERANCE)
        assert not row["passed"] and not next(x for x in per_param if x["parameter"] == KEY)["within"]


def test_nothing_to_compare_with_says_why():
    failed_ref = _Run("single", reason="LaunchError: rank 0 raised MemoryError")
    row, per_param = _compare(_run(), failed_ref, None, DEFAULT_TOLERANCE)
    assert per_param == [] and not row["passed"] and row["worst_parameter"] is None
    assert (row["parameters"], row["over_tolerance"]) == (0, 0)
    assert row["reason"] == "the one-device run gave nothing to compare with: LaunchError: rank 0 raised MemoryError"
    assert math.isnan(row["max_relative"]) and math.isnan(row["allowed"])
    # a run of its own that gave nothing says its own reason
    refused = _Run("deepspeed", reason="refused before launch: your build function uses SoftmaxLoss")
    row, per_param = _compare(refused, _ref(), None, DEFAULT_TOLERANCE)
    assert per_param == [] and not row["passed"] and not row["verified"]
    assert (row["world_size"], row["global_batch_size"], row["loss_apart"]) == (None, None, None)
    assert row["reason"] == "refused before launch: your build function uses SoftmaxLoss"
    unsaved = _Run("fsdp", result=_result("fsdp", world=2), reason="the trained model was not saved")
    row, _ = _compare(unsaved, _ref(), None, DEFAULT_TOLERANCE)
    assert (row["verified"], row["world_size"], row["passed"]) == (True, 2, False)
    assert row["reason"] == "the trained model was not saved"


# ---- _verdict: the whole Parity ---------------------------------------------------------------------

def _parity(*strategies, rounding=None, ref=None, tolerance=DEFAULT_TOLERANCE, dropout="off") -> Parity:
    return _verdict([ref or _ref(), rounding or _rounding(), *strategies], tolerance, dropout)


def test_every_run_within_passes_and_the_table_says_so():
    p = _parity(_run(trained={KEY: [0.75, 3.5]}), _run("fsdp"))
    assert p.passed and p.tolerance == 0.01 and p.dropout == "off" and p.global_batch_size == 8
    t = p.table.set_index("strategy")
    assert list(p.table["role"]) == ["reference", "rounding", "strategy", "strategy"]
    assert list(t.index) == ["single", "single, rows reversed", "ddp", "fsdp"]
    assert t["passed"].tolist() == [True, True, True, True] and t["reason"].tolist() == ["", "", "", ""]
    # the rounding run: 0.25 apart, all tensors together moved sqrt(100^2 + 1.25^2 + 0.5^2)
    assert t.loc["single, rows reversed", "overall"] == pytest.approx(0.25 / math.sqrt(10001.8125), rel=1e-6)
    assert t.loc["ddp", "overall"] == pytest.approx(2.5 / math.sqrt(10001.8125), rel=1e-6)
    assert (t.loc["single", "overall"], t.loc["fsdp", "overall"]) == (0.0, 0.0)
    assert (t.loc["ddp", "worst_parameter"], t.loc["ddp", "max_relative"], t.loc["ddp", "allowed"]) == (KEY, 2.0, 2.0)
    # one row per run and tensor, the rounding run's included (its own allowance: 10 x itself)
    assert len(p.parameters) == 12 and list(p.parameters.columns) == [
        "strategy", "parameter", "owner", "moved", "apart", "rounding", "relative", "allowed", "within"]
    assert set(p.results) == {"single", "single, rows reversed", "ddp", "fsdp"}
    assert p.results["ddp"].strategy == "ddp" and p.failures().empty


def test_one_failing_strategy_fails_the_whole_and_is_listed_worst_first():
    p = _parity(_run(), _run("zero2", trained={WORDS: [60.0, 82.0], CLS: [1.0, 1.75]}))
    assert not p.passed
    t = p.table.set_index("strategy")
    assert t.loc["ddp", "passed"] and not t.loc["zero2", "passed"]
    f = p.failures()
    assert f["parameter"].tolist() == [CLS, WORDS] and f["relative"].tolist() == [0.5, 0.02]
    assert set(f["strategy"]) == {"zero2"}


def test_the_rounding_run_is_not_the_same_training_no_allowance_and_said_word_for_word():
    # KEY 1.25 from the reference in the reversed run: overall 1.25 / sqrt(10001.8125) = 0.0125 > 0.01
    p = _parity(_run(trained={KEY: [0.75, 3.5]}), rounding=_rounding(key=(0.75, 2.25)))
    rounding = p.table.set_index("role").loc["rounding"]
    assert not rounding["passed"]
    assert rounding["reason"] == ("ended 0.012 of how far training moved the model from the one-device run, overall, "
                                  "with only the order of each batch's rows reversed: the loss depends on the order "
                                  "of the rows, so rounding cannot be told apart; no rounding allowance")
    ddp = p.parameters[(p.parameters["strategy"] == "ddp") & (p.parameters["parameter"] == KEY)].iloc[0]
    assert (ddp["rounding"], ddp["allowed"], ddp["within"]) == (0.0, 0.01, False)
    assert not p.passed


def test_the_rounding_run_exactly_at_the_tolerance_overall_gives_its_allowance():
    # only WORDS moved (100), and the reversed run ended 1 apart: overall 1 / 100 = 0.01 exactly
    words_only = {KEY: START[KEY], CLS: START[CLS]}
    ref = _run("single", trained=words_only)
    strategy = _run(trained={**words_only, WORDS: [60.0, 90.0]})  # 10 apart: 10 x the rounding run's 1
    at = _run("single, rows reversed", trained={**words_only, WORDS: [60.0, 81.0]})
    p = _verdict([ref, at, strategy], 0.01, "off")
    t = p.table.set_index("role")
    assert (t.loc["rounding", "overall"], t.loc["rounding", "passed"], t.loc["rounding", "reason"]) == (0.01, True, "")
    assert p.passed and (t.loc["strategy", "max_relative"], t.loc["strategy", "allowed"]) == (0.1, 0.1)
    past = _run("single, rows reversed", trained={**words_only, WORDS: [60.0, 81.0078125]})
    p = _verdict([ref, past, strategy], 0.01, "off")
    t = p.table.set_index("role")
    assert not t.loc["rounding", "passed"] and t.loc["rounding", "reason"].startswith("ended 0.01 of how far")
    assert not p.passed and (t.loc["strategy", "max_relative"], t.loc["strategy", "allowed"]) == (0.1, 0.01)


def test_a_rounding_run_that_was_not_verified_gives_no_allowance():
    rounding = _run("single, rows reversed", trained={KEY: [0.75, 1.25]}, verified=False,
                    reason="not verified: the saved model differs from the trained one")
    p = _parity(_run(trained={KEY: [0.75, 3.5]}), rounding=rounding)
    t = p.table.set_index("role")
    assert not t.loc["rounding", "passed"]
    assert t.loc["rounding", "reason"] == "not verified: the saved model differs from the trained one"
    # no allowance: the rounding run's own KEY (0.2 of its movement) is over the tolerance too
    assert not p.passed and p.failures()[["strategy", "parameter"]].values.tolist() == [
        ["ddp", KEY], ["single, rows reversed", KEY]]


def test_a_nan_rounding_run_gives_no_allowance_and_says_nan():
    p = _parity(_run(trained={KEY: [0.75, 3.5]}), rounding=_rounding(key=(math.nan, 1.0)))
    t = p.table.set_index("role")
    assert not t.loc["rounding", "passed"] and math.isnan(t.loc["rounding", "overall"])
    assert t.loc["rounding", "reason"] == ("1 parameter(s) ended further from one device than 0.01 of how far "
                                           f"training moved them (and than 10 x rounding): model: {KEY} (nan)")
    assert not p.passed


@pytest.mark.parametrize("elsewhere, reason", [
    (dict(initial={KEY: [0.0, 2.0 ** -10]}), f"{KEY} did not start from the one-device run's values"),
    (dict(global_batch=16), "global batch 16, not the one-device run's 8")], ids=["start", "batch"])
def test_a_rounding_run_that_is_not_the_same_training_gives_no_allowance(elsewhere, reason):
    """Within the tolerance overall, but from other initial values or with another batch: not the same training."""
    rounding = _run("single, rows reversed", trained={KEY: [0.75, 1.25]}, **elsewhere)
    p = _parity(_run(trained={KEY: [0.75, 3.5]}), rounding=rounding)
    t = p.table.set_index("role")
    assert t.loc["rounding", "overall"] < 0.01 and not t.loc["rounding", "passed"]
    assert t.loc["rounding", "reason"] == reason
    assert not p.passed and not t.loc["strategy", "passed"]


def test_dropout_kept_there_is_no_rounding_run_and_strategies_are_judged_by_the_tolerance():
    kept = _Run("single, rows reversed", reason="not run: dropout kept (no rounding allowance)")
    p = _parity(_run(trained={WORDS: [60.0, 80.5]}), rounding=kept, dropout="keep")
    t = p.table.set_index("role")
    assert not t.loc["rounding", "passed"] and pd.isna(t.loc["rounding", "overall"])
    assert t.loc["rounding", "reason"] == "not run: dropout kept (no rounding allowance)"
    assert p.passed and p.dropout == "keep"  # the rounding row is no strategy: it does not fail the whole


def test_a_refused_strategy_fails_the_whole_with_its_reason():
    refused = _Run("deepspeed", reason="refused before launch: your build function uses SoftmaxLoss")
    p = _parity(_run(), refused)
    assert not p.passed
    row = p.table.set_index("strategy").loc["deepspeed"]
    assert (row["passed"], row["verified"], row["parameters"]) == (False, False, 0)
    assert row["reason"] == "refused before launch: your build function uses SoftmaxLoss"
    assert p.results["deepspeed"] is None


def test_a_failed_reference_fails_every_run_and_says_why():
    failed = _Run("single", reason="LaunchError: rank 0 raised MemoryError")
    p = _parity(_run(), ref=failed, rounding=_Run("single, rows reversed", reason="LaunchError: rank 0 raised"))
    assert not p.passed and p.global_batch_size is None and p.table["passed"].tolist() == [False] * 3
    t = p.table.set_index("role")
    assert t.loc["reference", "reason"] == "LaunchError: rank 0 raised MemoryError"
    assert t.loc["strategy", "reason"] == ("the one-device run gave nothing to compare with: LaunchError: rank 0 "
                                           "raised MemoryError")
    assert p.parameters.empty and p.failures().empty and list(p.failures().columns) == [
        "strategy", "parameter", "owner", "moved", "apart", "rounding", "relative", "allowed", "within"]


def test_an_unverified_reference_fails_the_whole_even_when_every_strategy_matches_it():
    ref = _run("single", verified=False, reason="not verified: world size 2, asked 1")
    p = _parity(_run(), ref=ref)
    t = p.table.set_index("role")
    assert not p.passed and not t.loc["reference", "passed"] and t.loc["strategy", "passed"]


def test_the_repr_says_passed_or_failed_with_the_settings_and_each_reason():
    p = _parity(_run(), _run("zero2", trained={WORDS: [60.0, 82.0]}))
    text = repr(p)
    lines = text.splitlines()
    assert lines[0] == ("stnb.parity: FAILED (tolerance 0.01 relative to how far one device moved each tensor; "
                        "global batch 8; dropout off)")
    assert lines[1].split() == ["strategy", "verified", "parameters", "over_tolerance", "overall", "worst_parameter",
                                "max_relative", "allowed", "loss_apart", "passed"]
    assert len(lines) == 1 + 1 + 4 + 1  # the header, the table's rows, one reason
    assert [line.split()[0] for line in lines[2:6]] == ["single", "single,", "ddp", "zero2"]  # no index column
    assert lines[-1] == ("zero2: 1 parameter(s) ended further from one device than 0.01 of how far training moved "
                         f"them (and than 10 x rounding): model: {WORDS} (0.02)")
    assert p._repr_html_() == "<pre>" + text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") \
        .replace('"', "&quot;").replace("'", "&#x27;") + "</pre>"
    ok = _parity(_run(), tolerance=0.05, dropout="keep")
    assert repr(ok).splitlines()[0] == ("stnb.parity: PASSED (tolerance 0.05 relative to how far one device moved "
                                        "each tensor; global batch 8; dropout keep)")
    assert len(repr(ok).splitlines()) == 2 + 3  # no reason line


def test_failures_are_worst_first_nan_before_any_number():
    p = _parity(_run(trained={WORDS: [60.0, 82.0], CLS: [1.0, 1.75]}), _run("fsdp", trained={KEY: [math.nan, 1.0]}))
    f = p.failures()
    assert f["parameter"].tolist() == [KEY, CLS, WORDS] and f["strategy"].tolist() == ["fsdp", "ddp", "ddp"]
    empty = Parity(table=p.table, parameters=p.parameters.iloc[0:0], tolerance=0.01, dropout="off",
                   global_batch_size=8, results={}, passed=False)
    assert empty.failures().empty and isinstance(empty.failures(), pd.DataFrame)
