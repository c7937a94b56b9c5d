"""Command-line options for a TrainConfig, derived from its fields (``python -m stnb run`` / ``export``).

Every TrainConfig field, and every strategy's own option (``stnb.strategies.options()``), is an option named
after it (``per_device_batch_size`` -> ``--per-device-batch-size``) with its own default and type, so the CLI can
never drift from the dataclass or the strategies. A boolean that defaults to True is switched off with
``--no-<name>``. A few fields keep a short alias that earlier versions documented (``--nproc``, ``--batch-size``,
``--lr``, ``--accumulate``, ``--no-eval``). Only the fields' help texts live here; a strategy's option brings
its own (``Option.help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from . import strategies
from .config import TrainConfig

# field -> extra option strings kept from earlier versions of the CLI
ALIASES = {
    "num_processes": ("--nproc",),
    "per_device_batch_size": ("--batch-size",),
    "learning_rate": ("--lr",),
    "gradient_accumulation_steps": ("--accumulate",),
}
# boolean fields whose "off" switch has a name of its own
OFF_SWITCHES = {"evaluate": "--no-eval"}
# fields a command line cannot express (strategy_options: each option is one of its own)
SKIPPED = ("extra", "strategy_options")

HELP = {
    "strategy": "single, dp, ddp, zero1, zero2, fsdp or deepspeed (python -m stnb hardware lists them)",
    "num_processes": "processes for ddp/fsdp (default: 2 on CPU, all GPUs). Under torchrun, whose own "
                     "--nproc_per_node makes --nproc ambiguous, use --num-processes or leave it out",
    "model": "minilm, tiny, mpnet-base-random, a hub id or a local path",
    "data": "synthetic, a .csv/.jsonl/.parquet file or a hub dataset",
    "columns": 'JSON mapping of data columns to the loss inputs, e.g. \'{"question": "anchor", "id": null}\'',
    "loss": "cosine, mnrl or softmax+cosine (NLI + STS in one multi-dataset run, the docs' benchmark recipe)",
    "gather_across_devices": "mnrl: in-batch negatives from all ranks",
    "per_device_batch_size": "per-device batch size",
    "train_size": "training pairs (synthetic data: generated)",
    "dev_size": "dev pairs for the evaluation",
    "warmup_steps_excluded": "first steps left out of the throughput",
    "evaluate": "skip the dev evaluation before and after training",
    "dev_points": "dev evaluations during training besides before and after (the dev curve; default 0)",
    "save_to": "folder for the trained model (must not exist)",
    "device": "auto, cpu or cuda",
    "share_gpus": "let more ranks than GPUs run, sharing them over gloo (rank i on GPU i %% GPUs; to learn and test)",
    "start_method": "auto, fork (Linux) or spawn (fresh processes; the macOS / Windows default)",
    "mixed_precision": "no, bf16 or fp16",
    "reuse_freed_memory": "CPU: keep glibc's default allocator in the training processes",
    "gradient_accumulation_steps": "micro-batches per optimizer step; one all-reduce per step (no_sync)",
    "timeout": "seconds for the whole run",
    "stall_timeout": "seconds without progress before the run is stopped",
    "memory_budget_gib": "the most memory one rank may use, GiB (CPU: the whole rank process, RLIMIT_DATA; GPU: "
                         "torch's allocator); a rank that needs more fails as out of memory",
}


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def base_type(annotation: str):
    """int / float / str / dict from a field's annotation string ('int | None' -> int)."""
    for part in annotation.replace(" ", "").split("|"):
        if part in ("int", "float", "str", "dict", "bool"):
            return {"int": int, "float": float, "str": str, "dict": dict, "bool": bool}[part]
    raise TypeError(f"TrainConfig field annotation {annotation!r} has no command-line type")


def _json_dict(text: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if value is not None and not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def config_fields() -> list:
    """(name, annotation, help) of what the command line carries: the TrainConfig fields, then the strategies'
    options."""
    return ([(f.name, str(f.type), HELP.get(f.name, "")) for f in dataclasses.fields(TrainConfig)
             if f.name not in SKIPPED]
            + [(name, o.type, o.help) for name, o in strategies.options().items()])


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field and strategy option, with its default and type."""
    defaults = TrainConfig()
    for name, annotation, helptext in config_fields():
        default = getattr(defaults, name)
        kind = base_type(annotation)
        if kind is bool:
            if default:
                parser.add_argument(OFF_SWITCHES.get(name, "--no-" + name.replace("_", "-")), dest=name,
                                    action="store_false", help=helptext)
            else:
                parser.add_argument(_option(name), dest=name, action="store_true", help=helptext)
                # the explicit default, too (a script written when the default was on keeps working)
                parser.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false",
                                    help=argparse.SUPPRESS)
            continue
        names = (_option(name),) + ALIASES.get(name, ())
        if name == "num_processes":  # --nproc stays the first spelling in --help
            names = ("--nproc", _option(name))
        shown = f" (default {default})" if default is not None else ""
        parser.add_argument(*names, dest=name, type=_json_dict if kind is dict else kind, default=default,
                            help=helptext + shown)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The TrainConfig options plus where the result goes (``run`` and ``export``)."""
    add_config_options(parser)
    parser.add_argument("--results", default=None, help="append the RunResult to this JSONL file")
    parser.add_argument("--json", action="store_true", help="print the RunResult as one JSON object on the last line")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed options describe."""
    return TrainConfig(**{name: getattr(a, name) for name, _, _ in config_fields()})
