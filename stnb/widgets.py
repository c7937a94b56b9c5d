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
CSS classes for tests and styling: stnb-panel, stnb-strategy, stnb-processes, stnb-batch,
stnb-batch-override, stnb-build, stnb-model, stnb-steps, stnb-run, stnb-validation, stnb-status, stnb-progress,
stnb-progress-rank, stnb-error, stnb-results, stnb-plot, stnb-log.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from html import escape

import ipywidgets as W

from .config import LAUNCH_FIELDS, TrainConfig
from .errors import ConfigError, LaunchError, StnbError, StrategyUnavailable
from .hardware import capacity_problem, max_processes, strategy_availability
from .models import MINILM, TINY
from . import strategies
from .profiles import current_profile
from .results import RunResult, load_results, results_frame

_WIDE = {"description_width": "initial"}

_CSS = """<style>
.stnb-table { border-collapse: collapse; font-size: 12px; }
.stnb-table th, .stnb-table td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right;
  white-space: nowrap; line-height: 1.4; }
.stnb-table th { vertical-align: bottom; }
.stnb-table td:first-child, .stnb-table th:first-child { text-align: left; }
.stnb-table tr.stnb-unrunnable td { color: #888; font-style: italic; }
</style>"""


class Panel(W.VBox):
    """Train with a chosen strategy and compare the runs, from a notebook.

    results_file: a JSONL file; runs already in it are shown, and every new run is appended.
    profile: a stnb Profile (default: ``stnb.current_profile()``) giving the default sizes.
    plot: the stnb.plots function shown under the table ('dashboard', 'throughput', 'speedup', ...).
    build: your function returning a SentenceTransformerTrainer: Run trains it (``stnb.run(build, ...)``)
        instead of stnb's recipe; config_overrides then take only ``config.LAUNCH_FIELDS``.
    config_overrides: TrainConfig fields for every run of this panel (e.g. train_size=200).
    """

    def __init__(self, results_file=None, profile=None, plot: str = "dashboard", build=None, **config_overrides):
        self.profile = profile or current_profile()
        self.build = self.build_name = None
        if build is not None:
            from .prepare import describe
            from .runner import check_build

            self.build, self.build_name = check_build(build), describe(build)
            self.base_config = TrainConfig.for_build(**config_overrides)
        else:
            self.base_config = self.profile.config(**config_overrides)
        self.results_file = results_file
        self.plot_kind = plot
        self.device = self.base_config.resolved_device()
        self.availability = strategy_availability(self.device)
        self.max_processes = max_processes(self.device)
        self.last_result: RunResult | None = None
        self.last_error: BaseException | None = None
        self.figure = None
        self.progress_updates = 0          # on_progress calls seen in the last run
        self.progress_threads: set = set()  # names of the threads that delivered them
        self._results: list = []
        self._running = False
        self._lock = threading.Lock()

        # ---- inputs --------------------------------------------------------------------
        default = self.base_config.strategy
        if not self.availability.get(default, {}).get("runnable"):
            base = strategies.baseline_name()
            default = next((s for s in strategies.names() if self.availability[s]["runnable"] and s != base), base)
        self.strategy = W.Dropdown(options=[(self._strategy_label(s), s) for s in strategies.names()], value=default,
                                   description="strategy", style=_WIDE, layout=W.Layout(width="640px"))
        self.strategy.add_class("stnb-strategy")
        ws = self.base_config.replace(strategy="ddp").world_size()
        self.processes = W.BoundedIntText(value=max(2, min(ws, self.max_processes)) if self.max_processes >= 2 else 2,
                                          min=1, max=1024, description="processes", style=_WIDE,
                                          layout=W.Layout(width="170px"))
        self.processes.add_class("stnb-processes")
        own_batch = self.base_config.arg_overrides().get("per_device_train_batch_size")
        self.batch = W.BoundedIntText(value=own_batch[0] if own_batch else (self.base_config.per_device_batch_size
                                                                            if build is None else
                                                                            self.profile.per_device_batch_size),
                                      min=1, max=1_000_000, description="per-device batch", style=_WIDE,
                                      layout=W.Layout(width="210px"))
        self.batch.add_class("stnb-batch")
        # a build function: its own per_device_train_batch_size, unless this box is ticked
        self.batch_override = W.Checkbox(value=bool(own_batch), description="override", indent=False,
                                         tooltip="replace per_device_train_batch_size in your training arguments "
                                                 "(reported in RunResult.overridden_args)",
                                         layout=W.Layout(width="100px", display=None if build else "none"))
        self.batch_override.add_class("stnb-batch-override")
        self.steps = W.BoundedIntText(value=self.base_config.steps, min=1, max=10_000_000, description="steps",
                                      style=_WIDE, layout=W.Layout(width="150px"))
        self.steps.add_class("stnb-steps")
        self.model = W.Combobox(value=self.base_config.model, options=[TINY, MINILM], ensure_option=False,
                                description="model", placeholder="tiny, minilm, a hub id or a folder",
                                style=_WIDE, layout=W.Layout(width="360px"))
        self.model.add_class("stnb-model")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play",
                                   tooltip="train once with these settings", layout=W.Layout(width="120px"))
        self.run_button.add_class("stnb-run")
        self.run_button.on_click(lambda _b: self.run())

        # ---- outputs -------------------------------------------------------------------
        self.validation = W.HTML()
        self.validation.add_class("stnb-validation")
        self.status = W.HTML(value="<i>ready</i>")
        self.status.add_class("stnb-status")
        self.progress = W.VBox()
        self.progress.add_class("stnb-progress")
        self.progress_bars: list = []
        self.progress_labels: list = []
        self.error = W.HTML(value="")
        self.error.add_class("stnb-error")
        self.table = W.HTML(value=self._table_html())
        self.table.add_class("stnb-results")
        self.plot = W.Output(layout=W.Layout(min_height="40px"))
        self.plot.add_class("stnb-plot")
        self.log_view = W.HTML(value="")
        self.log_view.add_class("stnb-log")

        header = W.HTML(value=(f"<b>stnb</b> · profile <code>{escape(self.profile.name)}</code> · device "
                               f"<code>{escape(self.device)}</code> · up to {self.max_processes} rank(s) here"))
        self.build_info = W.HTML(value="" if build is None else (
            f"training: your build function <code>{escape(self.build_name)}</code> (model, data, loss, steps and "
            "training arguments are in it)"))
        self.build_info.add_class("stnb-build")
        if build is not None:  # the recipe's widgets do not apply to a build function
            for w in (self.steps, self.model):
                w.layout.display = "none"
                w.disabled = True
        for w in (self.strategy, self.processes, self.batch, self.batch_override, self.steps, self.model):
            w.observe(self._on_change, names="value")
        super().__init__(children=[
            header, self.build_info, self.strategy,
            W.HBox([self.processes, self.batch, self.batch_override, self.steps]),
            W.HBox([self.model, self.run_button]),
            self.validation, self.status, self.progress, self.error, self.table, self.plot, self.log_view,
        ])
        self.add_class("stnb-panel")
        if results_file is not None:
            self._load_existing(results_file)
        self._refresh_outputs()
        self._on_change()

    # ---- public ----------------------------------------------------------------------------
    @property
    def results(self):
        """All runs of this panel (and of its results file) as a DataFrame, one row per run."""
        return results_frame(self._results)

    def run_config(self) -> TrainConfig:
        """The TrainConfig the widgets describe (not validated against the hardware yet). With a build
        function: only launch fields, and override_args when the batch override is ticked."""
        strategy = self.strategy.value
        if self.build is not None:
            overrides = dict(self.base_config.override_args or {})
            overrides.pop("per_device_train_batch_size", None)
            if self.batch_override.value:
                overrides["per_device_train_batch_size"] = (int(self.batch.value), "set in the Panel")
            return self.base_config.replace(
                strategy=strategy, num_processes=int(self.processes.value) if strategies.is_distributed(strategy) else None,
                override_args=overrides or None)
        model = (self.model.value or "").strip() or self.base_config.model
        return self.base_config.replace(
            strategy=strategy,
            num_processes=int(self.processes.value) if strategies.is_distributed(strategy) else None,
            per_device_batch_size=int(self.batch.value), steps=int(self.steps.value), model=model)

    def run(self) -> RunResult | None:
        """What the Run button does: train once, show progress, then add the result (or the error)."""
        from .runner import run as stnb_run

        with self._lock:
            if self._running:
                self._show_error(LaunchError("a run is already in progress in this panel; wait for it to finish",
                                             kind="busy"))
                return None
            self._running = True
        self._clear_error()
        result = None
        try:
            config = self.run_config()
            self._busy(True, config)
            t0 = time.time()
            if self.build is None:
                result = stnb_run(config, results_file=self.results_file, on_progress=self._on_progress, echo=False)
            else:
                result = stnb_run(self.build, results_file=self.results_file, on_progress=self._on_progress,
                                  echo=False, **{k: getattr(config, k) for k in LAUNCH_FIELDS})
            self.status.value = (f"<b>done</b> in {time.time() - t0:.1f} s: {escape(config.strategy)}, "
                                 f"{result.samples_per_second or 0:,.1f} samples/s, verified {result.verified}")
        except StrategyUnavailable as e:
            self._show_error(e)
            result = RunResult.unavailable(config, e.reason, build=self.build_name)  # the comparison keeps it
            if self.results_file is not None:
                from .results import append_result

                try:
                    append_result(self.results_file, result)
                except StnbError as fe:
                    self._show_error(fe, append=True)
            self.status.value = "<i>not runnable here</i>"
        except KeyboardInterrupt:
            self._show_error(KeyboardInterrupt("interrupted: every rank was stopped; the panel is ready again"))
            self.status.value = "<i>interrupted</i>"
        except Exception as e:  # ConfigError, LaunchError, ResultsFileError, or a bug: show it, stay usable
            self._show_error(e)
            self.status.value = "<i>failed, see the error below</i>"
        finally:
            self._running = False
            self._busy(False)
            self._show_log()
        if result is not None:
            self.last_result = result
            self._results.append(result)
            self._refresh_outputs()
        return result

    # ---- widget plumbing ------------------------------------------------------------------
    def _strategy_label(self, s: str) -> str:
        info = self.availability[s]
        return s if info["runnable"] else f"{s} (not runnable here: {info['reason']})"

    def _problem(self) -> str:
        """Why the current settings cannot run (empty when they can). Cheap: starts nothing."""
        s = self.strategy.value
        info = self.availability[s]
        if not info["runnable"]:
            return f"{s} cannot run here: {info['reason']}"
        try:
            config = self.run_config()
            config.validate(check_resources=False)
        except (ConfigError, StrategyUnavailable) as e:
            return str(e)
        return capacity_problem(self.device, config.world_size(), option="processes") or ""

    def _on_change(self, _change=None) -> None:
        s = self.strategy.value
        self.processes.disabled = self._running or not strategies.is_distributed(s)
        if self.build is not None:
            self.batch.disabled = self._running or not self.batch_override.value
            self.batch.tooltip = ("replaces per_device_train_batch_size in your training arguments for this run"
                                  if self.batch_override.value else
                                  "your build function's per_device_train_batch_size applies (change it in "
                                  "your SentenceTransformerTrainingArguments, or tick override)")
        problem = self._problem()
        if problem:
            self.validation.value = f'<span style="color:#b00020">&#9888; {escape(problem)}</span>'
        elif self.build is not None:
            c = self.run_config()
            ws = c.world_size()
            batch = (f"{int(self.batch.value)} per device (override) = global batch {int(self.batch.value) * ws}"
                     if self.batch_override.value else "your per_device_train_batch_size per device")
            self.validation.value = (f'<span style="color:#2e7d32">{escape(s)} on {ws} rank(s) × {batch} · '
                                     f"{escape(self.build_name)}()</span>")
        else:
            c = self.run_config()
            ws = c.world_size()
            self.validation.value = (f'<span style="color:#2e7d32">{escape(s)} on {ws} rank(s) × {c.per_device_batch_size}'
                                     f" per device = global batch {c.global_batch_size()} · model "
                                     f"{escape(c.model)} · {c.steps} steps</span>")
        self.run_button.disabled = self._running or bool(problem)

    def _busy(self, running: bool, config: TrainConfig | None = None) -> None:
        for w in (self.strategy, self.batch, self.batch_override) + (() if self.build else (self.steps, self.model)):
            w.disabled = running
        if running:
            self.run_button.disabled = True
            self.run_button.description = "Running…"
            self.run_button.icon = "spinner"
            self.processes.disabled = True
            self._start_progress(config.world_size())
            self.status.value = (f"<b>running</b> {escape(config.strategy)} on {config.world_size()} rank(s); "
                                 "the kernel is busy until the run ends")
        else:
            self.run_button.description = "Run"
            self.run_button.icon = "play"
            self._on_change()

    def _start_progress(self, n: int) -> None:
        self.progress_updates = 0
        self.progress_threads = set()
        self.progress_bars, self.progress_labels, rows = [], [], []
        for r in range(n):
            bar = W.IntProgress(value=0, min=0, max=self._expected_steps(), description=f"rank {r}",
                                style=_WIDE, layout=W.Layout(width="320px"))
            label = W.Label(value=f"rank {r}: starting")
            row = W.HBox([bar, label])
            row.add_class("stnb-progress-rank")
            self.progress_bars.append(bar)
            self.progress_labels.append(label)
            rows.append(row)
        self.progress.children = rows

    def _on_progress(self, states) -> None:
        """stnb.launch calls this about twice a second, from its watchdog thread."""
        self.progress_updates += 1
        self.progress_threads.add(threading.current_thread().name)
        for st in states:
            if st.rank >= len(self.progress_bars):
                continue
            bar, label = self.progress_bars[st.rank], self.progress_labels[st.rank]
            total = max(1, int(st.total or self._expected_steps()))
            if bar.max != total:
                bar.max = total
            bar.value = max(0, min(int(st.step), total))
            bar.bar_style = {"done": "success", "failed": "danger"}.get(st.state, "info")
            loss = f" · loss {st.loss:.4f}" if st.loss is not None else ""
            wait = f" · quiet {st.seconds_since_progress:.0f} s" if st.seconds_since_progress > 10 else ""
            label.value = f"rank {st.rank}: {st.state} · step {int(st.step)}/{total}{loss}{wait}"

    def _expected_steps(self) -> int:
        """The progress bars' length until the ranks report theirs (a build function's is its max_steps)."""
        return 1 if self.build is not None else max(1, int(self.steps.value or 1))

    def _clear_error(self) -> None:
        self.error.value = ""
        self.last_error = None

    def _show_error(self, e: BaseException, append: bool = False) -> None:
        self.last_error = e
        kind = type(e).__name__
        text = str(e)
        first, _, rest = text.partition("\n")
        details = ""
        if isinstance(e, LaunchError) and e.logs:
            tails = "\n".join(f"--- rank {r} (last lines) ---\n" + "\n".join(log.splitlines()[-15:])
                              for r, log in sorted(e.logs.items()) if log.strip())
            rest = (rest + "\n" + tails).strip()
        elif not isinstance(e, (StnbError, KeyboardInterrupt)):
            rest = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if rest.strip():
            details = (f"<details><summary>details</summary><pre style='white-space:pre-wrap;font-size:11px'>"
                       f"{escape(rest)}</pre></details>")
        block = (f'<div class="stnb-error-text" style="color:#b00020;border-left:3px solid #b00020;'
                 f'padding-left:8px"><b>{escape(kind)}</b>: {escape(first)}{details}</div>')
        self.error.value = (self.error.value + block) if append else block

    def _show_log(self) -> None:
        from .launch import last_launch

        info = last_launch()
        if info is None or not info.logs:
            return
        parts = []
        for r, log in sorted(info.logs.items()):
            lines = [ln for ln in log.splitlines() if ln.strip()][-30:]
            if lines:
                parts.append(f"[rank {r}]\n" + "\n".join(lines))
        if parts:
            self.log_view.value = ("<details><summary>output of the last run's ranks</summary><pre style='font-size:11px;"
                              f"max-height:240px;overflow:auto'>{escape(chr(10).join(parts))}</pre></details>")

    def _load_existing(self, path) -> None:
        import os

        if not os.path.exists(path):
            return
        try:
            rows = load_results(path, as_frame=False)
        except StnbError as e:
            self._show_error(e)
            return
        self._results.extend(RunResult.from_dict(r) for r in rows)

    # ---- table and plot --------------------------------------------------------------------
    def _table_html(self) -> str:
        if not self._results:
            return "<i>no runs yet: press Run</i>"
        from . import plots

        data = plots.comparison_table(self.results)
        rows = []
        for _, r in data.iterrows():
            ok = r["status"] == "ok"
            peak = max(r["peak_memory_bytes"]) / 2**20 if r["peak_memory_bytes"] else None
            cells = [r["label"], r["strategy"], r["world_size"], r["per_device_batch_size"], r["global_batch_size"],
                     r["model_name"], r["device"], _num(r["samples_per_second"], ",.1f"), _num(r["speedup"], ".2f", "x"),
                     _num(peak, ",.0f"), _num(r["losses"][-1] if r["losses"] else None, ".4f"),
                     r["verified"] if ok else "", r["status"] if ok else f"{r['status']}: {r['reason']}"]
            tds = "".join(f"<td>{escape(str(c))}</td>" for c in cells)
            rows.append(f'<tr class="{"stnb-ok" if ok else "stnb-unrunnable"}">{tds}</tr>')
        head = "".join(f'<th title="{t}">{h}</th>' for h, t in (
            ("run", "label used in the plots"), ("strategy", ""), ("ranks", "processes (world size)"),
            ("batch/device", "per-device batch size"), ("global batch", "samples per optimizer step"),
            ("model", ""), ("device", ""), ("samples/s", "steady-state throughput"),
            ("speedup", "over the 'single' run of the same model"), ("peak MiB", "largest peak over the ranks"),
            ("final loss", ""), ("verified", "stnb checked the strategy did what it claims"), ("status", "")))
        return (f'{_CSS}<div style="overflow-x:auto;max-width:100%"><table class="stnb-table"><thead><tr>{head}'
                f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div>')

    def _refresh_outputs(self) -> None:
        self.table.value = self._table_html()
        if not self._results:
            return
        from . import plots

        try:
            self.figure = getattr(plots, self.plot_kind)(self.results)
        except Exception as e:  # a plotting problem must not break the panel
            self._show_error(e, append=True)
            return
        import plotly.io as pio

        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(json.loads(self.figure.to_json()))
        bundle["text/plain"] = f"<stnb {self.plot_kind} figure of {len(self._results)} run(s)>"
        self.plot.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


def _num(v, spec, suffix=""):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "–"
    if f != f:
        return "–"
    return format(f, spec) + suffix
