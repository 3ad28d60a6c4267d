"""Notebook 04 in a real browser: JupyterLab runs it, a layer chip is dragged to another device, the kernel sees it."""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from mpedu.placement import Placement

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "04_partitioning.ipynb"
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps calling out, and a closed network refuses it.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


def _missing(what: str) -> None:
    """In CI a missing browser is a broken set-up (fail); on a laptop it is a choice (skip)."""
    message = f"{what}; CI installs it with: apt-get install -y --no-install-recommends chromium"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    """Poll until condition() is truthy and return it; fail (never hang) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def sync_playwright():
    """Playwright's sync API, once Debian's Chromium and the playwright package are both there."""
    if not os.path.exists(CHROMIUM):
        _missing(f"Debian's Chromium is not at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright Python package is missing (pip install -e '.[dev]')")
    return sync_playwright


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with fresh home, settings, runtime and workspace folders, in its own
    process group (stopped whole at the end). Yields (base URL, token, work folder, state file)."""
    dirs = {name: tmp_path / name for name in ("home", "tmp", "settings", "runtime", "workspaces", "work")}
    for folder in dirs.values():
        folder.mkdir()
    news = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    shutil.copy(NOTEBOOK, dirs["work"] / NOTEBOOK.name)      # the run saves nothing into the repository
    state = tmp_path / "explorer-state.json"
    port, token = _free_port(), uuid.uuid4().hex
    env = {**os.environ, "HOME": str(dirs["home"]), "TMPDIR": str(dirs["tmp"]),
           "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]), "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
           "MPEDU_WIDGET_STATE": str(state),                 # the explorer writes what Python sees here
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1",
         "--port", str(port), f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={dirs['work']}",
         f"--LabApp.workspaces_dir={dirs['workspaces']}", f"--LabApp.user_settings_dir={dirs['settings']}"],
        cwd=dirs["work"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return server.poll() is not None and pytest.fail(f"JupyterLab exited: {(tmp_path / 'lab.log').read_text()}")

    try:
        _wait_for(up, 60, "JupyterLab to answer")
        yield base, token, state
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


def test_dragging_a_layer_changes_the_kernels_placement_and_redraws(sync_playwright, lab, tmp_path):
    base, token, state_file = lab
    read_state = lambda: json.loads(state_file.read_text()) if state_file.exists() else None  # noqa: E731

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            # its own workspace, so no tabs from an earlier session come back
            page.goto(f"{base}/lab/workspaces/{uuid.uuid4().hex}/tree/{NOTEBOOK.name}?token={token}")
            # the status bar, not the toolbar: it says Idle only once a kernel is connected
            status = page.locator("#jp-main-statusbar")
            _wait_for(lambda: "| Idle" in status.inner_text(), 60, "the kernel to be idle")

            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            # done when the explorer has written its state and no cell is queued or running ([*])
            prompts = page.locator(".jp-Notebook .jp-InputArea-prompt")
            _wait_for(lambda: state_file.exists() and "*" not in "".join(prompts.all_inner_texts())
                      and "| Idle" in status.inner_text(), 90, "Run All to finish")
            before = read_state()
            assert before["placement"], f"the notebook left an invalid placement: {before['message']}"

            explorer = page.locator(".mpedu-explorer").last
            explorer.scroll_into_view_if_needed()
            image = explorer.locator("img").first
            src = _wait_for(lambda: image.get_attribute("src"), 10, "the timeline picture")

            # Move the last layer of the fullest device to another device: every device keeps a layer.
            assignment, devices = before["assignment"], before["devices"]
            fullest = max(devices, key=lambda d: list(assignment.values()).count(d))
            layer = [name for name, d in assignment.items() if d == fullest][-1]
            target = next(d for d in devices if d != fullest)
            expected = str(Placement(list(assignment), {**assignment, layer: target}))
            page.drag_and_drop(f".mpedu-explorer .mpedu-chip[data-layer='{layer}']",
                               f".mpedu-explorer .mpedu-device[data-device='{target}']")

            # (1) Python's side: the kernel's placement, and the text it sends back to the page
            after = _wait_for(lambda: (s := read_state()) and s["placement"] == expected and s, 20,
                              f"the kernel to see {layer} on {target} ({expected})")
            assert after["redraws"] > before["redraws"]
            _wait_for(lambda: expected in explorer.inner_text(), 10, "the new placement on the page")
            chip = explorer.locator(f".mpedu-device[data-device='{target}'] .mpedu-chip[data-layer='{layer}']")
            assert chip.count() == 1
            # (2) the person's side: a new timeline picture
            _wait_for(lambda: image.get_attribute("src") != src, 20, "the timeline to redraw")

            # (3) Run trains real steps on a background thread; the progress reaches the end
            src = image.get_attribute("src")
            explorer.locator("button", has_text="Run").click()
            done = _wait_for(lambda: (s := read_state()) and s["progress"] == 5 and not s["running"] and s, 60,
                             "five trained steps")
            assert len(done["losses"]) == 5
            _wait_for(lambda: image.get_attribute("src") != src, 10, "the measured timeline")
            explorer.screenshot(path=str(tmp_path / "explorer.png"))   # what a person saw at the end
        except BaseException:
            with contextlib.suppress(Exception):                   # look here when it fails
                page.screenshot(path=str(tmp_path / "failure.png"))
            raise
        finally:
            browser.close()
