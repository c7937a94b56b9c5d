"""ipywidgets panels: pick a strategy and sizes, press Run, watch every rank, compare the runs.

    panel = stnb.widgets.Panel()        # defaults from the current profile (STNB_PROFILE)
    panel                               # show it (last line of a cell)

    panel = stnb.widgets.Panel(build=build)   # your own training: build() returns a trainer

With ``build``, Run calls ``stnb.run(build, strategy=..., num_processes=...)``: the strategy and
processes widgets apply to it, the recipe's widgets (model, steps) are hidden (they are in your
function), and the per-device batch is your ``per_device_train_batch_size`` unless you tick
"override": then the batch widget replaces it in every rank, and the result lists it in
``overridden_args`` with the reason "set in the Panel".

Strategies that cannot run on this machine stay in the list, marked "not runnable here" with
the reason; choosing one disables Run and says why. Pressing Run calls ``stnb.run`` in the
button's callback: the kernel is busy until the run ends, and the per-rank progress bars are
updated meanwhile from stnb.launch's watchdog thread. Each finished run adds a row to the
results table and redraws the plotly comparison. Errors (ConfigError, StrategyUnavailable,
LaunchError, ...) are shown in the panel, which stays usable.

For code and tests: ``panel.run_config()`` is the TrainConfig the widgets describe,
``panel.run()`` does what the button does, ``panel.results`` is the table of runs so far.
CSS classes for tests and styling: stnb-panel, stnb-strategy, stnb-strategy-help, stnb-processes,
stnb-batch, stnb-batch-override, stnb-build, stnb-model, stnb-steps, stnb-knobs, stnb-knob (and
stnb-knob-<field>), stnb-run, stnb-validation, stnb-status, stnb-progress, stnb-progress-rank, stnb-error,
stnb-results, stnb-plot, stnb-advice, stnb-split, stnb-log.

The chosen strategy's own options (``strategies.get(name).options``: DDP's bucket size and comm hook,
FSDP's resharding, DeepSpeed's ZeRO ``stage``...) appear under the sizes, each a widget made from its
declaration (``stnb.strategies.Option``); a strategy added to the registry brings its own. After a run, the time split of the
runs so far (``stnb.plots.split_bars``) and one sentence on the last run: what dominates its step and
what to change (``stnb.plots.timesplit.advice``).

Layout: ``controls`` builds the widgets, ``view`` turns results and settings into HTML (pure functions),
``modes`` keeps stnb's recipe and a build function apart, ``panel`` wires them.
"""

from .panel import Panel

__all__ = ["Panel"]
