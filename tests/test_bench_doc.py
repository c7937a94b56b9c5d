"""The benchmarks document (``python -m stnb bench ... --write-doc``): the numbers in it are the run's,
each kind of run replaces only its own sections, text outside the markers is kept, a damaged
document is refused before anything runs. One real run (tiny model, 3 steps); the rest is built
from a summary of synthetic rows.
"""

import json

import pytest

import stnb
from stnb import reference
from stnblab import bench
from stnb.__main__ import main as cli
from stnblab.bench import document

TINY = ["--model", "tiny", "--steps", "3", "--warmup", "1", "--train-size", "64", "--batch-size", "4"]


def section(text: str, name: str) -> str:
    start, end = document.parse_sections(text)[name]
    return text[start:end]


def tables(block: str) -> list:
    """Every markdown table of a section, as lists of {column: cell}."""
    out, lines = [], block.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and lines[i + 1].startswith("| ---") and (i == 0 or not lines[i - 1].startswith("|")):
            head = [c.strip() for c in line.strip("|").split(" | ")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(head, (c.strip() for c in row.strip().strip("|").split(" | ")))))
            out.append(rows)
    return out


def num(cell: str):
    return None if cell == "-" else float(cell.rstrip("x%"))


def synthetic(opts, scale: float = 1.0, mfu=None):
    """Plan ``opts`` and give every runnable item a made-up result row (distinct numbers per repeat)."""
    items = bench.plan(opts)
    latest = {}
    for i, it in enumerate(items):
        row = {"config": it.config.to_dict(), "timestamp": 1_790_000_000.0 + i, "versions": {"torch": "9.9.9"}}
        if it.unavailable:
            row.update(status="not runnable here", reason=it.unavailable)
        else:
            n = it.config.num_processes or 1
            row.update(status="ok", verified=True, samples_per_second=scale * (10.0 + 3.7 * i + 1.3 * it.repeat),
                       step_times=[0.5, 0.25 + 0.01 * i, 0.25], world_size=n, launcher=it.launcher,
                       global_batch_size=it.config.per_device_batch_size * n, time_to_first_step_s=1.5 + i,
                       mfu={"mfu": mfu and mfu * (1 + i / 100), "tokens_per_sample": 20.0})
            if it.section == "checkpoints":  # 4 checkpoints, each rank's bytes and the slowest rank's seconds
                row["checkpoints"] = [{"step": 2 * k + 2, "seconds": 0.1 * i + 0.02 * k,
                                       "bytes_written": [2e6 * (i + 1) * (r + 1) + 1e5 * k for r in range(n)]}
                                      for k in range(4)]
        latest[it.key] = row
    return bench.summarize(items, latest, opts), [latest[it.key] for it in items]


def test_doc_holds_the_summary_numbers_and_updates_one_kind_of_run(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# my benchmarks\n\nwritten by hand, kept.\n")
    opts = bench.BenchOptions.from_preset("quick", repeats=2, doc=str(doc), command="python -m stnb bench --quick")
    summary, rows = synthetic(opts)
    document.write_document(doc, summary, opts, rows, device="cpu")
    text = doc.read_text()
    assert text.startswith("# my benchmarks\n\nwritten by hand, kept.\n")
    names = set(document.parse_sections(text))
    assert names == {"reference", "quick/cpu/sweep", "quick/cpu/launchers", "quick/cpu/knobs", "quick/cpu/checkpoints"}

    sweep = tables(section(text, "quick/cpu/sweep"))[0]
    assert [r["run"] for r in sweep] == [v["variant"] for v in summary["sections"]["sweep"]]
    for r, v in zip(sweep, summary["sections"]["sweep"]):
        if v["status"] == "ok":
            assert num(r["samples/s"]) == pytest.approx(v["samples_per_second"], abs=0.05)
            assert num(r["step s"]) == pytest.approx(v["step_s"], abs=5e-4)
        else:
            assert r["samples/s"] == "-" and r["status"].startswith("not runnable here")
    assert "MFU" not in sweep[0], "no MFU column for a CPU run without MFU"

    la = summary["sections"]["launchers"]
    variants, ratios, targets = tables(section(text, "quick/cpu/launchers"))
    for r, v in zip(variants, la["variants"]):
        assert r["variant"] == v["variant"]
        for col, key in (("samples/s", "samples_per_second"), ("min", "min"), ("max", "max")):
            assert num(r[col]) == pytest.approx(v[key], abs=0.05), (v["variant"], col)
    assert num(variants[1]["samples/s"]) != num(variants[1]["max"]), "two repeats: the median is not the max"
    got = {r["ratio"]: num(r["value"]) for r in ratios}
    assert got["stnb / notebook_launcher"] == pytest.approx(la["ratios"]["stnb_vs_raw"], abs=5e-4)
    assert got["stnb / torchrun"] == pytest.approx(la["ratios"]["stnb_vs_torchrun"], abs=5e-4)
    assert [t["verdict"] for t in targets] == [t["verdict"] for t in summary["targets"]
                                               if t["key"] != "efficiency_best"]

    kn = summary["sections"]["knobs"]
    knobs = tables(section(text, "quick/cpu/knobs"))[0]
    for r, v in zip(knobs, kn["variants"]):
        assert r["variant"] == v["variant"]
        assert num(r["efficiency"]) == pytest.approx(v["efficiency"], abs=5e-4) if v["efficiency"] else True

    ck = {v["variant"]: v for v in summary["sections"]["checkpoints"]}
    costs = {r["strategy"]: r for r in tables(section(text, "quick/cpu/checkpoints"))[0]}
    assert list(costs) == list(ck) and costs["dp"]["status"].startswith("not runnable here")
    fsdp = costs["fsdp x2"]
    i = next(k for k, it in enumerate(bench.plan(opts)) if it.name == "fsdp x2")
    assert (fsdp["checkpoints"], num(fsdp["s each"])) == ("4", pytest.approx(0.1 * i + 0.03, abs=0.005))
    assert fsdp["MB per rank"] == f"{2 * (i + 1) + 0.15:.1f} / {4 * (i + 1) + 0.15:.1f}"  # each rank's median
    assert num(fsdp["largest rank's share"]) == pytest.approx(100 * ck["fsdp x2"]["largest_share"], abs=0.5)
    assert costs["single"]["MB all ranks"] == costs["single"]["MB per rank"]

    ref = tables(section(text, "reference"))[0]
    assert [num(r["samples/s"]) for r in ref] == list(reference.SAMPLES_PER_SECOND.values())
    assert [num(r["speed-up vs one GPU"]) for r in ref] == list(reference.PUBLISHED_SPEEDUP.values())
    assert "not measured here" in section(text, "reference")
    machine = section(text, "quick/cpu/sweep")
    assert "`python -m stnb bench --quick`" in machine and "torch 9.9.9" in machine
    assert f"{stnb.hardware.cpu_cores()} cores" in machine

    # the launchers run again with other numbers: only that section changes
    again = bench.BenchOptions.from_preset("quick", repeats=2, sections=("launchers",), command="again")
    summary2, rows2 = synthetic(again, scale=2.0)
    document.write_document(doc, summary2, again, rows2, device="cpu")
    text2 = doc.read_text()
    for name in ("reference", "quick/cpu/sweep", "quick/cpu/knobs"):
        assert section(text2, name) == section(text, name), name
    new = tables(section(text2, "quick/cpu/launchers"))[0]
    assert [num(r["samples/s"]) for r in new] == pytest.approx(
        [v["samples_per_second"] for v in summary2["sections"]["launchers"]["variants"]], abs=0.05)
    assert new != variants
    assert text2.startswith("# my benchmarks\n\nwritten by hand, kept.\n")

    # another kind of run (another preset) accumulates beside the others
    other = bench.BenchOptions.from_preset("default", sections=("sweep",), batch_sizes=(4,), command="other")
    summary3, rows3 = synthetic(other)
    document.write_document(doc, summary3, other, rows3, device="cpu")
    text3 = doc.read_text()
    assert set(document.parse_sections(text3)) == names | {"default/cpu/sweep"}
    for name in names - {"reference"}:
        assert section(text3, name) == section(text2, name)


def test_gpu_sweep_has_an_mfu_column(tmp_path):
    doc = tmp_path / "B.md"
    opts = bench.BenchOptions.from_preset("st-docs", command="python -m stnb bench --preset st-docs")
    summary, rows = synthetic(opts, mfu=0.2)
    document.write_document(doc, summary, opts, rows, device="cuda")
    table = tables(section(doc.read_text(), "st-docs/cuda/sweep"))[0]
    for r, v in zip(table, summary["sections"]["sweep"]):
        if v["status"] == "ok":
            assert num(r["MFU"]) / 100 == pytest.approx(v["mfu"], abs=5e-4)


def test_damaged_doc_is_refused_before_any_run(tmp_path, capsys):
    doc = tmp_path / "B.md"
    doc.write_text("intro\n<!-- stnb-bench:quick/cpu/sweep -->\nhalf a section\n")
    before = doc.read_bytes()
    rc = cli(["bench", "--sweep", "--strategies", "single", "--batch-sizes", "4", *TINY,
              "--results", str(tmp_path / "r.jsonl"), "--write-doc", str(doc)])
    assert rc == 2
    assert "has no end marker" in capsys.readouterr().err
    assert doc.read_bytes() == before and not (tmp_path / "r.jsonl").exists()


def test_real_run_writes_its_own_numbers(tmp_path, monkeypatch, capsys):
    results, doc = tmp_path / "runs.jsonl", tmp_path / "docs" / "BENCH.md"
    doc.parent.mkdir()
    args = ["bench", "--sweep", "--strategies", "single,ddp", "--batch-sizes", "4", "--nprocs", "2", *TINY,
            "--results", str(results), "--report", str(tmp_path / "r.html")]
    assert cli(args + ["--write-doc", str(doc)]) == 0
    assert f"doc:     {doc}" in capsys.readouterr().out
    rows = {r["config"]["extra"]["bench"]["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    text = doc.read_text()
    assert text.startswith(document.HEADER) and set(document.parse_sections(text)) == {"reference", "default/cpu/sweep"}
    block = section(text, "default/cpu/sweep")
    table = {r["run"]: r for r in tables(block)[0]}
    assert set(table) == set(rows) == {"single b4", "ddp x2 b4"}
    for name, row in rows.items():
        assert row["status"] == "ok" and table[name]["status"] == "ok"
        assert num(table[name]["samples/s"]) == pytest.approx(row["samples_per_second"], abs=0.05)
        assert int(table[name]["global batch"]) == row["global_batch_size"]
    assert "--write-doc" in block and "--strategies single,ddp" in block and "--model tiny" in block
    assert f"torch {rows['single b4']['versions']['torch']}" in block

    # --write-doc without a path: BENCHMARKS.md in the current folder (this time all resumed from the file)
    monkeypatch.chdir(tmp_path)
    assert cli(args + ["--write-doc"]) == 0
    assert "0 to run" in capsys.readouterr().out
    again = (tmp_path / document.DEFAULT_DOC).read_text()
    assert tables(section(again, "default/cpu/sweep"))[0] == tables(block)[0]


def test_summary_medians_are_over_the_repeats_and_leave_missing_values_out():
    """A variant's numbers are the medians over its repeats (an even count: the mean of the middle two), its
    range the repeats' min and max; a value a row does not have (no MFU on CPU) is left out, not a zero."""
    opts = bench.BenchOptions.from_preset("quick", sections=("sweep",), sweep_repeats=4)
    items = [it for it in bench.plan(opts) if not it.unavailable]
    name = items[0].name
    mine = [it for it in items if it.name == name]
    assert len(mine) == 4, [it.name for it in items]
    sps, first, mfu = (3.0, 1.0, 2.0, 10.0), (4.0, 8.0, 5.0, 6.0), (0.5, None, 0.1, None)
    latest = {it.key: {"config": it.config.to_dict(), "status": "ok", "verified": True, "samples_per_second": s,
                       "step_times": [9.0, 1.0, 3.0, 2.0], "time_to_first_step_s": f, "world_size": 1,
                       "global_batch_size": 4, "mfu": {"mfu": m}}
              for it, s, f, m in zip(mine, sps, first, mfu)}
    [row] = [r for r in bench.summarize(items, latest, opts)["sections"]["sweep"] if r["variant"] == name]
    assert (row["samples_per_second"], row["min"], row["max"]) == (2.5, 1.0, 10.0)
    assert row["time_to_first_step_s"] == 5.5 and row["mfu"] == pytest.approx(0.3)
    warm = mine[0].config.warmup_steps_excluded
    assert warm in (1, 2) and row["step_s"] == {1: 2.0, 2: 2.5}[warm]  # the steady steps' median: [1, 3, 2] / [3, 2]
    assert row["tokens_per_sample"] is None and row["ok"] == row["runs"] == 4
