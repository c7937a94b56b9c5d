import os

import pytest

# No hub here (and none needed): every model and dataset in the tests is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the real SLURM and Ray clusters of the cluster tests (started on first use, stopped after their module)
from cluster_engines import ray_cluster, slurm_cluster  # noqa: E402,F401
# the runtime that already has torch (the GPU image, Colab), built once for the tests that install into it
from standin import image_runtime  # noqa: E402,F401
from tiers import order_and_mark  # noqa: E402
# --cpu-use=FILE: each test's CPU-seconds and the machine's (docs/testing.md, "Where the CPU goes")
from cpu_use import (pytest_addoption, pytest_configure, pytest_runtest_protocol,  # noqa: E402,F401
                     pytest_terminal_summary)


@pytest.fixture(autouse=True)
def _instruments_as_found():
    """A test that defines an Instrument registers it; the registry goes back as it was after the test, since a
    rank started later by fork in this worker makes every registered instrument (``stnb.instruments.reach``)."""
    import sys

    base = sys.modules.get("stnb.instruments.base")
    before = dict(base.Instrument.registered) if base else None
    yield
    if base is not None:
        base.Instrument.registered.clear()
        base.Instrument.registered.update(before)


@pytest.fixture
def world_of_one(tmp_path):
    """A torch.distributed gloo group of one process (this one), for the checks that ask the group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it renames each item by its group)
def pytest_collection_modifyitems(config, items):
    """make test's order: the in-process tests first, then the multi-process runs (marked slow), then the
    notebooks, the browser, the Jupyter kernels, the clusters and the GPU kit (slow); tests/tiers.py."""
    order_and_mark(items)
