"""stnb: notebook-first distributed training (DP, DDP, FSDP) for sentence-transformers."""

from .config import TrainConfig
from .errors import (BuildError, ConfigError, LaunchError, ResultsFileError, StnbError, StrategyUnavailable,
                     VerificationError)
from . import hardware
from .hardware import report as hardware_report
from .profiles import current_profile, setup
from .processes import heartbeat, last_launch, launch, rank_context, report_progress
from .results import RunResult, append_result, load_results, results_frame
from .runner import run
from .parity import Parity, parity
from .launchers.ray import Ray
from .launchers.slurm import Slurm
from .export import export_script
from .fits import fits
from .processes.forksafe import watch_cuda_start

watch_cuda_start()  # only when torch is already imported; stnb.setup() does it otherwise


def predict(result, devices=(2, 4, 8), link="loopback", **options):
    """Predict before you buy: samples/s of ``devices`` devices on ``link`` from one measured run.

    Returns a Prediction (``.table`` with each row's interval: ``low``, ``samples_per_second`` (the mid),
    ``high``, ``dominant``, ``suspect``; ``.figure``, ``.assumptions``); in a notebook it shows all three.
    ``stnb.scaling.predict`` (the computation, no plot) documents the options, ``stnb.scaling`` the model and
    the link presets. Refuses an unknown strategy or link (with the list) and a run of fewer than 3 steady
    steps (with the minimum)."""
    from .plots.predict import figure
    from .scaling import predict as compute

    pred = compute(result, devices=devices, link=link, **options)
    pred.figure = figure(pred)
    return pred

__version__ = "0.1.0"

__all__ = [
    "BuildError", "ConfigError", "LaunchError", "Parity", "ResultsFileError", "RunResult", "StnbError", "StrategyUnavailable",
    "TrainConfig", "VerificationError", "append_result", "hardware", "hardware_report", "heartbeat", "last_launch",
    "launch",
    "load_results", "rank_context", "report_progress", "results_frame", "run", "setup",
    "current_profile", "export_script", "fits", "parity", "predict", "Ray", "Slurm",
]


_LAZY = ("checkpoints", "examples", "export", "memory", "plots", "scaleout", "scaling", "timesplit", "widgets")


def __getattr__(name):
    """``stnb.plots``, ``stnb.widgets``... work after a plain ``import stnb`` (imported on first use)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'stnb' has no attribute {name!r}")
