"""Profiles and the notebooks' first cell: ``import stnb; stnb.setup()``.

STNB_PROFILE=ci (set by ``make test``) makes every notebook finish fast on 2 CPU cores:
tiny model, few steps. The default profile, 'workshop', trains the real pretrained
MiniLM long enough to see the loss fall.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass

PROFILES = {
    "workshop": dict(model="minilm", steps=30, per_device_batch_size=16, train_size=2000, dev_size=200,
                     bench_steps=20),
    "ci": dict(model="tiny", steps=6, per_device_batch_size=8, train_size=400, dev_size=64, bench_steps=6),
}


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    steps: int
    per_device_batch_size: int
    train_size: int
    dev_size: int
    bench_steps: int

    def config(self, **overrides):
        """A TrainConfig with this profile's sizes; keyword arguments override."""
        from .config import TrainConfig

        base = dict(model=self.model, steps=self.steps, per_device_batch_size=self.per_device_batch_size,
                    train_size=self.train_size, dev_size=self.dev_size)
        base.update(overrides)
        return TrainConfig(**base)

    def to_dict(self):
        return asdict(self)


def current_profile() -> Profile:
    name = os.environ.get("STNB_PROFILE", "workshop").strip().lower() or "workshop"
    if name not in PROFILES:
        from .errors import ConfigError

        raise ConfigError(f"unknown STNB_PROFILE {name!r}; use one of {sorted(PROFILES)}")
    return Profile(name=name, **PROFILES[name])


#: set by ``make notebooks``: every figure is also stored as a PNG, which GitHub's notebook view shows
STATIC_FIGURES_ENV = "STNB_STATIC_FIGURES"
#: the stored PNG's width in pixels (tests/test_notebook_outputs.py checks the committed ones)
STATIC_FIGURE_WIDTH = 1000


def figure_renderer() -> str:
    """plotly's renderer for the notebooks: the figure as JSON (JupyterLab draws it), and with
    ``STNB_STATIC_FIGURES=1`` a PNG beside it, drawn by kaleido with Chromium (``make browser``)."""
    if os.environ.get(STATIC_FIGURES_ENV, "").strip() in ("", "0"):
        return "plotly_mimetype"
    from .errors import ConfigError

    fix = "pip install kaleido==1.5.0 and Chromium (make browser), or unset " + STATIC_FIGURES_ENV
    try:
        import kaleido
    except ImportError as e:
        raise ConfigError(f"{STATIC_FIGURES_ENV}=1 stores a PNG of every figure, which needs kaleido: {fix}") from e
    import warnings

    import plotly.io as pio

    warnings.filterwarnings("ignore", message="The kopts argument is ignored", category=UserWarning)
    try:
        kaleido.start_sync_server(silence_warnings=True)   # one browser for all the session's figures
    except Exception as e:
        raise ConfigError(f"{STATIC_FIGURES_ENV}=1: kaleido could not start a browser ({e}): {fix}") from e
    # PNGs 1000 px wide (plotly's default is 700): the titles, legends and group labels fit at that width
    pio.renderers["png"].width = STATIC_FIGURE_WIDTH
    return "plotly_mimetype+png"


def setup(seed: int = 0, show: bool | str = True) -> Profile:
    """Seeds, the plotly renderer, and a hardware summary. Returns the profile.

    show: True prints two lines (the profile; the device and which strategies run here), "full" the
    whole hardware report (``print(stnb.hardware_report())``: every strategy's reason, the versions),
    False nothing. Each notebook is a new kernel that calls this first: the short banner keeps eleven
    notebooks from opening with the same fifteen lines.

    The Hugging Face hub is left as the environment has it: hub ids work when the network is there,
    and the bundled models and synthetic data never contact it (HF_HUB_OFFLINE=1 keeps it all local).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    import torch

    from .processes.forksafe import watch_cuda_start

    watch_cuda_start()  # a launch refused because this kernel started CUDA names the cell that did it
    torch.manual_seed(seed)  # CPU generator only: never initialises CUDA in the kernel
    try:
        import plotly.io as pio

        # stores the figure as JSON in the notebook (rendered by JupyterLab), not the 4 MB plotly.js bundle
        pio.renderers.default = figure_renderer()
    except ImportError:  # pragma: no cover
        pass
    try:
        # transformers' bars ("Loading weights 0/103") and with them the hub's download bars (one switch):
        # loading a model in the kernel takes a second, and a viewer without widgets shows each bar frozen
        # at 0 %. transformers.utils.logging.enable_progress_bar() turns them back on.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    prof = current_profile()
    if show:
        from .hardware import report

        print(f"stnb profile: {prof.name} (model {prof.model}, {prof.steps} steps, "
              f"batch {prof.per_device_batch_size}/device)")
        hw = report()
        print(hw if show == "full" else hw.short())
    return prof
