#!/usr/bin/env bash
# On the GPU machine (no package registry): install the kit `make gpu-kit` built here, then run the GPU check.
#
#   bash gpu-kit/install.sh [gpu-check options]        e.g. bash gpu-kit/install.sh --plan
#   PYTHON=/path/to/python bash gpu-kit/install.sh      another interpreter (default: python3)
#   GPU_KIT_CHECK=--cpu bash gpu-kit/install.sh         the kit's CPU rows instead (what CI runs)
#   GPU_KIT_OUT=folder                                  a kit built elsewhere (default gpu-kit/out)
#
# Installs into PYTHON's own environment (the image's: its torch stays; pip only adds what the image lacks
# and upgrades transformers to the kit's), with --no-index: nothing is fetched. It never runs `make install`.
# Needs the device tool to carry the ignored kit folder: carry: ["gpu-kit/out"].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KIT=${GPU_KIT_OUT:-gpu-kit/out}
PY=${PYTHON:-python3}
if [ ! -f "$KIT/wheels.tar.xz" ]; then
  echo "gpu-kit/install.sh: $KIT/wheels.tar.xz is missing: run 'make gpu-kit' where a registry is reachable and carry $KIT" >&2
  exit 2
fi
# the wheels travel packed (gpu-kit/build.py pack): unpacked with Python's tarfile into a folder removed on exit
UNPACKED=$(mktemp -d "${TMPDIR:-/tmp}/stnb-gpu-kit.XXXXXX")
trap 'rm -rf "$UNPACKED"' EXIT
"$PY" - "$KIT/wheels.tar.xz" "$UNPACKED" <<'UNPACK'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
UNPACK
WHEELS="$UNPACKED/wheels"
echo "gpu-kit: $(ls "$WHEELS" | wc -l) wheels unpacked from $KIT/wheels.tar.xz into $WHEELS"
# no index and no pip configuration (no find-links, no extra index, from files or PIP_* variables): the kit's
# wheels and the image, nothing else
for v in $(compgen -e | grep '^PIP_' || true); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
"$PY" -m pip install --no-index --find-links "$WHEELS" -r gpu-kit/install.txt
"$PY" -m pip install --no-index --no-deps --force-reinstall "$WHEELS"/stnb-*.whl
# the tokenizer the random models are built with, where stnb.models.tokenizer_path finds it
dest=$("$PY" -c 'import os, stnb.models as m; print(os.path.join(m.cache_dir(), m.TOKENIZER_DIRNAME))')
mkdir -p "$dest" && cp "$KIT"/tokenizer/* "$dest"/
echo "gpu-kit: installed into $("$PY" -c 'import sys; print(sys.prefix)'); tokenizer in $dest"
# stnb's own requirements the kit leaves out (the bundled model, plotly, ipywidgets) are listed here, as expected
"$PY" -m pip check || echo "gpu-kit: pip check: stnb's left-out requirements are expected; anything else is a conflict"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$UNPACKED"; trap - EXIT
exec "$PY" -m stnb gpu-check ${GPU_KIT_CHECK:-} "$@"
