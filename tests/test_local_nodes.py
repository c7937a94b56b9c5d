"""Several "nodes" on one GPU machine (issue 32 item 4.11).

``stnb.launch(..., num_nodes=2, node_rank=k, master_addr="127.0.0.1")`` on one machine: every node's ranks
have LOCAL_RANK 0..nproc-1 and a rank calls ``torch.cuda.set_device(LOCAL_RANK)``, so without a GPU slice
of its own every node's rank 0 took GPU 0. Here the launch's own start path (``start.run_ranks``) runs
with torch elastic's and the one-rank starter replaced by a recorder of the environment the ranks would
inherit; the GPU count is 4 (hardware.gpu_count, which reads NVML / nvidia-smi, never the driver).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import stnb
from stnb import hardware
from stnb.errors import ConfigError
from stnb.processes import start


def _gpu_each_rank_takes(monkeypatch, nodes: int, nproc: int, visible: str | None = None) -> dict:
    """{global rank: the physical GPU its set_device(LOCAL_RANK) selects}, from the environment each node's
    ranks inherit when run_ranks starts them."""
    import os

    monkeypatch.setattr(hardware, "gpu_count", lambda: 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    taken = {}

    def record(node_rank):
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = seen.split(",") if seen else [str(i) for i in range(4)]
        for local in range(nproc):  # what rank.py does: set_device(LOCAL_RANK) among the visible GPUs
            taken[node_rank * nproc + local] = ids[local]

    monkeypatch.setattr(start, "start_one", lambda ch, opts, addr, port, rank=0: record(rank))
    monkeypatch.setattr(start, "start_ranks", lambda ch, opts, **kw: record(kw["node_rank"]))
    for node in range(nodes):
        out = start.run_ranks(None, SimpleNamespace(nproc=nproc, device="cuda", backend="nccl", start_method="fork"),
                              master_addr="127.0.0.1", port=29511, node_rank=node, num_nodes=nodes,
                              mixed_precision="no", echo=False)
        assert out.failure is None, out.failure
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible  # the parent's own environment is given back
    return taken


@pytest.mark.parametrize("nodes,nproc", [(2, 1), (2, 2), (4, 1)])
def test_each_local_node_gets_its_own_gpus(monkeypatch, nodes, nproc):
    taken = _gpu_each_rank_takes(monkeypatch, nodes, nproc)
    assert sorted(taken) == list(range(nodes * nproc))
    assert sorted(taken.values()) == [str(i) for i in range(nodes * nproc)], taken  # one GPU per rank


def test_local_nodes_slice_the_gpus_the_user_made_visible(monkeypatch):
    taken = _gpu_each_rank_takes(monkeypatch, 2, 1, visible="2,3")
    assert taken == {0: "2", 1: "3"}


def test_one_node_and_cpu_ranks_keep_the_environment(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert start.node_gpus("cuda", 2, 1, 0, "127.0.0.1") is None
    assert start.node_gpus("cpu", 2, 2, 1, "127.0.0.1") is None
    assert start.node_gpus("cuda", 2, 2, 1, "10.0.0.7") is None  # a real second machine has its own GPUs


@pytest.mark.timeout(60)  # without the refusal the launch would start NCCL ranks here
def test_too_few_gpus_for_the_local_nodes_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="need 4 GPUs, one per rank; 2 are visible"):
        stnb.launch(len, num_processes=2, device="cuda", num_nodes=2, node_rank=1, master_addr="127.0.0.1",
                    master_port=29512)
