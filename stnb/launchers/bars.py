"""The default live progress of a run: one tqdm bar per rank, fed with RankState lists."""

from __future__ import annotations


class StepBars:
    """Default live progress for ``run``: one tqdm bar per rank (a widget in Jupyter, text elsewhere),
    fed from a launcher's progress relay in this process (``stnb.launch``'s watchdog, a cluster job's
    progress files): ranks never draw bars themselves."""

    def __init__(self, label: str):
        self.label = label
        self.bars = {}

    def update(self, states) -> None:
        from tqdm.auto import tqdm

        for st in states:
            if st.total <= 0:
                continue
            bar = self.bars.get(st.rank)
            if bar is None:
                bar = self.bars[st.rank] = tqdm(total=st.total, desc=f"{self.label} rank {st.rank}",
                                                unit="step", leave=True, mininterval=0.5)
            if st.step > bar.n:
                bar.update(st.step - bar.n)
            if st.loss is not None:
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
