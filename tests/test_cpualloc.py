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
