"""The torch build's GPU architectures are read without touching CUDA in this process.

Seen on an H200 (torch 2.11, the first real GPU run, docs/gpu.md "GPU results"): ``torch.cuda.get_arch_list()``
asks ``is_available()``, which runs ``cudaGetDeviceCount`` (``cuInit``): gpu-check's parent started the
driver and every forked rank was refused; reading ``torch._C._cuda_getArchFlags()`` instead marked the
forked ranks as children of a CUDA parent ("Cannot re-initialize CUDA in forked subprocess"). So stnb asks
a child process. Here every such entry point raises in this process: asking must still answer."""

from __future__ import annotations

import torch

from stnb import hardware


def test_the_arch_list_is_asked_in_a_child_process_never_here(monkeypatch):
    def touched(*_a, **_k):
        raise AssertionError("a CUDA entry point was called in the launching process")

    monkeypatch.setattr(hardware, "_cuda_build", lambda: True)  # as on a CUDA build of torch
    monkeypatch.setattr(torch.cuda, "get_arch_list", touched)
    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", touched, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", touched, raising=False)
    hardware._arch_list_of.cache_clear()
    try:
        # the child has this CPU build of torch: no architectures, and none of the calls above ran here
        assert hardware.torch_arch_list() == []
    finally:
        hardware._arch_list_of.cache_clear()
