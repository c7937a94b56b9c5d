"""stnb's lab: the bench, the GPU check, the TP/PP demonstrations and the predictor's checks against
published tables. It imports the core (``stnb``); the core never imports it (tests/test_lab_apart.py).

    bench       benchmark sweeps and side-by-side launchers, BENCHMARKS.md (``python -m stnb bench``)
    gpucheck    every GPU code path the visible GPUs allow (``python -m stnb gpu-check``)
    parallel    tensor and pipeline parallelism on the encoder (notebook 10)
    scaling     the predictor checked on published tables, and its CLI (``python -m stnb predict``)
    splitbench  the time split's benchmarks (``python -m stnb split``)
    exercises   checkers for the notebooks' "implement it yourself" exercises (a ring all-reduce, a ZeRO-1 step)
    launchers   the bench's own ways of starting ranks (raw notebook_launcher, independent runs at once)

``python -m stnb`` finds the lab's subcommands through the ``stnb.cli`` entry point (``add_cli``).
"""

_LAZY = ("bench", "exercises", "gpucheck", "launchers", "parallel", "scaling", "splitbench")


def add_cli(subparsers) -> None:
    """Register the lab's subcommands on ``python -m stnb``'s parser (the ``stnb.cli`` entry point)."""
    from . import bench, gpucheck, splitbench
    from .scaling import cli as predict_cli

    for command in (bench, gpucheck, predict_cli, splitbench):  # each registers its own sub-command
        command.add_cli(subparsers)


def __getattr__(name):
    """``stnblab.bench``, ``stnblab.parallel``... work after a plain ``import stnblab`` (imported on first use)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'stnblab' has no attribute {name!r}")
