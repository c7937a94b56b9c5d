"""Command line: python -m stnb {run,hardware,export} ..., and the subcommands other packages register
through the ``stnb.cli`` entry point group (stnb's lab: bench, gpu-check, predict, split)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_run(a) -> int:
    from .runner import run

    from .cli_options import config_from_args

    cfg = config_from_args(a)
    result = run(cfg, results_file=a.results, echo=not a.json)
    from .scaleout import is_main_process

    status = 0 if result.verified else 1  # every rank exits the same way; only rank 0 reports
    if not is_main_process():  # under torchrun / accelerate launch
        return status
    if a.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_summary(result)
    if status:
        print(f"error: the run finished, but {result.reason or 'it is not verified (no reason recorded)'}",
              file=sys.stderr)
    return status


def _print_summary(result) -> None:
    sps = f"{result.samples_per_second:.1f}" if result.samples_per_second else "n/a"
    print(f"strategy {result.strategy}  world_size {result.world_size}  global batch {result.global_batch_size}  "
          f"steps {result.steps}")
    print(f"samples/s {sps}  final loss {result.losses[-1] if result.losses else 'n/a'}  verified {result.verified}")
    if result.spearman_before is not None:
        print(f"spearman dev: before {result.spearman_before:.4f}  after {result.spearman_after:.4f}")


def cmd_hardware(a) -> int:
    from .hardware import report

    rep = report()
    print(json.dumps(rep.to_dict()) if a.json else rep)
    return 0


GROUP = "stnb.cli"


def extensions() -> list:
    """The ``add_cli(subparsers)`` functions of the ``stnb.cli`` entry point group. Installed metadata first;
    a source checkout whose installed metadata predates the group (run through PYTHONPATH) declares it in
    the pyproject.toml beside the package, read here. The core names no package that extends it."""
    from importlib.metadata import EntryPoint, entry_points
    from pathlib import Path

    found = list(entry_points(group=GROUP))
    if not found:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        if pyproject.is_file():
            import tomllib

            declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {})
            found = [EntryPoint(name, value, GROUP) for name, value in declared.get(GROUP, {}).items()]
    adders = []
    for ep in sorted(found, key=lambda ep: ep.name):
        try:
            adders.append(ep.load())
        except ImportError as e:  # the core's own subcommands still work; say what is missing and why
            print(f"stnb: the subcommands of {ep.value} ({GROUP} entry point {ep.name!r}) are unavailable: {e}; "
                  "reinstall stnb (make install, or pip install -e .)", file=sys.stderr)
    return adders


def parser() -> argparse.ArgumentParser:
    """``python -m stnb``'s parser: the core's subcommands and those of the ``stnb.cli`` entry points."""
    from . import export
    from .cli_options import add_run_options

    parser = argparse.ArgumentParser(prog="python -m stnb", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="train once and print the RunResult")
    add_run_options(p_run)
    p_run.set_defaults(func=cmd_run)
    p_hw = sub.add_parser("hardware", help="what this machine has and which strategies run here")
    p_hw.add_argument("--json", action="store_true")
    p_hw.set_defaults(func=cmd_hardware)
    export.add_cli(sub)
    for add_cli in extensions():  # each registers its own sub-commands
        add_cli(sub)
    return parser


def main(argv=None) -> int:
    from .errors import StnbError

    a = parser().parse_args(argv)
    try:
        return a.func(a)
    except StnbError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
