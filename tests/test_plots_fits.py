"""stnb.plots.fits: stnb.fits's table drawn, a bar only where a strategy trained."""

import pandas as pd

import stnb
from stnb.fits import COLUMNS


def _table():
    rows = [
        dict(strategy="ddp", ranks=None, largest=0, global_batch=0, failed_at=1, predicted=None, held_mib=None,
             budget_mib=3686.4, state_mib=None, samples_per_second=None, runs=1, note="batch 1 ran out of memory"),
        dict(strategy="zero1", ranks=2, largest=7, global_batch=14, failed_at=8, predicted=None, held_mib=3151.5,
             budget_mib=3686.4, state_mib=1248.9, samples_per_second=5.1, runs=5, note=""),
        dict(strategy="fsdp", ranks=2, largest=15, global_batch=30, failed_at=16, predicted=37, held_mib=3203.5,
             budget_mib=3686.4, state_mib=831.9, samples_per_second=4.1, runs=6, note=""),
        dict(strategy="deepspeed", ranks=None, largest=0, global_batch=0, failed_at=None, predicted=None,
             held_mib=None, budget_mib=3686.4, state_mib=None, samples_per_second=None, runs=0, note="refused: x"),
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_a_bar_per_strategy_that_trained_split_into_model_state_and_the_rest():
    fig = stnb.plots.fits(_table())
    state, rest = fig.data
    assert list(state.x) == list(rest.x) == ["ddp", "zero1", "fsdp", "deepspeed"]
    assert list(state.y) == [None, 1248.9, 831.9, None]                     # no bar where nothing trained
    assert [None if v is None else round(v, 1) for v in rest.y] == [None, 1902.6, 2371.6, None]   # held - state
    assert list(rest.text) == ["", "batch 7 trained, 8 did not", "batch 15 trained, 16 did not", ""]


def test_a_batch_that_trained_at_max_batch_says_nothing_larger_was_tried():
    table = _table().astype({"failed_at": "Int64"})        # as stnb.fits returns it: <NA> where none failed
    table.loc[2, "failed_at"] = pd.NA
    assert list(stnb.plots.fits(table).data[1].text) == ["", "batch 7 trained, 8 did not", "batch 15 trained", ""]


def test_the_budget_is_a_line_and_a_strategy_that_trained_nothing_says_why_at_it():
    fig = stnb.plots.fits(_table())
    (line,) = fig.layout.shapes
    assert (line.y0, line.y1, line.line.dash) == (3686.4, 3686.4, "dash")
    said = {a.x: a.text for a in fig.layout.annotations}
    assert said == {0: "budget 3,686 MiB", "ddp": "out of memory at batch 1", "deepspeed": "refused"}
    assert fig.layout.yaxis.range[1] > 3686.4                                # the line is inside the plot


def test_a_run_whose_model_state_was_not_counted_is_drawn_whole_as_the_rest():
    table = _table()
    table.loc[1, "state_mib"] = None                       # a user's trainer whose tensors were not counted
    state, rest = stnb.plots.fits(table).data
    assert (state.y[1], rest.y[1]) == (0.0, 3151.5)
