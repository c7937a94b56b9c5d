"""Plotly figures from a results table (``stnb.results_frame([...])`` or ``stnb.load_results(path)``).

Every function takes the table and returns a ``plotly.graph_objects.Figure``; no widgets needed.
Hovering a bar or line shows its numbers and the configuration of that run (strategy, ranks,
per-device and global batch, model, device, DDP options, ...). Runs that could not run on this
machine (status 'not runnable here') appear as a label where their bar would stand, never as a bar,
and its hover text gives the reason.

    throughput(df)      samples per second of every run
    speedup(df)         throughput over the 'single' run of the same model, with the ideal (= devices)
    efficiency(df)      speedup / devices, against the ideal 1.0
    memory(df)          peak memory per rank, and params / grads / optimizer state per rank
    loss_curves(df)     training loss per step, one line per run
    dev_curves(df)      the held-out dev metric per step (RunResult.dev_curve), one line per run
    dashboard(df)       the four above in one figure
    knobs(summary)      DDP knob variants' scaling efficiency, from a ``stnblab.bench`` summary
    split_bars(results) where each step's time goes, a stacked bar per run (``plots.timesplit``)
    timeline(result)    per rank, compute and communication lanes of a few steps
    memory_split(results) where each rank's peak memory goes, a stacked bar per run (``plots.memsplit``)
    fits(table)         what a rank held under a memory budget, per strategy (``stnb.fits``'s table)

``reference_frame()`` holds the numbers published in the sentence-transformers documentation
(``stnb.reference``: 4x V100, microsoft/mpnet-base). ``throughput(df, reference=True)``, ``speedup(..., reference=True)``
and ``with_reference(df_or_fig)`` show them beside ours, labelled as theirs.
"""

from .figures import dashboard, dev_curves, efficiency, knobs, loss_curves, memory, speedup, throughput, with_reference
from .table import MIB, OURS, REFERENCE_SOURCE, REFERENCE_URL, comparison_table, reference_frame
from .traces import PART_COLORS, STRATEGY_COLORS
from .timesplit import split_bars, timeline
from .memsplit import memory_split
from .fits import fits

__all__ = [
    "throughput", "speedup", "efficiency", "memory", "loss_curves", "dev_curves", "dashboard", "knobs",
    "with_reference",
    "comparison_table", "reference_frame", "split_bars", "timeline", "memory_split", "fits",
    "OURS", "REFERENCE_SOURCE", "REFERENCE_URL", "STRATEGY_COLORS", "PART_COLORS", "MIB",
]
