"""The command line carries every TrainConfig field, with the dataclass's own defaults (stnb.cli_options)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from stnb.cli_options import SKIPPED, add_run_options, config_from_args
from stnb.config import TrainConfig
from stnb.strategies import options


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_run_options(p)
    return p.parse_args(list(argv))


def test_every_field_has_an_option_with_the_dataclass_default():
    a = _parse()
    for f in dataclasses.fields(TrainConfig):
        if f.name in SKIPPED:
            continue
        assert hasattr(a, f.name), f"TrainConfig.{f.name} has no command-line option"
    for name, o in options().items():  # each strategy's own options, with their declared defaults
        assert getattr(a, name) == o.default, f"strategy option {name} has no command-line option"
    assert config_from_args(a) == TrainConfig()


def test_options_reach_the_config():
    cfg = config_from_args(_parse("--strategy", "fsdp", "--nproc", "2", "--batch-size", "4", "--lr", "1e-3",
                                  "--accumulate", "3", "--no-eval", "--broadcast-buffers",
                                  "--no-reshard-after-forward", "--gradient-as-bucket-view",
                                  "--columns", '{"question": "anchor", "id": null}', "--max-seq-length", "32"))
    assert (cfg.strategy, cfg.num_processes, cfg.per_device_batch_size, cfg.learning_rate) == ("fsdp", 2, 4, 1e-3)
    assert cfg.gradient_accumulation_steps == 3 and cfg.evaluate is False and cfg.broadcast_buffers is True
    assert cfg.reshard_after_forward is False and cfg.gradient_as_bucket_view is True
    assert cfg.columns == {"question": "anchor", "id": None} and cfg.max_seq_length == 32
    assert config_from_args(_parse("--num-processes", "3", "--per-device-batch-size", "5")).num_processes == 3


def test_a_bad_columns_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _parse("--columns", "[1, 2]")
    assert "expected a JSON object" in capsys.readouterr().err
