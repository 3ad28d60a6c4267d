"""Notebook 04 in a real browser, in each front end the course supports (JupyterLab 4, Notebook 7, Voilà): the
notebook runs, a layer chip is dragged to another device, the kernel sees it and the timeline redraws; a change
from the kernel during a drag waits for the drag to end."""
import contextlib
import importlib.util
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
from typing import NamedTuple

import pytest

from mpedu.placement import Placement
from mpedu.widgets import SCHEDULES

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "04_partitioning.ipynb"
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps calling out, and a closed network refuses it.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


def _missing(what: str, install: str) -> None:
    """In CI a missing piece is a broken set-up (fail); on a laptop it is a choice (skip)."""
    message = f"{what}; install it with: {install}"
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


def _steady(read, quiet: float, timeout: float, what: str):
    """The value read() gives once it has stayed the same (and truthy) for `quiet` seconds."""
    value, since = read(), time.monotonic()

    def settled():
        nonlocal value, since
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        return value and time.monotonic() - since >= quiet

    _wait_for(settled, timeout, what)
    return value


def _board(explorer) -> dict:
    """Where the page shows each layer: {layer: device column}."""
    return explorer.evaluate("""e => Object.fromEntries([...e.querySelectorAll(".mpedu-chip")].map(
        (chip) => [chip.dataset.layer, chip.closest(".mpedu-device").dataset.device]))""")


class Server(NamedTuple):
    front_end: "FrontEnd"
    base: str            # http://127.0.0.1:<port>
    token: str
    state: Path          # the explorer writes what Python sees here (MPEDU_WIDGET_STATE)
    log: Path

    def get(self, path: str):
        with urllib.request.urlopen(f"{self.base}{path}?token={self.token}", timeout=5) as reply:
            return json.load(reply)

    def read_state(self):
        return json.loads(self.state.read_text()) if self.state.exists() else None


# -- the front ends: how to start each, open the notebook, and get all its cells run -----------------
class FrontEnd:
    id: str                                                   # the test's id: test_...[lab]
    module: str                                               # python -m <module> starts it

    def command(self, notebook: Path, port: int, token: str) -> list[str]:
        raise NotImplementedError

    def path(self, notebook: Path) -> str:
        """The URL path that opens the notebook."""
        raise NotImplementedError

    def run_all(self, page, server: "Server") -> None:
        """Return once every cell has run and the explorer is on the page."""
        raise NotImplementedError


class JupyterLab(FrontEnd):
    """JupyterLab 4: Run All from the menu once the kernel is connected and idle."""
    id, module = "lab", "jupyterlab"

    def command(self, notebook, port, token):
        return [sys.executable, "-m", self.module, "--no-browser", "--allow-root", "--ip", "127.0.0.1",
                "--port", str(port), f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebook.parent}"]

    def path(self, notebook):
        # its own workspace, so no tabs from an earlier session come back
        return f"/lab/workspaces/{uuid.uuid4().hex}/tree/{notebook.name}"

    def kernel_idle(self, page) -> bool:
        # the status bar, not the toolbar: it says Idle only once a kernel is connected
        return "| Idle" in page.locator("#jp-main-statusbar").inner_text()

    def run_all(self, page, server):
        # A Run All sent before the page has its kernel opens a kernel dialog and runs nothing. The server
        # knows when the page's websocket is open; from then on the page's own indicator is up to date.
        _wait_for(lambda: self.kernel_idle(page) and _kernel_connected(server), 60,
                  "the kernel to be connected and idle")
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        # Run All marks every cell [*] at once, so it is done when no [*] is left, the kernel is idle, and the
        # explorer has written its (fresh) state file. textContent, not innerText: the notebook skips rendering
        # cells out of view, whose innerText is then "". A collapsed cell (the exercise's answer) shows no prompt.
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        prompts = cells.locator(".jp-InputPrompt")
        _wait_for(lambda: server.state.exists() and cells.count() == CODE_CELLS
                  and "*" not in "".join(prompts.all_text_contents()) and self.kernel_idle(page), 90,
                  "Run All to finish")


class Notebook7(JupyterLab):
    """Notebook 7 is built from JupyterLab's parts (same menus, same cells) but has no status bar."""
    id, module = "notebook", "notebook"

    def path(self, notebook):
        return f"/notebooks/{notebook.name}"

    def kernel_idle(self, page):
        # The toolbar's execution indicator says "idle" while the page has no kernel yet ("No Kernel" next to
        # it), then "connecting", "unknown", "idle"; run_all also asks the server that the websocket is open.
        kernel_name = page.locator(".jp-Toolbar-kernelName")
        return (page.locator(".jp-Notebook-ExecutionIndicator").get_attribute("data-status") == "idle"
                and kernel_name.count() == 1 and kernel_name.inner_text().strip() not in ("", "No Kernel"))


class Voila(FrontEnd):
    """Voilà runs every cell itself, on the server, and shows only their outputs."""
    id, module = "voila", "voila"

    def command(self, notebook, port, token):
        return [sys.executable, "-m", self.module, str(notebook), "--no-browser", "--Voila.ip=127.0.0.1",
                "--port", str(port), f"--token={token}", "--show_tracebacks=True"]

    def path(self, notebook):
        return "/"                                            # a Voilà started on one notebook serves it there

    def run_all(self, page, server):
        # The page streams the outputs while the cells run, and connects its widgets to the kernel only after
        # the last one: a chip on the board means every cell has run.
        chips = page.locator(".mpedu-explorer .mpedu-chip")
        _wait_for(lambda: chips.count() > 0 and server.state.exists(), 90,
                  "Voilà to run the notebook and show the board")


FRONT_ENDS = [JupyterLab(), Notebook7(), Voila()]
CODE_CELLS = sum(cell["cell_type"] == "code" for cell in json.loads(NOTEBOOK.read_text())["cells"])


def _kernel_connected(server: Server) -> bool:
    """The server's view: the notebook's kernel is idle and a page holds a websocket to it."""
    try:
        sessions = server.get("/api/sessions")
    except OSError:
        return False
    return any(s["path"].endswith(NOTEBOOK.name) and s["kernel"]["execution_state"] == "idle"
               and s["kernel"]["connections"] > 0 for s in sessions)


def _stop(process: subprocess.Popen, runtime: Path) -> None:
    """Stop the server's process group; then any kernel it left behind. Kernels run in sessions of their own
    (a server stopped with SIGTERM shuts them down, one killed cannot); each names its connection file in
    this test's runtime folder, which is how its leftovers are found, by process id."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if str(runtime).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture
def sync_playwright():
    """Playwright's sync API, once Debian's Chromium and the playwright package are both there."""
    if not os.path.exists(CHROMIUM):
        _missing(f"Debian's Chromium is not at {CHROMIUM}", "apt-get install -y --no-install-recommends chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright Python package is missing", "pip install -e '.[dev]'")
    return sync_playwright


@pytest.fixture(params=FRONT_ENDS, ids=lambda front_end: front_end.id)
def server(request, tmp_path):
    """The front end on 127.0.0.1 serving a copy of notebook 04, with fresh home, config, data, settings, runtime
    and workspace folders, in its own process group (stopped whole at the end)."""
    front_end = request.param
    if importlib.util.find_spec(front_end.module) is None:
        _missing(f"the {front_end.module} package is missing", "pip install -e '.[notebooks]'")
    dirs = {name: tmp_path / name for name in ("home", "tmp", "config", "data", "settings", "runtime",
                                               "workspaces", "work")}
    for folder in dirs.values():
        folder.mkdir()
    news = dirs["settings"] / "@jupyterlab" / "apputils-extension"  # no news toast over the widgets
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    notebook = Path(shutil.copy(NOTEBOOK, dirs["work"] / NOTEBOOK.name))   # the run saves nothing into the repository
    state, log_path = tmp_path / "explorer-state.json", tmp_path / "server.log"
    port, token = _free_port(), uuid.uuid4().hex
    env = {**os.environ, "HOME": str(dirs["home"]), "TMPDIR": str(dirs["tmp"]),
           "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
           "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
           "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
           "MPEDU_WIDGET_STATE": str(state),                 # the explorer writes what Python sees here
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        process = subprocess.Popen(front_end.command(notebook, port, token), cwd=dirs["work"], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def listening():
        if process.poll() is not None:
            pytest.fail(f"{front_end.module} exited with {process.returncode}:\n{log_path.read_text()}")
        with socket.socket() as s:              # only connect: a GET on Voilà's root would run the notebook
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        _wait_for(listening, 60, f"{front_end.module} to listen on port {port}")
        yield Server(front_end, f"http://127.0.0.1:{port}", token, state, log_path)
    finally:
        _stop(process, dirs["runtime"])


# -- the test --------------------------------------------------------------------------------------
def test_dragging_a_layer_changes_the_kernels_placement_and_redraws(sync_playwright, server, tmp_path):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        # 127.0.0.1 only: anything else (Voilà's icon stylesheet on a CDN) fails at once. A pattern, not a
        # function: the browser matches it itself, while a function would hold every request until Python
        # next talks to Playwright (a wait on the server alone would then stall the page).
        context.route(re.compile(rf"^(?!{re.escape(server.base)}/)[a-z]+://"), lambda route: route.abort())
        page = context.new_page()
        page.set_default_timeout(30_000)
        try:
            page.goto(f"{server.base}{server.front_end.path(NOTEBOOK)}?token={server.token}", wait_until="commit")
            server.front_end.run_all(page, server)
            _drag_a_layer_and_train(page, server)
            _a_change_during_a_drag_is_drawn_when_it_ends(page, server)
            page.locator(".mpedu-explorer").last.screenshot(path=str(tmp_path / "explorer.png"))   # what a person saw
        except BaseException:
            with contextlib.suppress(Exception):                   # look here when it fails
                page.screenshot(path=str(tmp_path / "failure.png"))
                print(f"--- {server.log.name} (last 4000 characters) ---\n{server.log.read_text()[-4000:]}")
            raise
        finally:
            browser.close()


def _drag_a_layer_and_train(page, server: Server) -> None:
    """The scenario itself, the same in every front end, once all cells have run."""
    before = server.read_state()
    assert before["placement"], f"the notebook left an invalid placement: {before['message']}"

    explorer = page.locator(".mpedu-explorer").last
    explorer.scroll_into_view_if_needed()
    # The kernel is idle before the page has drawn all it sent (the last cell changes the placement): wait
    # for the page, or a late picture would pass for the redraw checked below.
    _wait_for(lambda: _board(explorer) == before["assignment"] and before["placement"] in explorer.inner_text(),
              20, f"the page to show the kernel's placement ({before['placement']})")
    image = explorer.locator("img").first
    src = _steady(lambda: image.get_attribute("src"), 1.0, 20, "a steady timeline picture")

    # Move the last layer of the fullest device to another device: every device keeps a layer.
    assignment, devices = before["assignment"], before["devices"]
    fullest = max(devices, key=lambda d: list(assignment.values()).count(d))
    layer = [name for name, d in assignment.items() if d == fullest][-1]
    target = next(d for d in devices if d != fullest)
    expected = str(Placement(list(assignment), {**assignment, layer: target}))
    page.drag_and_drop(f".mpedu-explorer .mpedu-chip[data-layer='{layer}']",
                       f".mpedu-explorer .mpedu-device[data-device='{target}']")

    # (1) Python's side: the kernel's placement, and the text it sends back to the page
    after = _wait_for(lambda: (s := server.read_state()) and s["placement"] == expected and s, 20,
                      f"the kernel to see {layer} on {target} ({expected})")
    assert after["redraws"] > before["redraws"]
    assert after["assignment"][layer] == target
    _wait_for(lambda: _board(explorer) == after["assignment"] and expected in explorer.inner_text(), 10,
              "the new placement on the page")
    # (2) the person's side: a new timeline picture
    _wait_for(lambda: image.get_attribute("src") != src, 20, "the timeline to redraw")

    # (3) Run trains real steps on a background thread; the progress reaches the end
    src = image.get_attribute("src")
    explorer.locator("button", has_text="Run").click()
    done = _wait_for(lambda: (s := server.read_state()) and s["progress"] == 5 and not s["running"] and s, 60,
                     "five trained steps")
    assert len(done["losses"]) == 5
    _wait_for(lambda: image.get_attribute("src") != src, 10, "the measured timeline")


def _a_change_during_a_drag_is_drawn_when_it_ends(page, server: Server) -> None:
    """A redraw replaces every chip, so one that arrived mid-drag would take the dragged chip (and the drop)
    away. Mid-drag, a new schedule's notes from the kernel must wait; when the drag ends, they are drawn."""
    explorer = page.locator(".mpedu-explorer").last
    state, image = server.read_state(), explorer.locator("img").first
    feet = lambda: explorer.locator(".mpedu-foot").all_inner_texts()   # noqa: E731  (busy and memory per device)
    old_feet, src = feet(), image.get_attribute("src")
    chip = explorer.locator(".mpedu-chip").first
    chip.evaluate("chip => { chip.dataset.probe = 'kept'; }")           # a redraw would drop this mark
    transfer = page.evaluate_handle("() => new DataTransfer()")
    chip.dispatch_event("dragstart", {"dataTransfer": transfer})

    new = "1f1b" if state["schedule"] != "1f1b" else "gpipe"            # another peak memory per device
    explorer.locator("select").first.select_option(label=SCHEDULES[new])
    _wait_for(lambda: (s := server.read_state()) and s["schedule"] == new, 20, f"the kernel to take {new}")
    # the kernel sends the board's notes before the picture, so a new picture means the notes have arrived
    _wait_for(lambda: image.get_attribute("src") != src, 20, f"the {new} timeline")
    assert explorer.locator(".mpedu-chip[data-probe='kept']").count() == 1, "the board was redrawn mid-drag"
    assert feet() == old_feet

    chip.dispatch_event("dragend", {"dataTransfer": transfer})
    _wait_for(lambda: explorer.locator(".mpedu-chip[data-probe='kept']").count() == 0 and feet() != old_feet, 10,
              "the board to redraw once the drag ended")
