"""stnb.cpualloc: large freed blocks are reused instead of being page-faulted in again."""

import json
import subprocess
import sys

import stnb

PROBE = r"""
import json, resource, sys, torch
from stnb import cpualloc
def faults_per_alloc():
    faults = []
    for _ in range(10):                          # the size of MiniLM's word-embedding gradient
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.zeros(30522, 384); x[7] += 1; del x
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(faults)[len(faults) // 2]      # the median allocation
plain = faults_per_alloc()
state = cpualloc.reuse_freed_memory()
tuned = faults_per_alloc()
print(json.dumps({"plain": plain, "tuned": tuned, "state": state}))
"""


def test_freed_embedding_sized_blocks_are_reused():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["state"] == {"applied": True, "reason": ""}
    # 47 MB = 11,446 pages of 4 KiB: glibc's default maps (and faults in) every one of them each time
    assert r["plain"] > 5000, r
    assert r["tuned"] < r["plain"] / 20, r


def test_runs_record_the_allocator_setting_per_rank():
    small = dict(model="tiny", steps=3, train_size=64, dev_size=16, warmup_steps_excluded=1, evaluate=False)
    on = stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4, **small), echo=False)
    assert [v["reuse_freed_memory"]["applied"] for v in on.verification["ranks"]] == [True, True]
    off = stnb.run(stnb.TrainConfig(strategy="single", per_device_batch_size=4, reuse_freed_memory=False, **small),
                   echo=False)
    assert off.verification["ranks"][0]["reuse_freed_memory"] == {"applied": False,
                                                                   "reason": "off (reuse_freed_memory=False)"}


HELD = r"""
import json, sys, torch
from stnb import cpualloc, memory
setting = getattr(cpualloc, sys.argv[1])()
x = torch.ones(2**24)                            # 64 MiB, touched
held = memory.proc_status("VmData")
del x
print(json.dumps({"setting": setting, "freed": held - memory.proc_status("VmData")}))
"""


def _freed(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", HELD, setting], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_under_a_budget_freed_blocks_leave_what_the_budget_counts():
    """A CPU budget counts the process's VmData: a rank under one gives a freed block back at once
    (``return_freed_memory``), where ``reuse_freed_memory`` keeps it mapped, still counted as held."""
    returned, kept = _freed("return_freed_memory"), _freed("reuse_freed_memory")
    assert returned["setting"] == kept["setting"] == {"applied": True, "reason": ""}
    assert returned["freed"] >= 60 * 2**20, returned      # the 64 MiB left VmData with the tensor
    assert kept["freed"] < 4 * 2**20, kept                # kept: still mapped, still counted


def test_a_cpu_run_under_a_budget_records_that_freed_blocks_go_back():
    from stnb.instruments.allocator import BUDGET_REASON

    small = dict(model="tiny", steps=3, train_size=64, dev_size=16, warmup_steps_excluded=1, evaluate=False)
    r = stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4, memory_budget_gib=64,
                                  **small), echo=False)
    assert r.verified
    assert [v["reuse_freed_memory"] for v in r.verification["ranks"]] == [
        {"applied": False, "reason": BUDGET_REASON, "returned": {"applied": True, "reason": ""}}] * 2
