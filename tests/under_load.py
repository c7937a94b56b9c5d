"""``make test-under-load``: run a command (by default the slow tiers of ``make test``) while CPU-bound processes
that stnb did not start share the machine, as on a busy CI runner or a teacher's laptop with a browser open.

    python tests/under_load.py [--procs 2] -- make test

It starts ``--procs`` busy loops (each a Python process spinning in its own session, at the tests' priority),
runs the command, stops every loop however the command ends (its exit, Ctrl-C, a failure) and exits with the
command's status; it prints the load average before and after, and how long the command ran. Stopped itself
(SIGTERM, as ``timeout`` sends), it passes the signal on to the command and still stops every loop.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

#: what each load process runs: a loop that never sleeps (its command line names it, for ps and the test)
BUSY = "import time\nwhile True:\n    time.perf_counter()  # stnb-under-load\n"


def start_load(procs: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True, stdin=subprocess.DEVNULL)
            for _ in range(procs)]


def stop_load(load: list) -> None:
    for p in load:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in load:
        p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, help="CPU-bound processes beside the command (default 2)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --, e.g. -- make test")
    load, child = start_load(args.procs), None
    # stopped by a signal (`timeout`, a CI runner's cancel): SystemExit, the command is told, the loops stop below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.time()
    try:
        child = subprocess.Popen(command)
        print(f"under_load: {args.procs} busy process(es) (pids {', '.join(str(p.pid) for p in load)}); load "
              f"average {os.getloadavg()[0]:.1f}; running: {' '.join(command)}", flush=True)
        code = child.wait()
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        code = e.code
        if child is not None:
            child.terminate()
            child.wait()
    finally:
        after = os.getloadavg()
        stop_load(load)
    print(f"under_load: the command exited {code} after {time.time() - start:.0f} s; load average over the last "
          f"1 / 5 / 15 min: {after[0]:.1f} / {after[1]:.1f} / {after[2]:.1f}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
