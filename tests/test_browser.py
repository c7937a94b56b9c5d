"""The DDP panel in a real browser: JupyterLab + headless Chromium (Playwright).

Starts ``jupyter lab`` on 127.0.0.1 with a random token, serving a temporary copy of
notebooks/ (so autosave never writes outputs into the repository), opens
03_ddp_from_a_notebook.ipynb, runs every cell from the Run menu, clicks the panel's Run
button, and checks that

* the per-rank progress bars update while the kernel is busy in the button callback
  (they are driven from stnb.launch's watchdog thread),
* a result row and a plotly plot appear in the panel.

A screenshot of the panel is saved to artifacts/browser-ddp-panel.png. Chromium must be
installed (``make browser``); without it the test fails, it is never skipped.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = os.environ.get("STNB_BROWSER_NOTEBOOK", "03_ddp_from_a_notebook.ipynb")
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
ARTIFACTS = ROOT / "artifacts"
SCREENSHOT = ARTIFACTS / "browser-ddp-panel.png"

SERVER_START_S = 120
NOTEBOOK_RUN_S = 420       # every cell of the notebook, CI profile, 2 busy cores
PANEL_RUN_S = 240          # one ddp run from the panel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class Lab:
    """A jupyter lab server of our own; stop() leaves no process behind (kernels and ranks included)."""

    def __init__(self, root_dir: Path, work: Path):
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, STNB_PROFILE="ci", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   JUPYTER_CONFIG_DIR=str(work / "config"), JUPYTER_RUNTIME_DIR=str(work / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(work / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(work / "ws"),
                   IPYTHONDIR=str(work / "ipython"))
        # no "would you like news?" toast over the notebook
        (work / "settings" / "@jupyterlab" / "apputils-extension").mkdir(parents=True, exist_ok=True)
        (work / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={root_dir}", "--LabApp.news_url=None"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log_path = work / "jupyter.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=root_dir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        # every process the server ever had below it (kernels, and the ranks they fork), sampled from
        # the start, so that the check after stop() covers processes that were re-parented or ended early
        self.seen = {}
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._sampling.is_set():
            for p in _descendants(self.proc.pid):
                self.seen.setdefault(p.pid, p)
            self._sampling.wait(0.2)

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def wait_until_up(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with code {self.proc.returncode}:\n{self.log()}")
            try:
                self.api("/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"jupyter lab did not answer within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        """Shut the server down the way a user does (kernels deleted, then the server): nothing is
        killed by pid here, so processes that outlive a normal shutdown show up in ``leftovers``."""
        self._sampling.set()
        self._sampler.join(timeout=5)
        for p in _descendants(self.proc.pid):  # a last sample: everything below the server right now
            self.seen.setdefault(p.pid, p)
        try:
            for k in self.api("/api/kernels") or []:
                self.api(f"/api/kernels/{k['id']}", method="DELETE")
        except Exception:
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own session (it was started in a new one)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()

    def leftovers(self, grace_s: float = 5.0) -> list:
        """Processes seen below the server at any time that are still alive after stop(); they are
        killed afterwards (so a failing run leaves nothing either) and returned for the assertion."""
        deadline = time.time() + grace_s
        left = Lab.alive(self.seen.values())
        while left and time.time() < deadline:
            time.sleep(0.2)
            left = Lab.alive(left)
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
        return left

    @staticmethod
    def alive(procs) -> list:
        import psutil

        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        return left


@pytest.fixture
def lab(tmp_path):
    src = ROOT / "notebooks"
    root = tmp_path / "notebooks"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    if NOTEBOOK == "_panel_only.ipynb":  # development aid: a notebook with only the panel
        cells = ["import stnb\nprof = stnb.setup()", "import stnb.widgets\npanel = stnb.widgets.Panel()\npanel"]
        nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                         "source": c} for i, c in enumerate(cells)],
              "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                          "name": "python3"}},
              "nbformat": 4, "nbformat_minor": 5}
        (root / NOTEBOOK).write_text(json.dumps(nb))
    assert (root / NOTEBOOK).exists(), f"notebooks/{NOTEBOOK} is missing"
    server = Lab(root, tmp_path)
    try:
        server.wait_until_up(SERVER_START_S)
        yield server
    finally:
        server.stop()
        left = server.leftovers()
        assert not left, (f"processes left behind after a normal shutdown (of {len(server.seen)} seen below "
                          f"the server during the test): {[(p.pid, p.name()) for p in left]}")


def _chromium_or_fail() -> str:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"Chromium not found at {CHROMIUM}: the browser test needs it. Run `make browser` "
                    "(installs Debian's chromium), or set CHROMIUM=/path/to/chromium.", pytrace=False)
    return CHROMIUM


def _cell_errors(page) -> str:
    texts = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    tracebacks = [t for t in texts if "Error" in t or "Traceback" in t]
    return "\n---\n".join(t[-2000:] for t in tracebacks)


@pytest.mark.timeout(SERVER_START_S + NOTEBOOK_RUN_S + PANEL_RUN_S + 180)
def test_ddp_panel_in_jupyterlab(lab):
    chromium = _chromium_or_fail()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    timings = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            # tall enough that the whole panel (form, progress, table, dashboard) fits in the notebook view
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            console = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            t0 = time.time()
            page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook", timeout=120_000)
            # the kernel must be up before Run All (accept the kernel dialog if Lab asks)
            _wait_for(page, lambda: _kernel_idle(page), 180, "the kernel to start")
            timings["open"] = time.time() - t0

            # Run > Run All Cells (again if Lab swallowed the first click, e.g. behind a dialog)
            t0 = time.time()
            for attempt in range(3):
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                try:
                    _wait_for(page, lambda: _started(page), 30, "the first cell to start")
                    break
                except TimeoutError:
                    page.keyboard.press("Escape")
            else:
                raise AssertionError("Run > Run All Cells did not start the notebook")
            try:
                _wait_for(page, lambda: page.locator(".stnb-panel button.stnb-run").count() > 0,
                          NOTEBOOK_RUN_S, "the panel", fail_on_cell_error=True)
                _wait_for(page, lambda: _idle(page), NOTEBOOK_RUN_S, "the notebook to finish",
                          fail_on_cell_error=True)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser-failure.png"), full_page=True)
                raise AssertionError(f"the notebook did not finish or show the panel.\ncell errors:\n"
                                     f"{_cell_errors(page)}\nconsole:\n" + "\n".join(console[-20:]) +
                                     f"\njupyter log:\n{lab.log()}")
            timings["run all cells"] = time.time() - t0
            errors = _cell_errors(page)
            assert "Traceback" not in errors, f"a notebook cell failed:\n{errors}"

            panel = page.locator(".stnb-panel").first
            panel.scroll_into_view_if_needed()
            rows_before = panel.locator(".stnb-results table tbody tr").count()
            run = panel.locator("button.stnb-run")
            assert run.is_enabled(), panel.locator(".stnb-validation").inner_text()

            # click Run; watch the per-rank labels while the kernel is busy in the callback
            t0 = time.time()
            run.click()
            seen_labels, seen_widths, running_seen = [], [], False
            deadline = time.time() + PANEL_RUN_S
            while time.time() < deadline:
                if "Running" in (run.inner_text() or ""):
                    running_seen = True
                labels = panel.locator(".stnb-progress .stnb-progress-rank").all_inner_texts()
                for text in labels:
                    if text not in seen_labels:
                        seen_labels.append(text)
                widths = panel.locator(".stnb-progress .progress-bar").evaluate_all(
                    "els => els.map(e => e.style.width)")
                if widths and widths not in seen_widths:
                    seen_widths.append(widths)
                if panel.locator(".stnb-results table tbody tr").count() > rows_before:
                    break
                err = panel.locator(".stnb-error").inner_text().strip()
                if err:
                    break
                time.sleep(0.1)
            timings["panel run"] = time.time() - t0
            err = panel.locator(".stnb-error").inner_text().strip()
            assert not err, f"the panel shows an error:\n{err}"

            # a result row and a plotly plot in the panel
            rows = panel.locator(".stnb-results table tbody tr")
            assert rows.count() == rows_before + 1, "no result row appeared"
            last = rows.nth(rows.count() - 1).inner_text()
            assert "ddp" in last and "ok" in last, last
            plot = panel.locator(".stnb-plot .js-plotly-plot")
            plot.first.wait_for(state="visible", timeout=60_000)
            assert panel.locator(".stnb-plot .js-plotly-plot .bars, .stnb-plot .js-plotly-plot .trace").count() > 0
            assert "done" in panel.locator(".stnb-status").inner_text()
            # where the time went: the sentence and the stacked bar of the measured split
            advice = panel.locator(".stnb-advice").inner_text()
            assert "Where the time went (ddp ×2," in advice and "ms per step" in advice, advice
            panel.locator(".stnb-split .js-plotly-plot").first.wait_for(state="visible", timeout=60_000)
            assert panel.locator(".stnb-split .js-plotly-plot .bars").count() > 0
            # the chosen strategy's knobs (ddp: its bucket size and comm hook), the others' hidden
            assert panel.locator(".stnb-knob-comm_hook").is_visible()
            assert not panel.locator(".stnb-knob-stage").is_visible()

            # live progress: labels and bars changed while the run was going on
            assert running_seen, "the Run button never showed 'Running…' during the run"
            live = [t for t in seen_labels if "running" in t]
            assert live, ("no per-rank progress was rendered while the kernel was busy; labels seen: "
                          f"{seen_labels}")
            assert any("done" in t for t in seen_labels), seen_labels
            assert len(seen_widths) >= 2, f"the progress bars never moved: {seen_widths}"
            # the cleanup check at teardown covers the ranks: the sampler saw them below the kernel
            assert len(lab.seen) >= 3, f"only {len(lab.seen)} process(es) seen below the server (kernel + ranks)"

            page.wait_for_timeout(1000)  # let plotly finish drawing
            panel.screenshot(path=str(SCREENSHOT))
            print(f"\nbrowser test timings (s): { {k: round(v, 1) for k, v in timings.items()} }")
            print(f"progress labels rendered during the run: {seen_labels}")
            print(f"progress bar widths rendered: {seen_widths}")
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000


def _kernel_idle(page) -> bool:
    """The notebook's kernel is connected and idle (status bar: "Python 3 (ipykernel) | Idle")."""
    return page.locator("#jp-main-statusbar", has_text="| Idle").count() > 0


def _started(page) -> bool:
    prompts = page.locator(".jp-InputPrompt").all_inner_texts()
    return any("*" in p or any(ch.isdigit() for ch in p) for p in prompts)


def _idle(page) -> bool:
    """Every queued cell ran: the kernel is idle and no prompt shows [*]."""
    return _kernel_idle(page) and page.locator(".jp-InputPrompt", has_text="[*]").count() == 0


def _wait_for(page, condition, timeout_s: float, what: str, fail_on_cell_error: bool = False) -> None:
    """Poll `condition`; meanwhile accept JupyterLab's "Select Kernel" dialog if it shows up."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        dialog = page.locator(".jp-Dialog")
        if dialog.count() > 0:
            accept = dialog.locator(".jp-Dialog-button.jp-mod-accept")
            if accept.count() > 0:
                accept.first.click()
        elif condition():
            return
        if fail_on_cell_error and "Traceback" in _cell_errors(page):
            raise AssertionError("a notebook cell failed")
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s} s for {what}")
