"""``python -m stnblab.bench worker CONFIG.json LAUNCH_TIME OUT.json``: one torchrun rank of the
bench's launcher comparison (``runners.torchrun_worker``). The bench itself is ``python -m stnb bench``."""

import sys

from .runners import torchrun_worker

if len(sys.argv) >= 2 and sys.argv[1] == "worker":
    sys.exit(torchrun_worker(sys.argv[2:]))
print("usage: python -m stnb bench ...  (python -m stnblab.bench worker is internal)", file=sys.stderr)
sys.exit(2)
