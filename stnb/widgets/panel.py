"""The Panel: the controls (``controls``), the mode that trains (``modes``) and the HTML it shows (``view``),
wired together. See ``stnb.widgets`` for what it does."""

from __future__ import annotations

import threading
import time

import ipywidgets as W

from .. import strategies
from ..config import TrainConfig
from ..errors import ConfigError, LaunchError, StnbError, StrategyUnavailable
from ..hardware import capacity_problem, max_processes, strategy_availability
from ..profiles import current_profile
from ..results import RunResult, load_results, results_frame
from .controls import (html_output, knob_controls, processes_box, progress_rows, run_button, show_figure,
                       show_knobs, strategy_picker, with_class)
from .view import (EMPTY_TABLE, done_html, error_html, has_time_split, header_html, problem_html, progress_text,
                   rank_logs, results_table, running_html, strategy_help, time_split_html)
from ..builds import build_of
from .modes import MODES


class Panel(W.VBox):
    """Train with a chosen strategy and compare the runs, from a notebook.

    results_file: a JSONL file; runs already in it are shown, and every new run is appended.
    profile: a stnb Profile (default: ``stnb.current_profile()``) giving the default sizes.
    plot: the stnb.plots function shown under the table ('dashboard', 'throughput', 'speedup', ...).
    build: your function returning a SentenceTransformerTrainer: Run trains it (``stnb.run(build, ...)``)
        instead of stnb's recipe; config_overrides then take only the ``config.RunOptions``.
    config_overrides: TrainConfig fields for every run of this panel (e.g. train_size=200); a strategy's
        knob sets its widget's first value.
    """

    def __init__(self, results_file=None, profile=None, plot: str = "dashboard", build=None, **config_overrides):
        self.profile = profile or current_profile()
        self.source = build_of(build)  # what Run trains: stnb's recipe, or the function (checked)
        self.mode = self.source.panel_mode(MODES, self.profile, config_overrides)
        self.base_config = self.mode.base
        self.build, self.build_name = self.mode.build, self.mode.build_name
        self.results_file = results_file
        self.plot_kind = plot
        self.device = self.base_config.resolved_device()
        self.availability = strategy_availability(self.device)
        self.max_processes = max_processes(self.device)
        self.last_result: RunResult | None = None
        self.last_error: BaseException | None = None
        self.figure = self.split_figure = None
        self.progress_updates = 0          # on_progress calls seen in the last run
        self.progress_threads: set = set()  # names of the threads that delivered them
        self.progress_bars: list = []
        self.progress_labels: list = []
        self.runs: list = []
        self._running = False
        self._lock = threading.Lock()

        # ---- inputs --------------------------------------------------------------------------
        self.strategy = strategy_picker(self.base_config.strategy, self.availability)
        self.strategy_help = html_output("stnb-strategy-help")
        ws = self.base_config.replace(strategy=strategies.distributed_names()[0]).world_size()
        self.processes = processes_box(max(2, min(ws, self.max_processes)) if self.max_processes >= 2 else 2)
        self.batch, self.batch_override = self.mode.batch, self.mode.batch_override
        self.model, self.steps = self.mode.model, self.mode.steps
        self.knobs = knob_controls(self.base_config)
        self.run_button = run_button(self.run)

        # ---- outputs -------------------------------------------------------------------------
        self.validation = html_output("stnb-validation")
        self.status = html_output("stnb-status", "<i>ready</i>")
        self.progress = with_class(W.VBox(), "stnb-progress")
        self.error = html_output("stnb-error")
        self.table = html_output("stnb-results", EMPTY_TABLE)
        self.plot = with_class(W.Output(layout=W.Layout(min_height="40px")), "stnb-plot")
        self.advice = html_output("stnb-advice")
        self.split_plot = with_class(W.Output(), "stnb-split")
        self.log_view = html_output("stnb-log")
        self.build_info = html_output("stnb-build", self.mode.info)

        for w in (self.strategy, self.processes, *self.mode.inputs(), *(k.widget for k in self.knobs.values())):
            w.observe(self.on_change, names="value")
        super().__init__(children=[
            W.HTML(value=header_html(self.profile.name, self.device, self.max_processes)), self.build_info,
            self.strategy, self.strategy_help,
            W.HBox([self.processes, self.batch, self.batch_override, self.steps]),
            with_class(W.HBox([k.widget for k in self.knobs.values()], layout=W.Layout(flex_flow="row wrap")),
                       "stnb-knobs"),
            W.HBox([self.model, self.run_button]),
            self.validation, self.status, self.progress, self.error, self.table, self.plot,
            self.advice, self.split_plot, self.log_view,
        ])
        self.add_class("stnb-panel")
        if results_file is not None:
            self.load_existing(results_file)
        self.refresh_outputs()
        self.on_change()

    # ---- public ------------------------------------------------------------------------------
    @property
    def results(self):
        """All runs of this panel (and of its results file) as a DataFrame, one row per run."""
        return results_frame(self.runs)

    def run_config(self) -> TrainConfig:
        """The TrainConfig the widgets describe (not validated against the hardware yet): the strategy, its
        processes and its knobs (the other strategies' knobs at their defaults), then the mode's fields
        (recipe: model, steps, batch; build function: the batch override). ConfigError for a knob's text
        that is not a value."""
        s = strategies.get(self.strategy.value)
        launch = {"strategy": s.name, "num_processes": int(self.processes.value) if s.distributed else None}
        launch["strategy_options"] = {name: k.value() for name, k in self.knobs.items() if name in s.options}
        return self.mode.config(launch)

    def run(self) -> RunResult | None:
        """What the Run button does: train once, show progress, then add the result (or the error)."""
        with self._lock:
            if self._running:
                self.show_error(LaunchError("a run is already in progress in this panel; wait for it to finish",
                                            kind="busy"))
                return None
            self._running = True
        self.error.value, self.last_error = "", None
        result = None
        try:
            config = self.run_config()
            self.busy(True, config)
            t0 = time.time()
            result = self.mode.start(config, results_file=self.results_file, on_progress=self.on_progress, echo=False)
            self.status.value = done_html(result, time.time() - t0)
        except StrategyUnavailable as e:
            self.show_error(e)
            result = RunResult.unavailable(config, e.reason, build=self.source)  # the comparison keeps it
            self.append_unavailable(result)
            self.status.value = "<i>not runnable here</i>"
        except KeyboardInterrupt:
            self.show_error(KeyboardInterrupt("interrupted: every rank was stopped; the panel is ready again"))
            self.status.value = "<i>interrupted</i>"
        except Exception as e:  # ConfigError, LaunchError, ResultsFileError, or a bug: show it, stay usable
            self.show_error(e)
            self.status.value = "<i>failed, see the error below</i>"
        finally:
            self._running = False
            self.busy(False)
            self.show_log()
        if result is not None:
            self.last_result = result
            self.runs.append(result)
            self.refresh_outputs()
        return result

    # ---- settings ----------------------------------------------------------------------------
    def problem(self) -> str:
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

    def on_change(self, _change=None) -> None:
        s = strategies.get(self.strategy.value)
        self.processes.disabled = self._running or not s.distributed
        self.mode.refresh(self._running)
        show_knobs(self.knobs, s.name)
        self.strategy_help.value = strategy_help(s)
        why = self.problem()
        self.validation.value = problem_html(why) if why else self.mode.ready(self.run_config())
        self.run_button.disabled = self._running or bool(why)

    def busy(self, running: bool, config: TrainConfig | None = None) -> None:
        for w in (self.strategy, *(k.widget for k in self.knobs.values())):
            w.disabled = running
        self.mode.refresh(running)
        if running:
            self.run_button.disabled = self.processes.disabled = True
            self.run_button.description, self.run_button.icon = "Running…", "spinner"
            self.progress_updates, self.progress_threads = 0, set()
            self.progress_bars, self.progress_labels, rows = progress_rows(config.world_size(),
                                                                                    self.mode.expected_steps())
            self.progress.children = rows
            self.status.value = running_html(config)
        else:
            self.run_button.description, self.run_button.icon = "Run", "play"
            self.on_change()

    def on_progress(self, states) -> None:
        """stnb.launch calls this about twice a second, from its watchdog thread."""
        self.progress_updates += 1
        self.progress_threads.add(threading.current_thread().name)
        for st in states:
            if st.rank >= len(self.progress_bars):
                continue
            bar = self.progress_bars[st.rank]
            total = max(1, int(st.total or self.mode.expected_steps()))
            if bar.max != total:
                bar.max = total
            bar.value = max(0, min(int(st.step), total))
            bar.bar_style = {"done": "success", "failed": "danger"}.get(st.state, "info")
            self.progress_labels[st.rank].value = progress_text(st, total)

    # ---- outputs -----------------------------------------------------------------------------
    def show_error(self, e: BaseException, append: bool = False) -> None:
        self.last_error = e
        self.error.value = (self.error.value + error_html(e)) if append else error_html(e)

    def show_log(self) -> None:
        from ..processes import last_launch

        info = last_launch()
        html = rank_logs(info.logs) if info is not None else ""
        if html:
            self.log_view.value = html

    def append_unavailable(self, result: RunResult) -> None:
        if self.results_file is None:
            return
        from ..results import append_result

        try:
            append_result(self.results_file, result)
        except StnbError as e:
            self.show_error(e, append=True)

    def load_existing(self, path) -> None:
        import os

        if not os.path.exists(path):
            return
        try:
            rows = load_results(path, as_frame=False)
        except StnbError as e:
            self.show_error(e)
            return
        self.runs.extend(RunResult.from_dict(r) for r in rows)

    def refresh_outputs(self) -> None:
        """The table, the comparison plot, and where the time of the runs went (the last run's sentence)."""
        self.table.value = results_table(self.runs)
        if not self.runs:
            return
        from .. import plots

        try:
            self.figure = getattr(plots, self.plot_kind)(self.results)
            show_figure(self.plot, self.figure, f"<stnb {self.plot_kind} figure of {len(self.runs)} run(s)>")
            split = [r for r in self.runs if has_time_split(r)]
            self.advice.value = time_split_html(self.runs[-1]) if self.runs[-1].status == "ok" else ""
            if split:
                self.split_figure = plots.split_bars(split)
                show_figure(self.split_plot, self.split_figure,
                                     f"<stnb time split of {len(split)} run(s)>")
        except Exception as e:  # a plotting problem must not break the panel
            self.show_error(e, append=True)
