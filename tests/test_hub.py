"""The hub without an environment variable: hub ids are tried when the network is there, refused
fast (one bounded request, before any process starts) with the bundled alternatives when it is not,
and the bundled presets never touch the network.

Everything stays offline: the "hub" is a local TCP port that counts connections and drops them,
or a closed port. Each case runs in a fresh interpreter so the Hugging Face libraries read the
environment at import, as in a notebook.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from stnb import models
from stnb.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


class DroppingServer:
    """A local port that accepts TCP connections, counts them, and closes them at once."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture
def server():
    s = DroppingServer()
    yield s
    s.close()


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def _python(code: str, tmp_path, endpoint: str, proxy: str | None = None, **env) -> dict:
    """Run ``code`` in a fresh interpreter with no offline variable set; its last stdout line is JSON."""
    e = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS + PROXY_VARS + ("NO_PROXY", "no_proxy")}
    e.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=ROOT, **env)
    e.setdefault("STNB_CACHE", os.environ.get("STNB_CACHE") or str(tmp_path / "stnb_cache"))
    if proxy:
        e.update({k: proxy for k in PROXY_VARS})
    out = subprocess.run([sys.executable, "-c", code], env=e, cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


REFUSED = """
import json, psutil, stnb
try:
    stnb.run(stnb.TrainConfig(device="cpu", steps=3, {field}={value!r}), echo=False)
    msg = None
except stnb.ConfigError as e:
    msg = str(e)
print(json.dumps({{"msg": msg, "children": len(psutil.Process().children(recursive=True))}}))
"""


@pytest.mark.parametrize("field, value, words", [
    ("model", "sentence-transformers/all-mpnet-base-v2", ["model='minilm'", "'tiny'", "local folder"]),
    ("data", "sentence-transformers/stsb", ["data='synthetic'", ".parquet file", "HF_HUB_OFFLINE=1"]),
])
@pytest.mark.parametrize("hub", ["dropping", "closed"])
def test_unreachable_hub_is_refused_with_the_bundled_alternatives(tmp_path, server, hub, field, value, words):
    endpoint = server.url if hub == "dropping" else _closed_port_url()
    r = _python(REFUSED.format(field=field, value=value), tmp_path, endpoint)
    if hub == "dropping":
        # one bounded request (httpx may reconnect once), not the loaders' retry loop (6 tries, ~25 s)
        assert 1 <= server.connections <= 2, server.connections
    msg = r["msg"]
    assert msg is not None, "the run was not refused"
    assert repr(value) in msg and "is unreachable" in msg and endpoint in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert r["children"] == 0  # refused in the notebook process: no rank was started


BUNDLED = """
import json, os, stnb
from stnb import models
prof = stnb.setup(show=False)
offline_set = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if v in os.environ]
emb = models.load_model("minilm").encode(["a sentence"])
r = stnb.run(stnb.TrainConfig(model="tiny", data="synthetic", strategy="ddp", num_processes=2, device="cpu",
                              per_device_batch_size=4, steps=3, warmup_steps_excluded=1, train_size=64,
                              dev_size=16), echo=False)
print(json.dumps({"offline_set": offline_set, "dim": int(emb.shape[1]), "verified": r.verified,
                  "spearman_after": r.spearman_after}))
"""


def test_bundled_presets_never_touch_the_network(tmp_path, server):
    # the hub endpoint and every HTTP(S) proxy point at the counting port: any request would show
    r = _python(BUNDLED, tmp_path, server.url, proxy=server.url, STNB_CACHE=str(tmp_path / "fresh_cache"))
    assert r["offline_set"] == []  # setup() no longer forces offline mode
    assert r["dim"] == 384 and r["verified"] is True and r["spearman_after"] is not None
    assert (tmp_path / "fresh_cache" / "tiny-bert-v1" / "modules.json").is_file()  # tiny was built, offline
    assert server.connections == 0


def test_a_cached_hub_model_loads_offline(tmp_path, monkeypatch):
    """A hub id downloaded before (here: tiny, placed in a Hugging Face cache) works with HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    snapshot = cache / "models--stnb-test--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(models.tiny_path(), snapshot)
    (cache / "models--stnb-test--tiny" / "refs").mkdir()
    (cache / "models--stnb-test--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert models.resolve_model("stnb-test/tiny") == "stnb-test/tiny"
    assert models.load_model("stnb-test/tiny").encode(["x"]).shape == (1, 64)
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        models.resolve_model("stnb-test/not-downloaded")
