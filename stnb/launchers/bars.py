"""The default live progress of a run: one tqdm bar per rank, fed with RankState lists, and one plain
text line when the bars close."""

from __future__ import annotations

import sys
import time


class StepBars:
    """Default live progress for ``run``: one tqdm bar per rank (a widget in Jupyter, text elsewhere),
    fed from a launcher's progress relay in this process (``stnb.launch``'s watchdog, a cluster job's
    progress files): ranks never draw bars themselves.

    ``close()`` ends with one printed line, ``ddp: 30/30 steps, 2 ranks, 41 s``. A viewer without
    widgets (GitHub, nbconvert's HTML, a terminal log) shows a Jupyter bar as the text its output holds,
    which IPython writes when the bar is displayed (``0% 0/30``); so a widget bar is displayed here with a
    display id and, when it closes, its output is updated with the bar as it ended (``100% 30/30``): what a
    saved notebook shows wherever it is opened."""

    def __init__(self, label: str):
        self.label = label
        self.bars = {}
        self.shown = {}  # rank -> the display handle of its widget bar (Jupyter only)
        self.started = time.monotonic()
        self.closed = False

    def _bar(self, rank: int, total: int):
        from tqdm.auto import tqdm

        options = dict(total=total, desc=f"{self.label} rank {rank}", unit="step", leave=True, mininterval=0.5)
        notebook = sys.modules.get("tqdm.notebook")
        if notebook is None or not issubclass(tqdm, notebook.tqdm_notebook):
            return tqdm(**options)  # text bars (a terminal, a log)
        from IPython.display import display

        bar = tqdm(display=False, **options)
        if hasattr(bar, "container"):  # no container: tqdm disabled it (no widgets)
            self.shown[rank] = display(bar.container, display_id=True)
        return bar

    def update(self, states) -> None:
        for st in states:
            if st.total <= 0:
                continue
            bar = self.bars.get(st.rank)
            if bar is None:
                bar = self.bars[st.rank] = self._bar(st.rank, st.total)
            if st.step > bar.n:
                bar.update(st.step - bar.n)
            if st.loss is not None:
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)

    def summary(self) -> str | None:
        """The plain line ``close()`` prints (None before any rank reported a step count): the fewest
        steps any rank reached (the run's progress: every rank takes each step), of how many."""
        if not self.bars:
            return None
        done = min(bar.n for bar in self.bars.values())
        total = max(bar.total for bar in self.bars.values())
        ranks = len(self.bars)
        seconds = time.monotonic() - self.started
        return (f"{self.label}: {done}/{total} steps, {ranks} rank{'s' if ranks != 1 else ''}, {seconds:.0f} s"
                + ("" if done >= total else " (stopped before the last step)"))

    def close(self) -> None:
        """Close the bars and print the line, once (a cluster job closes them when it ends and again when
        its result is read)."""
        if self.closed:
            return
        self.closed = True
        for rank, bar in self.bars.items():
            bar.close()
            if rank in self.shown:  # the saved output's text: the bar as it ended, not as it started
                self.shown[rank].update(bar.container)
        line = self.summary()
        if line:
            print(line, flush=True)
