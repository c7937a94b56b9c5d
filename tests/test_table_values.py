"""What the comparison table behind every figure says, value by value: the sentence-transformers docs'
reference rows, each run's label, its devices, its speed-up and efficiency over the baseline, and the
hover text a reader sees (numbers, units, the run's configuration). Expected values are written out
here from the inputs, never read back from the table."""

from __future__ import annotations

import pandas as pd
import pytest

import stnb
from stnb import RunResult, TrainConfig
from stnb.plots import comparison_table, reference_frame

DOCS = "sentence-transformers docs (4x V100)"
DOCS_URL = "https://sbert.net/docs/sentence_transformer/training/distributed.html"
# the docs' "Distributed Training" table: samples/s on 4x V100, and the speed-up printed beside it
DOCS_TABLE = {"single": (2724.0, 1.0), "dp": (3675.0, 1.349), "ddp": (6980.0, 2.562), "fsdp": (5782.0, 2.122)}


def run(strategy, world_size, sps, *, model="tiny", device="cpu", batch=4, global_batch=None, status="ok", reason="",
        run_id="r", losses=(0.5, 0.25), peaks=None, verified=True, **cfg):
    """A hand-made RunResult (no training): the table reads only what a result records."""
    config = TrainConfig(strategy=strategy, model=model, per_device_batch_size=batch,
                         num_processes=world_size if stnb.strategies.is_distributed(strategy) else None, **cfg).to_dict()
    return RunResult(strategy=strategy, world_size=world_size, per_device_batch_size=batch,
                     global_batch_size=global_batch or batch * world_size, steps=len(losses), samples_per_second=sps,
                     step_times=[0.1] * len(losses), losses=list(losses), peak_memory_bytes=list(peaks or []),
                     local_param_count=[10] * world_size, total_param_count=10, verified=verified, verification={},
                     model=model, device=device, versions={}, status=status, reason=reason, config=config,
                     run_id=run_id)


def rows(table):
    return table.to_dict("records")


# ---- the published reference -------------------------------------------------------------------

def test_reference_rows_are_the_docs_table_and_their_setup():
    frame = reference_frame()
    assert list(frame.strategy) == list(DOCS_TABLE)
    got = rows(frame)
    for r in got:
        sps, speedup = DOCS_TABLE[r["strategy"]]
        one = r["strategy"] == "single"
        assert (r["samples_per_second"], r["published_speedup"]) == (sps, speedup)
        assert r["devices"] == (1 if one else 4)
        assert r["world_size"] == (4 if r["strategy"] in ("ddp", "fsdp") else 1)  # dp: one process, 4 GPUs
        assert (r["per_device_batch_size"], r["global_batch_size"]) == (32, 32 if one else 128)
        assert r["gradient_accumulation_steps"] == 1
        assert r["model"] == "microsoft/mpnet-base" and r["max_seq_length"] == 384
        assert r["total_param_count"] == 109_486_464
        assert r["device"] == "cuda (4x V100, p3.8xlarge)"
        assert (r["status"], r["reason"], r["run_id"]) == ("ok", "", "")
        assert r["verified"] is None and r["steps"] is None
        assert r["losses"] == r["peak_memory_bytes"] == r["memory_breakdown"] == r["local_param_count"] == []
        assert r["launcher"] == "published" and r["loss"] == "as in the sentence-transformers docs"
        assert (r["source"], r["url"]) == (DOCS, DOCS_URL)


def test_reference_rows_in_the_comparison_table_labels_ratios_and_hover():
    """The docs' rows as the figures show them: labelled '(docs)', each speed-up computed over their
    single-GPU run (which matches the speed-up they print), and a hover that says it is theirs."""
    table = comparison_table(stnb.results_frame([]), reference=True)
    assert list(table.label) == ["single (docs)", "dp ×4 (docs)", "ddp ×4 (docs)", "fsdp ×4 (docs)"]
    for r in rows(table):
        sps, printed = DOCS_TABLE[r["strategy"]]
        devices = 1 if r["strategy"] == "single" else 4
        assert r["speedup"] == pytest.approx(sps / 2724.0) and r["speedup"] == pytest.approx(printed, abs=1e-3)  # printed rounded down
        assert r["efficiency"] == pytest.approx(sps / 2724.0 / devices)
        assert r["baseline"] == "single (docs) (2,724.0 samples/s)" and r["baseline_reason"] == ""
        world = 4 if r["strategy"] in ("ddp", "fsdp") else 1
        assert r["hover"] == "<br>".join([
            f"source: {DOCS} (published, not measured here)",
            f"strategy: {r['strategy']} · world size: {world} · devices: {devices}",
            f"batch: 32 per device, {32 * devices} global",
            "model: microsoft/mpnet-base · device: cuda (4x V100, p3.8xlarge) · seq ≤ 384",
            f"samples/s: {sps:,.1f}",
            f"speedup: {sps / 2724.0:.2f}x over single (docs) (2,724.0 samples/s) · "
            f"efficiency: {sps / 2724.0 / devices:.2f}",
            f"from {DOCS_URL}",
        ])
    ddp = table.set_index("strategy").loc["ddp"]
    assert "speedup: 2.56x over single (docs)" in ddp.hover and "efficiency: 0.64" in ddp.hover
    assert "samples/s: 6,980.0" in ddp.hover


# ---- our runs: labels and devices ------------------------------------------------------------------

def test_labels_name_the_strategy_and_its_devices_and_tell_apart_what_differs():
    table = comparison_table([
        run("single", 1, 10.0),
        run("ddp", 1, 10.0),                                          # distributed: its devices even when 1
        run("dp", 1, 10.0, batch=4, global_batch=8),                  # one process, 2 GPUs: from its batch
        run("fsdp", 2, 10.0, model="minilm"), run("fsdp", 2, 10.0),   # the same label: the model tells them apart
        run("zero1", 2, 10.0, batch=4), run("zero1", 2, 10.0, batch=8),          # ... the batch
        run("ddp", 2, 10.0, comm_hook="fp16"), run("ddp", 2, 10.0),              # ... the DDP hook
        run("zero2", 2, 10.0, mixed_precision="bf16"), run("zero2", 2, 10.0),   # ... the precision
        run("zero1", 4, 10.0), run("zero1", 4, 10.0), run("zero1", 4, 10.0),    # nothing: a counter
    ])
    assert list(table.label) == [
        "single", "ddp ×1", "dp ×2", "fsdp ×2 · minilm", "fsdp ×2 · tiny", "zero1 ×2 · b4", "zero1 ×2 · b8",
        "ddp ×2 · hook fp16", "ddp ×2 · hook none", "zero2 ×2 · bf16", "zero2 ×2 · no",
        "zero1 ×4", "zero1 ×4 #2", "zero1 ×4 #3"]
    assert list(table.devices) == [1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4]


def test_labels_add_what_differs_in_order_model_then_batch():
    table = comparison_table([run("ddp", 2, 10.0, model="minilm"), run("ddp", 2, 10.0, batch=4),
                              run("ddp", 2, 10.0, batch=8), run("single", 1, 10.0, batch=8)])
    assert list(table.label) == ["ddp ×2 · minilm", "ddp ×2 · tiny · b4", "ddp ×2 · tiny · b8", "single"]


@pytest.mark.parametrize("batch, global_batch, accumulation, devices", [
    (4, 8, 1, 2),     # 8 samples a step, 4 per GPU: 2 GPUs
    (4, 16, 2, 2),    # 16 samples over 2 accumulated micro-batches of 4 per GPU: 2 GPUs
    (4, 12, 1, 3),
    (4, 14, 1, 4),    # 3.5 rounds to 4
    (4, 2, 1, 1),     # less than one device's batch: still one device
    (4, 4, 1, 1),
])
def test_a_one_process_multi_gpu_runs_devices_follow_from_its_batch(batch, global_batch, accumulation, devices):
    r = run("dp", 1, 30.0, batch=batch, global_batch=global_batch, gradient_accumulation_steps=accumulation)
    frame = stnb.results_frame([run("single", 1, 10.0, batch=batch), r])
    assert "devices" not in frame.columns  # worked out by the table, not recorded by the run
    row = comparison_table(frame).iloc[1]
    assert row["devices"] == devices
    assert row["label"] == ("dp" if devices == 1 else f"dp ×{devices}")
    assert row["efficiency"] == pytest.approx(3.0 / devices)


def test_devices_of_a_row_without_batch_numbers_and_a_recorded_devices_column():
    def devices(**row):
        return list(comparison_table(pd.DataFrame([dict(samples_per_second=5.0, **row)])).devices)[0]

    assert devices(strategy="dp", per_device_batch_size=None, global_batch_size=8) == 1
    assert devices(strategy="dp", per_device_batch_size=4, global_batch_size=None) == 1
    assert devices(strategy="dp", per_device_batch_size=4, global_batch_size=float("nan")) == 1
    assert devices(strategy="dp", per_device_batch_size=4, global_batch_size=8, gradient_accumulation_steps=None) == 2
    assert devices(strategy="ddp", world_size=None) == 1
    assert devices(strategy="ddp", world_size=3) == 3
    assert devices(strategy="ddp", world_size=3, devices=6) == 6           # recorded: kept
    assert devices(strategy="ddp", world_size=3, devices=float("nan")) == 3
    assert devices(strategy="ddp", world_size=3, devices=None) == 3


# ---- speed-up and efficiency over the baseline -------------------------------------------------------

def test_speedup_is_over_the_single_run_of_the_same_model_device_and_batch():
    table = comparison_table([
        run("single", 1, 100.0, batch=4),
        run("single", 1, 80.0, batch=8),
        run("single", 1, 50.0, device="cuda"),
        run("single", 1, 40.0, model="minilm"),
        run("ddp", 2, 150.0, batch=4),                # its batch's single: 100
        run("ddp", 2, 120.0, batch=8),                # 80
        run("ddp", 2, 200.0, device="cuda"),          # the cuda single: 50
        run("fsdp", 2, 60.0, model="minilm"),         # minilm's single: 40
        run("ddp", 2, 160.0, batch=16),               # no batch-16 single: the last of its model/device (80)
    ])
    singles = ["single · tiny · b4 (100.0 samples/s)", "single · tiny · b8 (80.0 samples/s)",
               "single · tiny · b4 #2 (50.0 samples/s)", "single · minilm (40.0 samples/s)"]
    assert list(table.baseline) == singles + [singles[0], singles[1], singles[2], singles[3], singles[1]]
    assert list(table.speedup) == pytest.approx([1.0] * 4 + [150 / 100, 120 / 80, 200 / 50, 60 / 40, 160 / 80])
    assert list(table.efficiency) == pytest.approx([1.0] * 4 + [150 / 200, 120 / 160, 200 / 100, 60 / 80, 160 / 160])
    assert list(table.baseline_reason) == [""] * 9


def test_the_baseline_is_the_last_ok_single_run_and_a_single_run_is_its_own():
    table = comparison_table([
        run("single", 1, 100.0, run_id="a"),
        run("single", 1, 120.0, run_id="b"),
        run("single", 1, 999.0, status="failed", reason="killed", run_id="c"),  # a failed run is no baseline
        run("ddp", 2, 180.0),
    ])
    assert list(table.label) == ["single", "single #2", "single #3", "ddp ×2"]
    assert list(table.speedup[:2]) == [1.0, 1.0]        # 100 over 100, 120 over 120: not over each other
    assert list(table.baseline[:2]) == ["single (100.0 samples/s)", "single #2 (120.0 samples/s)"]
    assert table.speedup[3] == pytest.approx(1.5) and table.efficiency[3] == pytest.approx(0.75)
    assert table.baseline[3] == "single #2 (120.0 samples/s)"
    failed = table.iloc[2]
    assert pd.isna(failed["speedup"]) and pd.isna(failed["efficiency"])
    assert (failed["baseline"], failed["baseline_reason"]) == ("", "")


def test_a_run_without_a_baseline_says_why_and_rows_without_a_number_have_no_ratio():
    table = comparison_table([
        run("single", 1, 100.0, device="cuda"),
        run("ddp", 2, 150.0, model="minilm"),
        run("ddp", 2, None),
        run("dp", 1, None, status="not runnable here", reason="needs 2 GPUs"),
        run("single", 1, 1000.0, status="failed", reason="out of memory"),
    ])
    assert list(table.baseline_reason) == ["", "no 'single' run of model minilm on cpu to compare with", "", "", ""]
    assert list(table.baseline) == ["single (100.0 samples/s)", "", "", "", ""]
    assert table.speedup[0] == 1.0 and table.speedup[1:].isna().all() and table.efficiency[1:].isna().all()
    assert table.speedup.dtype == float and table.efficiency.dtype == float


def test_ours_are_never_compared_with_the_docs_single_gpu_run():
    table = comparison_table([run("single", 1, 10.0), run("ddp", 2, 15.0)], reference=True)
    ours = table[table.source == "this machine"]
    assert list(ours.speedup) == [1.0, 1.5] and list(ours.baseline) == ["single (10.0 samples/s)"] * 2
    assert table[table.source == DOCS].baseline.unique().tolist() == ["single (docs) (2,724.0 samples/s)"]


# ---- the hover text -------------------------------------------------------------------------------

def test_hover_of_our_runs_says_every_number_with_its_unit_and_the_configuration():
    table = comparison_table([
        run("single", 1, 1234.5, run_id="s1", losses=(0.9, 0.12345)),
        run("ddp", 2, 2000.0, run_id="d1", comm_hook="fp16", gradient_as_bucket_view=True, static_graph=True,
            bucket_cap_mb=50, threads_per_rank=2, mixed_precision="bf16", loss="mnrl", max_seq_length=128,
            peaks=[3 * 2**20, 1536 * 2**20], verified=False, losses=(1.0, 0.5, 0.25)),
    ])
    single, ddp = table.hover
    assert single == "<br>".join([
        "source: this machine",
        "strategy: single · world size: 1 · devices: 1",
        "batch: 4 per device, 4 global",
        "model: tiny · device: cpu · seq ≤ 64",
        "steps: 2 · loss: cosine · mixed precision: no",
        "samples/s: 1,234.5",
        "speedup: 1.00x over single (1,234.5 samples/s) · efficiency: 1.00",
        "final loss: 0.1235",
        "verified: True · run s1",
    ])
    assert ddp == "<br>".join([
        "source: this machine",
        "strategy: ddp · world size: 2 · devices: 2",
        "batch: 4 per device, 8 global",
        "model: tiny · device: cpu · seq ≤ 128",
        "steps: 3 · loss: mnrl · mixed precision: bf16 · threads/rank: 2",
        "comm_hook: fp16 · gradient_as_bucket_view: True · static_graph: True · bucket_cap_mb: 50.0 · broadcast_buffers: False",
        "samples/s: 2,000.0",
        "speedup: 1.62x over single (1,234.5 samples/s) · efficiency: 0.81",
        "peak memory per rank: 3 MiB, 1,536 MiB",
        "final loss: 0.2500",
        "verified: False · run d1",
    ])


def test_hover_of_a_ddp_run_with_the_default_bucket_and_accumulated_steps():
    table = comparison_table([run("ddp", 2, 20.0, global_batch=16, gradient_accumulation_steps=2, losses=(),
                                  run_id="d2")])
    assert table.hover[0] == "<br>".join([
        "source: this machine",
        "strategy: ddp · world size: 2 · devices: 2",
        "batch: 4 per device, 16 global (accumulation 2)",
        "model: tiny · device: cpu · seq ≤ 64",
        "steps: 0 · loss: cosine · mixed precision: no",
        "comm_hook: none · gradient_as_bucket_view: False · static_graph: False · bucket_cap_mb: default (25) · "
        "broadcast_buffers: False",  # the strategy's own options, in their declaration's order
        "samples/s: 20.0",
        "verified: True · run d2",
    ])
    assert table.baseline_reason[0] == "no 'single' run of model tiny on cpu to compare with"
    # beside a run that set its bucket size, one that did not still reads 'default (25)' (not 'nan')
    mixed = comparison_table([run("ddp", 2, 20.0), run("ddp", 2, 20.0, bucket_cap_mb=100)])
    assert "bucket_cap_mb: default (25) ·" in mixed.hover[0] and "bucket_cap_mb: 100.0 ·" in mixed.hover[1]


def test_hover_of_a_run_that_could_not_run_gives_the_reason_and_no_numbers():
    table = comparison_table([run("dp", 1, None, status="not runnable here", reason="needs <2> GPUs & CUDA",
                                  losses=(), verified=None, run_id="")])
    assert table.hover[0] == "<br>".join([
        "source: this machine",
        "strategy: dp · world size: 1 · devices: 1",
        "batch: 4 per device, 4 global",
        "model: tiny · device: cpu · seq ≤ 64",
        "steps: 0 · loss: cosine · mixed precision: no",
        "verified: – · run ",
        "status: not runnable here: needs &lt;2&gt; GPUs &amp; CUDA",
    ])


def test_hover_of_a_bare_row_shows_dashes_for_what_was_not_recorded():
    """A row with only a strategy and a number (a hand-made table): every missing value reads '–'."""
    table = comparison_table(pd.DataFrame([{"strategy": "fsdp", "samples_per_second": 7.0,
                                            "per_device_batch_size": float("nan")}]))
    assert table.hover[0] == "<br>".join([
        "source: this machine",
        "strategy: fsdp · world size: 1 · devices: 1",
        "batch: – per device, – global",
        "model: ? · device: ?",
        "steps: – · loss: – · mixed precision: –",
        "samples/s: 7.0",
        "verified: – · run ",
    ])


# ---- what the table accepts, and the values it fills in ---------------------------------------------

def test_the_table_takes_a_run_a_list_a_tuple_or_a_frame_and_refuses_anything_else():
    one = run("single", 1, 10.0)
    for given in (one, [one], (one,), stnb.results_frame([one])):
        table = comparison_table(given)
        assert list(table.label) == ["single"] and list(table.samples_per_second) == [10.0]
    with pytest.raises(TypeError) as e:
        comparison_table("runs.jsonl")
    assert str(e.value) == "expected a results DataFrame (stnb.results_frame / stnb.load_results), got str"


def test_the_table_does_not_change_the_frame_it_was_given():
    frame = stnb.results_frame([run("single", 1, 10.0), run("ddp", 2, 15.0)])
    columns = list(frame.columns)
    table = comparison_table(frame, reference=True)
    assert list(frame.columns) == columns and len(frame) == 2
    # the table's rows are numbered 0..n-1 and it gains no column from renumbering them
    assert list(table.index) == list(range(6)) and not {"index", "level_0"} & set(table.columns)
    assert list(comparison_table(frame.iloc[::-1]).index) == [0, 1]


def test_asking_for_the_reference_twice_shows_it_once_and_keeps_ours():
    ours = stnb.results_frame([run("single", 1, 10.0), run("ddp", 2, 15.0)])
    once = comparison_table(ours, reference=True)
    twice = comparison_table(once, reference=True)
    assert list(twice.source) == ["this machine"] * 2 + [DOCS] * 4
    assert list(twice.label) == ["single", "ddp ×2", "single (docs)", "dp ×4 (docs)", "ddp ×4 (docs)", "fsdp ×4 (docs)"]
    # without reference=True a frame that holds the docs' rows keeps them, and ours are not lost
    kept = comparison_table(once)
    assert list(kept.source) == ["this machine"] * 2 + [DOCS] * 4
    # a row whose source is empty is ours
    unnamed = once.copy()
    unnamed.loc[0, "source"] = None
    assert list(comparison_table(unnamed, reference=True).source) == ["this machine"] * 2 + [DOCS] * 4


def test_a_bare_frame_gets_the_defaults_a_reader_sees():
    table = comparison_table(pd.DataFrame([{"strategy": "single", "samples_per_second": 3.0,
                                            "status": None, "world_size": float("nan")}]))
    r = rows(table)[0]
    assert (r["source"], r["status"], r["reason"], r["model"], r["device"]) == ("this machine", "ok", "", "?", "?")
    assert (r["world_size"], r["gradient_accumulation_steps"], r["run_id"], r["launcher"]) == (1, 1, "", "stnb")
    assert r["losses"] == r["peak_memory_bytes"] == r["memory_breakdown"] == r["local_param_count"] == []
    for col in ("per_device_batch_size", "global_batch_size", "total_param_count", "verified", "steps"):
        assert r[col] is None or pd.isna(r[col]), col
    assert r["label"] == "single" and r["speedup"] == 1.0 and r["model_name"] == "?"


def test_list_columns_are_lists_and_options_come_from_the_config_when_the_row_lacks_them():
    frame = pd.DataFrame([
        {"strategy": "ddp", "world_size": 2, "samples_per_second": 5.0, "losses": (0.5, 0.25),
         "peak_memory_bytes": float("nan"), "comm_hook": None,
         "config": {"comm_hook": "bf16", "max_seq_length": 32, "loss": "mnrl", "threads_per_rank": 3,
                    "mixed_precision": "fp16", "static_graph": True, "bucket_cap_mb": 10,
                    "gradient_as_bucket_view": True}},
        {"strategy": "ddp", "world_size": 2, "samples_per_second": 6.0, "comm_hook": "fp16", "config": "not a dict"},
    ])
    table = comparison_table(frame)
    a, b = rows(table)
    assert a["losses"] == [0.5, 0.25] and a["peak_memory_bytes"] == [] and b["losses"] == []
    assert (a["comm_hook"], a["max_seq_length"], a["loss"], a["threads_per_rank"]) == ("bf16", 32, "mnrl", 3)
    assert (a["mixed_precision"], a["static_graph"], a["bucket_cap_mb"], a["gradient_as_bucket_view"]) == \
        ("fp16", True, 10, True)
    assert b["comm_hook"] == "fp16" and pd.isna(b["max_seq_length"]) and pd.isna(b["loss"])
    assert list(table.label) == ["ddp ×2 · hook bf16", "ddp ×2 · hook fp16"]
    assert "final loss: 0.2500" in a["hover"] and "seq ≤ 32" in a["hover"] and "seq ≤" not in b["hover"]


def test_a_row_without_a_strategy_is_refused_with_the_strategies_there_are():
    from stnb.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        comparison_table(pd.DataFrame([{"samples_per_second": 1.0}]))
    assert str(e.value) == ("unknown strategy '?'; choose one of "
                            + ", ".join(repr(n) for n in stnb.strategies.names()))


def test_is_num_says_which_cells_hold_a_number():
    """The figures plot a cell only when it holds a number: a missing one, NaN or words are not."""
    from stnb.plots.table import is_num

    assert [is_num(v) for v in (3, 2.5, "2.5", 0)] == [True, True, True, True]
    assert [is_num(v) for v in (None, float("nan"), "fast", [1.0], {})] == [False] * 5
    table = comparison_table(pd.DataFrame([{"strategy": "single", "samples_per_second": 4.0},
                                           {"strategy": "ddp", "world_size": 2, "samples_per_second": "n/a"}]))
    assert table.speedup[0] == 1.0 and pd.isna(table.speedup[1]) and table.baseline[1] == ""
    assert "samples/s" not in table.hover[1]
