"""Who started CUDA (issue 32 item 5): when a launch is refused because the notebook process has started
the CUDA driver, the refusal names the cell and line that started it.

In a real Jupyter kernel (nbclient). This machine has no GPU, so the driver is simulated the way
tests/test_gpu_sim.py does: torch's device-count entry point is replaced, before stnb is imported, by
one that "starts the driver" (a flag that forksafe's driver check reads)."""

from __future__ import annotations

import textwrap

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from stnb.processes import forksafe  # noqa: E402

CELLS = [
    # [1] the simulated driver: started by the first device count
    """
    import torch
    started = []
    def simulated_device_count():
        started.append(1)
        return 1
    torch._C._cuda_getDeviceCount = simulated_device_count
    """,
    # [2]
    """
    import stnb
    from stnb.processes import forksafe
    forksafe.cuda_driver_initialised = lambda: bool(started)
    stnb.setup(show=False)
    print("WATCHED", forksafe.first_cuda_start())
    """,
    # [3] a call into torch's CUDA entry points that starts nothing (this torch has no CUDA) is not it
    """
    try:
        torch.zeros(1).cuda()
    except (AssertionError, RuntimeError) as e:
        print("NO CUDA HERE", type(e).__name__)
    print("AFTER [3]", forksafe.first_cuda_start())
    """,
    # [4] this one starts it
    """
    x = 2
    n = torch._C._cuda_getDeviceCount()
    """,
    # [5]
    """
    try:
        stnb.launch(print, num_processes=1, device="cpu")
    except stnb.ConfigError as e:
        print("REFUSED", e)
    print("GIVEN BACK", torch._C._cuda_getDeviceCount is simulated_device_count)
    """,
]


def _run(cells, tmp_path) -> list[str]:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in cells])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert [c.execution_count for c in nb.cells] == list(range(1, len(cells) + 1)), "In [1] ... In [n]"
    return ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream") for c in nb.cells]


def test_the_refusal_names_the_cell_that_started_cuda(tmp_path):
    out = _run(CELLS, tmp_path)
    assert "WATCHED None" in out[1], out[1]
    assert "NO CUDA HERE" in out[2] and "AFTER [3] None" in out[2], out[2]
    refused = out[4]
    assert "REFUSED CUDA is already initialised" in refused, refused
    assert ("It was first started by cell [4], line 2: `n = torch._C._cuda_getDeviceCount()` "
            "(through torch._C._cuda_getDeviceCount)") in refused, refused
    assert "GIVEN BACK True" in refused, "the watch gives torch's entry point back after the first start"


def test_cuda_started_before_stnb_watched_says_so(monkeypatch):
    import torch  # noqa: F401  (stnb watches once torch is imported)

    monkeypatch.setattr(forksafe, "_watch", {"on": False, "first": None, "before": False})
    monkeypatch.setattr(forksafe, "cuda_driver_initialised", lambda: True)
    forksafe.watch_cuda_start()
    assert forksafe.first_cuda_start() == {"before": True}
    with pytest.raises(forksafe.ConfigError, match="It was started before stnb was imported"):
        forksafe.check_fork_safe()


def test_a_start_by_another_way_is_not_pinned_on_the_next_watched_call(monkeypatch):
    """The driver started by a way stnb does not watch (say another library's ctypes call): the next call
    into a watched entry point must not be named as the one that started it."""
    import torch

    started = []
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    monkeypatch.setattr(forksafe, "_watch", {"on": False, "first": None, "before": False})
    monkeypatch.setattr(forksafe, "cuda_driver_initialised", lambda: bool(started))
    forksafe.watch_cuda_start()
    started.append(1)  # the unwatched start
    torch._C._cuda_getDeviceCount()
    assert forksafe.first_cuda_start() == {"entry": None, "where": None, "code": None}
    with pytest.raises(forksafe.ConfigError, match="started by a call stnb does not watch"):
        forksafe.check_fork_safe()
