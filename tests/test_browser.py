"""Notebook 05 in a real browser, in each front end the course supports (JupyterLab 4, Notebook 7, Voilà): its
explorer's cells run, a layer chip is dragged to another device, the kernel sees it and the timeline redraws; a
change from the kernel during a drag waits for the drag to end; a refused choice leaves no stale figure, status or blank
space; three arrow presses in a row each move a chip; every position of the sliders is accepted; ZB-V from the menu
draws the V (the first device's column holds stage 0 and the last stage); and the time
from a drop or a slider's release to the new timeline is measured in the browser (printed, never asserted: shared
machines are noisy). In JupyterLab, a best plan's "apply" puts its placement on the board. MPEDU_SCREENSHOTS=<folder>
saves the explorer at 1280x720 and 1440x900 there, the V's board, and the best plans. Last, in each front end, a small notebook of
its own steps through a predicted 1F1B step (mpedu.course.step_through) with a click and the → key."""
import contextlib
import importlib.util
import json
import os
import re
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

from mpedu.core import Placement
from mpedu.course import SCHEDULE_MENU, SCHEDULES, SLOWDOWNS, link_label
from mpedu.runtime import LINKS

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "05_partitioning.ipynb"
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


def _revision(explorer) -> int:
    """The timeline picture the page shows: the widget stamps each drawing with the kernel's revision number."""
    return int(explorer.locator(".mpedu-timeline").first.get_attribute("data-revision") or -1)


def _board(explorer) -> dict:
    """Where the page shows each layer: {layer: device column}."""
    return explorer.evaluate("""e => Object.fromEntries([...e.querySelectorAll(".mpedu-chip")].map(
        (chip) => [chip.dataset.layer, chip.closest(".mpedu-device").dataset.device]))""")


# A kernel startup file: the explorers a test's notebook builds write what Python sees to {state}.
EXPLORER_STATE = """
import mpedu.course.explorer as _widgets
_build = _widgets.PipelineExplorer.__init__


def _with_state_file(self, *args, state_file=None, **kwargs):
    _build(self, *args, state_file=state_file or {state!r}, **kwargs)


_widgets.PipelineExplorer.__init__ = _with_state_file
"""

class Server(NamedTuple):
    front_end: "FrontEnd"
    base: str            # http://127.0.0.1:<port>
    token: str
    state: Path          # the notebook's widget writes what Python sees here (the explorer: EXPLORER_STATE)
    log: Path
    notebook: str        # the file name of the notebook it serves
    code_cells: int      # how many code cells it has
    widget: str          # a CSS selector that matches once the widget is on the page (Voilà: every cell has run)

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
        _wait_for(lambda: server.state.exists() and cells.count() == server.code_cells
                  and "*" not in "".join(prompts.all_text_contents()) and self.kernel_idle(page), 240,
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
        # the last one: the widget on the page (the explorer: a chip on its board) means every cell has run.
        widget = page.locator(server.widget)
        _wait_for(lambda: widget.count() > 0 and server.state.exists(), 240,
                  "Voilà to run the notebook and show its widget")


FRONT_ENDS = [JupyterLab(), Notebook7(), Voila()]


def _explorer_cells() -> dict:
    """Notebook 05 with only the code cells tagged `explorer`: the set-up, the measured costs and the explorer's
    own cells (every markdown cell kept). nbval runs the whole notebook; each front end here needs just what the
    explorer needs, which spares three runs of the section 1-3 experiments (about 30 s of training each)."""
    notebook = json.loads(NOTEBOOK.read_text())
    notebook["cells"] = [cell for cell in notebook["cells"] if cell["cell_type"] != "code"
                         or "explorer" in cell["metadata"].get("tags", [])]
    sources = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert any("PipelineExplorer(" in source for source in sources), \
        f"no code cell of {NOTEBOOK.name} tagged 'explorer' builds the explorer: tag the cells it needs"
    return notebook


EXPLORER_NOTEBOOK = _explorer_cells()


def _kernel_connected(server: Server) -> bool:
    """The server's view: the notebook's kernel is idle and a page holds a websocket to it."""
    try:
        sessions = server.get("/api/sessions")
    except OSError:
        return False
    return any(s["path"].endswith(server.notebook) and s["kernel"]["execution_state"] == "idle"
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


# -- fixtures: one server, one browser and one run of the notebook per front end, its tests in turn ---
@pytest.fixture(scope="module")
def sync_playwright():
    """Playwright's sync API, once Debian's Chromium and the playwright package are both there."""
    if not os.path.exists(CHROMIUM):
        _missing(f"Debian's Chromium is not at {CHROMIUM}", "apt-get install -y --no-install-recommends chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright Python package is missing", "pip install -e '.[dev]'")
    return sync_playwright


@pytest.fixture(scope="module", params=FRONT_ENDS, ids=lambda front_end: front_end.id)
def server(request, tmp_path_factory):
    """The front end on 127.0.0.1 serving notebook 05's explorer cells (a copy)."""
    with _serve(request.param, NOTEBOOK.name, lambda state: EXPLORER_NOTEBOOK, ".mpedu-explorer .mpedu-chip",
                tmp_path_factory) as server:
        yield server


@contextlib.contextmanager
def _serve(front_end: FrontEnd, filename: str, notebook, widget: str, tmp_path_factory):
    """The front end on 127.0.0.1 serving `notebook(state path)` (a notebook as a dict) as `filename`, with fresh home,
    config, data, settings, runtime and workspace folders, in its own process group (stopped whole at the end).
    `widget`: a CSS selector for Server.widget."""
    if importlib.util.find_spec(front_end.module) is None:
        _missing(f"the {front_end.module} package is missing", "pip install -e '.[notebooks]'")
    tmp_path = tmp_path_factory.mktemp(front_end.id)
    dirs = {name: tmp_path / name for name in ("home", "tmp", "config", "data", "settings", "runtime",
                                               "workspaces", "work")}
    for folder in dirs.values():
        folder.mkdir()
    news = dirs["settings"] / "@jupyterlab" / "apputils-extension"  # no news toast over the widgets
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    state, log_path = tmp_path / "explorer-state.json", tmp_path / "server.log"
    served = notebook(state)
    path = dirs["work"] / filename                           # a copy: the run saves nothing into the repository
    path.write_text(json.dumps(served))
    # every kernel the server starts builds its explorers with state_file=state (IPython runs the startup files
    # of the profile under HOME): mpedu itself has no switch for tests
    startup = dirs["home"] / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-explorer-state.py").write_text(EXPLORER_STATE.format(state=str(state)))
    port, token = _free_port(), uuid.uuid4().hex
    env = {**os.environ, "HOME": str(dirs["home"]), "TMPDIR": str(dirs["tmp"]),
           "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
           "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
           "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        process = subprocess.Popen(front_end.command(path, port, token), cwd=dirs["work"], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def listening():
        if process.poll() is not None:
            pytest.fail(f"{front_end.module} exited with {process.returncode}:\n{log_path.read_text()}")
        with socket.socket() as s:              # only connect: a GET on Voilà's root would run the notebook
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        _wait_for(listening, 60, f"{front_end.module} to listen on port {port}")
        yield Server(front_end, f"http://127.0.0.1:{port}", token, state, log_path, filename,
                     sum(cell["cell_type"] == "code" for cell in served["cells"]), widget)
    finally:
        _stop(process, dirs["runtime"])


@pytest.fixture(scope="module")
def page(playwright, server, tmp_path_factory):
    """A browser page on the served notebook once every cell has run. Running the notebook is most of a front
    end's time, so its tests share one page, in the file's order, each starting from the state the last left."""
    with _opened(playwright, server, tmp_path_factory.mktemp("run-all")) as page:
        yield page


@pytest.fixture(scope="module")
def playwright(sync_playwright):
    """One Playwright for the file: its sync API runs an event loop, and a second one alongside is refused."""
    with sync_playwright() as playwright:
        yield playwright


@contextlib.contextmanager
def _opened(playwright, server: Server, folder: Path):
    """A browser page on the server's notebook once every cell has run (a failure to get there: see `folder`)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
    context = browser.new_context(viewport=VIEWPORT)
    # 127.0.0.1 only: anything else (Voilà's icon stylesheet on a CDN) fails at once. A pattern, not a
    # function: the browser matches it itself, while a function would hold every request until Python
    # next talks to Playwright (a wait on the server alone would then stall the page).
    context.route(re.compile(rf"^(?!{re.escape(server.base)}/)[a-z]+://"), lambda route: route.abort())
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        with _look_here_on_failure(page, server, folder):
            page.goto(f"{server.base}{server.front_end.path(Path(server.notebook))}?token={server.token}",
                      wait_until="commit")
            server.front_end.run_all(page, server)
        yield page
    finally:
        browser.close()


VIEWPORT = {"width": 1400, "height": 1000}


@contextlib.contextmanager
def _look_here_on_failure(page, server: Server, folder: Path):
    """On a failure, a screenshot of the page in `folder` and the end of the server's log."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(folder / "failure.png"))
            print(f"--- {server.log.name} (last 4000 characters) ---\n{server.log.read_text()[-4000:]}")
        raise


# -- the tests -------------------------------------------------------------------------------------
def test_dragging_a_layer_changes_the_kernels_placement_and_redraws(page, server, tmp_path):
    with _look_here_on_failure(page, server, tmp_path):
        _drag_a_layer_and_train(page, server)
        _a_change_during_a_drag_is_drawn_when_it_ends(page, server)
        _a_refused_choice_leaves_nothing_stale(page, server)
        _three_arrow_presses_move_a_chip_three_times(page, server)
        _every_slider_position_is_accepted(page, server)
        _redraw_times(page, server)
        _a_v_puts_the_first_and_the_last_stage_on_device_0(page, server)
        _fits_a_laptop_screen(page, server, Path(os.environ.get("MPEDU_SCREENSHOTS") or tmp_path))


@pytest.mark.parametrize("server", FRONT_ENDS[:1], ids=[FRONT_ENDS[0].id], indirect=True)   # JupyterLab only
def test_a_best_plan_row_puts_its_placement_on_the_board(page, server, tmp_path):
    """Clicking a row's "apply" in the best plans: the kernel takes the row's plan and the page draws its chips.
    It runs on the page the drag scenario left (whatever the board shows, a row with another placement is found)."""
    page.set_viewport_size(VIEWPORT)                            # the last test left a laptop's screen size
    with _look_here_on_failure(page, server, tmp_path):
        explorer = page.locator(".mpedu-explorer").last
        explorer.scroll_into_view_if_needed()
        before = _settled(page, server)
        rows = explorer.locator(".mpedu-plan")
        _wait_for(lambda: rows.count() > 0, 30, "the best plans to be listed")
        # a row's text ends with its placement, as the board's message writes it (then "← your choice" on yours)
        placements = lambda: [t.replace("← your choice", "").rsplit(" · ", 1)[-1].strip()   # noqa: E731
                              for t in rows.all_inner_texts()]
        texts = placements()
        if all(t == before["placement"] for t in texts):
            # The machine's measured costs can make every best plan share the split already on the board:
            # move a layer first, as a person would, so that applying a row changes it.
            before = _move_one_layer_by_keyboard(page, server)
            _wait_for(lambda: rows.count() > 0, 30, "the best plans to be listed again")
            texts = placements()
        i = next((k for k, t in enumerate(texts) if t != before["placement"]), None)
        assert i is not None, f"every best plan has the placement already on the board: {texts}"
        row = rows.nth(i)
        row.scroll_into_view_if_needed()
        row.locator("button", has_text="apply").click()
        after = _wait_for(lambda: (s := server.read_state()) and s["placement"] == texts[i] and s, 20,
                          f"the kernel to take the row's placement ({texts[i]})")
        _wait_for(lambda: _board(explorer) == after["assignment"] != before["assignment"]
                  and texts[i] in explorer.locator(".mpedu-message").inner_text(), 10,
                  "the row's placement drawn on the board and named under it")
        _wait_for(lambda: "← your choice" in rows.nth(i).inner_text(), 10, "the row marked as the choice")
        folder = Path(os.environ.get("MPEDU_SCREENSHOTS") or tmp_path)   # for a person to look at
        folder.mkdir(parents=True, exist_ok=True)
        explorer.locator(".mpedu-best-plans").screenshot(path=str(folder / f"best-plans-{server.front_end.id}.png"))


def _fullest_device(state) -> tuple[int, list[str]]:
    """The index of the device holding the most layers (the first such), and its layers in model order."""
    devices, assignment = state["devices"], state["assignment"]
    k = max(range(len(devices)), key=lambda i: list(assignment.values()).count(devices[i]))
    return k, [name for name, d in assignment.items() if d == devices[k]]


def _neighbour_move(state) -> tuple[str, str, str]:
    """A move that keeps the split contiguous, so every schedule still takes it: the fullest device's last layer
    to the next device, or, on the last device, its first layer to the one before. (layer, arrow key, device)"""
    devices = state["devices"]
    k, own = _fullest_device(state)
    return (own[-1], "ArrowRight", devices[k + 1]) if k + 1 < len(devices) else (own[0], "ArrowLeft", devices[k - 1])


def _move_one_layer_by_keyboard(page, server: Server) -> dict:
    """Move one layer to a neighbouring device with the arrow keys (_neighbour_move); the settled state after."""
    state = _settled(page, server)
    layer, key, to = _neighbour_move(state)
    page.locator(".mpedu-explorer").last.locator(f".mpedu-chip[data-layer='{layer}']").click()
    page.keyboard.press(key)
    _wait_for(lambda: (s := server.read_state()) and s["assignment"][layer] == to, 20, f"{layer} to move to {to}")
    after = _settled(page, server)
    assert after["placement"], f"moving {layer} to {to} left an invalid placement: {after['message']}"
    return after


def _drag_a_layer_and_train(page, server: Server) -> None:
    """The scenario itself, the same in every front end, once all cells have run."""
    before = server.read_state()
    assert before["placement"], f"the notebook left an invalid placement: {before['message']}"

    explorer = page.locator(".mpedu-explorer").last
    explorer.scroll_into_view_if_needed()
    # The kernel is idle before the page has drawn all it sent (the last cell changes the placement): wait
    # for the page, or a late picture would pass for the redraw checked below.
    message = explorer.locator(".mpedu-message")           # the placement's own line: the best plans name others
    _wait_for(lambda: _board(explorer) == before["assignment"] and before["placement"] in message.inner_text(),
              20, f"the page to show the kernel's placement ({before['placement']})")
    revision = _steady(lambda: _revision(explorer), 1.0, 20, "a steady timeline picture")

    # Move a layer to a neighbouring device: every device keeps a layer, and one run of layers. (Once it went to
    # the first other device; where the notebook's measured balance had left the fullest device last, that gave
    # vgpu:0 two stages, the next scenario's 1F1B was refused, and its Run button stayed disabled.)
    assignment = before["assignment"]
    layer, _, target = _neighbour_move(before)
    expected = str(Placement(list(assignment), {**assignment, layer: target}))
    _drag(page, layer, target)

    # (1) Python's side: the kernel's placement, and the text it sends back to the page
    after = _wait_for(lambda: (s := server.read_state()) and s["placement"] == expected and s, 20,
                      f"the kernel to see {layer} on {target} ({expected})")
    assert after["redraws"] > before["redraws"]
    assert after["assignment"][layer] == target
    _wait_for(lambda: _board(explorer) == after["assignment"] and expected in message.inner_text(), 10,
              "the new placement on the page")
    # (2) the person's side: a new timeline picture
    _wait_for(lambda: _revision(explorer) == after["revision"] > revision, 20, "the timeline to redraw")

    # (3) Run trains real steps on a background thread; the progress reaches the end
    revision = _revision(explorer)
    explorer.locator("button", has_text="Run").click()
    done = _wait_for(lambda: (s := server.read_state()) and s["runs"] == before["runs"] + 1 and s["progress"] == 5
                     and not s["running"] and s, 60, "five trained steps")
    assert len(done["losses"]) == 5
    _wait_for(lambda: _revision(explorer) == done["revision"] > revision, 10, "the measured timeline")
    assert "measured step 5" in explorer.locator(".mpedu-timeline").inner_html()


def _drag(page, layer: str, device: str) -> None:
    """Drag a layer's chip onto a device's column with the mouse, in small steps, the board in mid-screen (a page
    that scrolls under a starting drag cancels it)."""
    explorer = page.locator(".mpedu-explorer").last
    explorer.locator(".mpedu-board").first.evaluate("e => e.scrollIntoView({ block: 'center' })")
    chip = explorer.locator(f".mpedu-chip[data-layer='{layer}']").bounding_box()
    column = explorer.locator(f".mpedu-device[data-device='{device}']").bounding_box()
    page.mouse.move(chip["x"] + chip["width"] / 2, chip["y"] + chip["height"] / 2)
    page.mouse.down()
    page.mouse.move(column["x"] + column["width"] / 2, column["y"] + column["height"] / 2, steps=5)
    page.mouse.up()


def _a_change_during_a_drag_is_drawn_when_it_ends(page, server: Server) -> None:
    """A redraw replaces every chip, so one that arrived mid-drag would take the dragged chip (and the drop)
    away. Mid-drag, a new schedule's notes from the kernel must wait; when the drag ends, they are drawn."""
    explorer = page.locator(".mpedu-explorer").last
    state = server.read_state()
    feet = lambda: explorer.locator(".mpedu-foot").all_inner_texts()   # noqa: E731  (busy and memory per device)
    transfer = page.evaluate_handle("() => new DataTransfer()")
    # Find a chip, mark it and start its drag in one step, in the page: the kernel may still be sending the last
    # run's notes, and a redraw between any two of these would replace the chip (a loaded machine once did so
    # between marking and dragging). A chip's locator cannot take part: Playwright finds the element, then
    # evaluates on it, two round trips apart, and the chip found may be gone by then. The explorer itself stays.
    explorer.evaluate(
        "(explorer, transfer) => { const chip = explorer.querySelector('.mpedu-chip'); chip.dataset.probe = 'kept';"
        " chip.dispatchEvent(new DragEvent('dragstart', { dataTransfer: transfer, bubbles: true })); }", transfer)
    chip = explorer.locator(".mpedu-chip[data-probe='kept']")          # a redraw would drop this mark
    old_feet, revision = feet(), _revision(explorer)                    # from now on the board holds still

    new = "1f1b" if state["schedule"] != "1f1b" else "gpipe"            # another peak memory per device
    explorer.locator("select").first.select_option(label=SCHEDULES[new])
    _wait_for(lambda: (s := server.read_state()) and s["schedule"] == new, 20, f"the kernel to take {new}")
    # the kernel sends the board's notes before the picture, so a new picture means the notes have arrived
    _wait_for(lambda: _revision(explorer) > revision, 20, f"the {new} timeline")
    assert chip.count() == 1, "the board was redrawn mid-drag"
    assert feet() == old_feet

    chip.dispatch_event("dragend", {"dataTransfer": transfer})
    _wait_for(lambda: chip.count() == 0 and feet() != old_feet, 10,
              "the board to redraw once the drag ended")


def _settled(page, server: Server):
    """The kernel's last state, once it measures nothing and the page shows its latest timeline."""
    explorer = page.locator(".mpedu-explorer").last
    return _wait_for(lambda: (s := server.read_state()) and not s["measuring"] and not s["running"]
                     and _revision(explorer) == s["revision"] and s, 60, "the explorer to settle")


def _slider(explorer, description: str):
    """The ipywidgets slider labelled `description`."""
    return explorer.locator(".widget-slider", has=explorer.page.locator(".widget-label", has_text=description))


def _slide(page, slider, index: int, positions: int) -> None:
    """Drag the slider's handle to position `index` of `positions` (0 = left end) and let go, as a person
    would (not the arrow keys: Notebook 7 keeps those for itself while a handle has the focus)."""
    base, handle = (slider.locator(part).first.bounding_box() for part in (".noUi-base", ".noUi-handle"))
    y = base["y"] + base["height"] / 2
    page.mouse.move(handle["x"] + handle["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(base["x"] + base["width"] * index / (positions - 1), y, steps=4)
    page.mouse.up()


def _a_refused_choice_leaves_nothing_stale(page, server: Server) -> None:
    """After a Run (status line, full progress bar, predicted and measured timelines), a refused schedule shows
    its message and nothing of the old choice: no timeline and no space kept for it, no status, no progress, no
    predicted figure; the explorer gets shorter by the timeline's height. An accepted choice brings a prediction
    back, without the old run."""
    explorer = page.locator(".mpedu-explorer").last
    runs = server.read_state()["runs"]
    explorer.locator("button", has_text="Run").click()
    _wait_for(lambda: (s := server.read_state()) and s["runs"] == runs + 1 and s["progress"] == 5
              and not s["running"], 60, "a second run")
    _settled(page, server)
    assert "loss" in explorer.inner_text() and explorer.locator(".widget-hprogress").first.is_visible()
    tall, picture = explorer.bounding_box()["height"], explorer.locator(".mpedu-timeline").bounding_box()["height"]

    explorer.locator("select").first.select_option(label=SCHEDULES["zb1"])   # refused when a device has 2 stages
    state = _wait_for(lambda: (s := server.read_state()) and s["schedule"] == "zb1" and s, 20, "zero bubble")
    if state["placement"]:                                                # one stage per device: then interleaved
        explorer.locator("select").first.select_option(label=SCHEDULES["interleaved"])   # wants stages dealt in turn
    refused = _wait_for(lambda: (s := server.read_state()) and "⚠" in s["message"] and s, 20, "a refusal")
    _wait_for(lambda: "⚠" in explorer.inner_text(), 10, "the refusal on the page")
    _wait_for(lambda: not explorer.locator(".mpedu-timeline").first.is_visible(), 10, "the timeline to go")
    words = explorer.inner_text()
    assert "predicted" not in words and "loss" not in words and "measured" not in words, words
    assert not explorer.locator(".widget-hprogress").first.is_visible()
    assert explorer.locator(".mpedu-foot").count() == 0                   # no busy/memory notes from before
    short = explorer.bounding_box()["height"]
    assert short < tall - 0.8 * picture, f"the explorer kept blank space: {tall:.0f} px -> {short:.0f} px"
    assert refused["figures"] == {}

    explorer.locator("select").first.select_option(label=SCHEDULES["gpipe"])
    _wait_for(lambda: explorer.locator(".mpedu-timeline").first.is_visible() and "predicted" in explorer.inner_text(),
              20, "the prediction to come back")
    assert "loss" not in explorer.inner_text()
    _settled(page, server)


def _three_arrow_presses_move_a_chip_three_times(page, server: Server) -> None:
    """A redraw replaces the chips (once for the move, again for the kernel's new notes): the focused chip must
    keep the keyboard through both, or only the first press works."""
    explorer = page.locator(".mpedu-explorer").last
    state = _settled(page, server)
    devices = state["devices"]
    k, own = _fullest_device(state)
    layer = own[-1]
    keys = ["ArrowRight", "ArrowLeft", "ArrowRight"] if k + 1 < len(devices) else ["ArrowLeft", "ArrowRight",
                                                                                   "ArrowLeft"]
    focused = lambda: page.evaluate("() => document.activeElement?.dataset?.layer ?? null")   # noqa: E731
    explorer.locator(f".mpedu-chip[data-layer='{layer}']").click()       # as a person would: click, then arrows
    _wait_for(lambda: focused() == layer, 10, f"{layer} to take the keyboard focus")
    for n, key in enumerate(keys):
        k += 1 if key == "ArrowRight" else -1
        page.keyboard.press(key)
        _wait_for(lambda: (s := server.read_state()) and s["assignment"][layer] == devices[k], 20,
                  f"press {n + 1} ({key}) to move {layer} to {devices[k]}")
        _wait_for(lambda: _board(explorer)[layer] == devices[k], 10, f"{layer} on {devices[k]} on the page")
        _settled(page, server)                                            # every redraw of this move is done
        assert focused() == layer, f"after press {n + 1} the keyboard focus is on {focused()!r}, not on {layer}"


def _every_slider_position_is_accepted(page, server: Server) -> None:
    """No slider position is always refused: the devices slider stops at the number of layers, and every count
    it offers gives a prediction (an even split); the time-chunks slider says it is for the wavefront only."""
    explorer = page.locator(".mpedu-explorer").last
    slider = _slider(explorer, "devices")
    slider.scroll_into_view_if_needed()
    layers = len(server.read_state()["assignment"])
    assert int(float(slider.locator(".noUi-handle").first.get_attribute("aria-valuemax"))) == layers
    for p in [*range(1, layers + 1), 2]:
        _slide(page, slider, p - 1, layers)
        state = _wait_for(lambda: (s := server.read_state()) and len(s["devices"]) == p and s, 20, f"{p} devices")
        assert state["placement"], f"{p} devices (a position the slider offers) was refused: {state['message']}"
        _settled(page, server)                                            # the board has its new columns and notes
        _wait_for(lambda: explorer.locator(".mpedu-device").count() == p, 10, f"{p} columns on the page")
        time.sleep(0.3)                                                   # and the page its new layout
    assert "wavefront" in _slider(explorer, "time chunks").inner_text()
    _settled(page, server)


# Records, in the page, when the learner acted (the drop, or letting go of a slider's handle): the first
# such event after the test arms it. The timeline stamps when it drew.
_MARK_ACTIONS = """() => { if (window.__mpeduActed === undefined) {
    for (const type of ["drop", "mouseup"])
      document.addEventListener(type, () => { window.__mpeduActed ??= performance.now(); }, true);
    window.__mpeduActed = null; } }"""


def _timed(page, explorer, act) -> float:
    """Milliseconds from the learner's action to the new timeline drawn in the page."""
    before = _revision(explorer)
    page.evaluate("() => { window.__mpeduActed = null; }")
    act()
    _wait_for(lambda: _revision(explorer) > before, 30, "the timeline after the action", interval=0.02)
    drawn = float(explorer.locator(".mpedu-timeline").first.get_attribute("data-drawn-at"))
    return drawn - page.evaluate("() => window.__mpeduActed")


def _redraw_times(page, server: Server) -> None:
    """Drop-to-timeline and slider-to-timeline times, measured in the browser, printed as medians. The machine
    is shared, so nothing here asserts a time."""
    explorer = page.locator(".mpedu-explorer").last
    page.evaluate(_MARK_ACTIONS)
    state = _settled(page, server)
    assignment, devices = state["assignment"], state["devices"]
    layer = [name for name, d in assignment.items() if d == devices[0]][-1]
    drags = []
    for n in range(6):
        target = devices[1] if n % 2 == 0 else devices[0]
        drags.append(_timed(page, explorer, lambda: _drag(page, layer, target)))
        _settled(page, server)
    slider = _slider(explorer, "micro-batches")
    slider.scroll_into_view_if_needed()
    handle = slider.locator(".noUi-handle").first
    positions = int(float(handle.get_attribute("aria-valuemax"))) + 1          # SelectionSlider: an index
    at = int(float(handle.get_attribute("aria-valuenow")))
    other = at + 1 if at + 1 < positions else at - 1
    first = _timed(page, explorer, lambda: _slide(page, slider, other, positions))   # a new size: drawn
    _settled(page, server)                                                                 # ... then measured
    slides = []
    for n in range(6):
        slides.append(_timed(page, explorer, lambda: _slide(page, slider, at if n % 2 == 0 else other,
                                                                   positions)))
        _settled(page, server)
    median = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    print(f"\n[{server.front_end.id}] drop -> timeline ms: {[round(x) for x in drags]}, median {median(drags):.0f}; "
          f"micro-batch slider -> timeline ms: {[round(x) for x in slides]}, median {median(slides):.0f}; first new "
          f"micro-batch size {first:.0f} ms (busy shared machine)")
    assert all(x > 0 for x in drags + slides)


def _a_v_puts_the_first_and_the_last_stage_on_device_0(page, server: Server) -> None:
    """ZB-V from the menu: the kernel lays the layers out as a V, and the page draws the first device's column with
    two stage boxes, stage 0 (embed first) and the last stage (decode last), the last device's with the two middle
    ones."""
    explorer = page.locator(".mpedu-explorer").last
    _settled(page, server)
    explorer.locator("select").first.select_option(label=SCHEDULE_MENU["zbv"])
    v = _wait_for(lambda: (s := server.read_state()) and s["schedule"] == "zbv" and s["cuts"] and s["placement"]
                  and s, 20, "the kernel to lay the layers out as a V")
    devices, last = v["devices"], 2 * len(v["devices"]) - 1
    _wait_for(lambda: _board(explorer) == v["assignment"], 10, "the V's chips on the page")
    column = lambda d: explorer.locator(f".mpedu-device[data-device='{d}']")   # noqa: E731
    boxes = lambda d: column(d).locator(".mpedu-stage").evaluate_all(   # noqa: E731  [stage name, layers] per box
        "boxes => boxes.map((b) => [b.querySelector('.mpedu-stage-name').textContent,"
        " [...b.querySelectorAll('.mpedu-chip')].map((c) => c.dataset.layer)])")
    _wait_for(lambda: [name for name, _ in boxes(devices[0])] == ["stage 0", f"stage {last}"], 10,
              f"{devices[0]}'s column to hold stage 0 and stage {last}")
    (_, first), (_, final) = boxes(devices[0])
    assert first[0] == "embed" and final[-1] == "decode", boxes(devices[0])
    assert [name for name, _ in boxes(devices[-1])] == [f"stage {len(devices) - 1}", f"stage {len(devices)}"]
    if os.environ.get("MPEDU_SCREENSHOTS"):                              # for a person to look at
        folder = Path(os.environ["MPEDU_SCREENSHOTS"])
        folder.mkdir(parents=True, exist_ok=True)
        explorer.locator(".mpedu-board").first.screenshot(path=str(folder / f"v-board-{server.front_end.id}.png"))
    _settled(page, server)


def _fits_a_laptop_screen(page, server: Server, folder: Path) -> None:
    """At 1280x720 and 1440x900: the schedule menu shows its whole text, the timeline fits on the screen, and the
    explorer is saved as a picture for a person to look at."""
    explorer = page.locator(".mpedu-explorer").last
    folder.mkdir(parents=True, exist_ok=True)
    # Busy pictures: interleaved 1F1B (hatched later stages), on a slowed PCIe link, after a Run (two panels).
    explorer.locator("select").first.select_option(label=SCHEDULES["interleaved"])
    _wait_for(lambda: (s := server.read_state()) and s["schedule"] == "interleaved", 20, "interleaved 1F1B")
    if not server.read_state()["placement"]:
        explorer.locator("button", has_text="deal the layers in turn").click()
        _wait_for(lambda: (s := server.read_state()) and s["placement"], 20, "the layers dealt in turn")
    menus = explorer.locator("select")
    menus.nth(1).select_option(label=link_label("pcie4", LINKS["pcie4"]))
    _wait_for(lambda: not menus.nth(2).is_disabled(), 20, "the slow-down to be offered for an emulated link")
    menus.nth(2).select_option(label=SLOWDOWNS[100])
    _wait_for(lambda: (s := server.read_state()) and s["link"] == "pcie4" and s["placement"], 20, "PCIe slowed 100x")
    runs = server.read_state()["runs"]
    explorer.locator("button", has_text="Run").click()
    _wait_for(lambda: (s := server.read_state()) and s["runs"] == runs + 1 and s["progress"] == 5
              and not s["running"], 90, "a run on the emulated link")
    _settled(page, server)
    legend = explorer.locator(".mpedu-legend").first.inner_text()
    for mark in ("F forward", "B backward", "hatched", "transfer", "waits"):
        assert mark in legend, f"the legend has no {mark!r}: {legend}"
    assert "1F3" in explorer.locator(".mpedu-labels").first.inner_text()
    for width, height in ((1280, 720), (1440, 900)):
        page.set_viewport_size({"width": width, "height": height})
        time.sleep(0.5)                                                   # the page lays itself out again
        explorer.scroll_into_view_if_needed()
        cut = explorer.locator("select").evaluate_all("""selects => selects.filter((s) => {
            const font = getComputedStyle(s), ctx = document.createElement("canvas").getContext("2d");
            ctx.font = `${font.fontSize} ${font.fontFamily}`;
            const longest = Math.max(...[...s.options].map((o) => ctx.measureText(o.text).width));
            return longest + 20 > s.clientWidth; }).map((s) => s.value)""")
        assert not cut, f"at {width} px these menus cut their text: {cut}"
        picture = explorer.locator(".mpedu-timeline").first.bounding_box()
        assert picture["height"] < height - 120, f"the timeline is {picture['height']:.0f} px tall at {width}x{height}"
        explorer.screenshot(path=str(folder / f"explorer-{server.front_end.id}-{width}x{height}.png"))
        explorer.locator(".mpedu-board").first.evaluate("e => e.scrollIntoView()")   # what one screen shows
        page.screenshot(path=str(folder / f"screen-{server.front_end.id}-{width}x{height}.png"))


# -- the step-through of a schedule (mpedu.course.stepper) in each front end ----------------------------------------
# Made at test time, not kept in tests/data: its last cell writes to this run's state file, whose path only the test
# knows, and there are no saved outputs to keep in step with the code.
STEPPER_CELLS = [
    "from mpedu.course import step_through\n"
    "from mpedu.predict import StageCost, simulate\n"
    "\n"
    "# 1F1B on 2 devices, 4 micro-batches: F 1 ms, B 2 ms, 2 MB of activations per micro-batch\n"
    "step = simulate(\"1f1b\", [StageCost(1e-3, activation_bytes=2_000_000)] * 2, micro_batches=4)\n"
    "view = step_through(step)\n"
    "view",
    # what Python sees (the step the page shows), for the test: written whole, then renamed
    "import json, os\n"
    "\n"
    "def _save(_=None):\n"
    "    with open({state!r} + '.tmp', 'w') as f:\n"
    "        json.dump({{'step': view.step, 'label': view.current.label}}, f)\n"
    "    os.replace({state!r} + '.tmp', {state!r})\n"
    "\n"
    "view.observe(_save, 'step')\n"
    "_save()",
]


def _stepper_notebook(state: Path) -> dict:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"stepper-{k}", "metadata": {}, "outputs": [],
              "source": source.format(state=str(state)) if k else source} for k, source in enumerate(STEPPER_CELLS)]
    return {"cells": cells, "metadata": {"kernelspec": EXPLORER_NOTEBOOK["metadata"]["kernelspec"]},
            "nbformat": 4, "nbformat_minor": 5}


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=[front_end.id for front_end in FRONT_ENDS])
def test_stepping_through_a_schedule_moves_the_highlight_and_the_memory_readout(front_end, playwright,
                                                                              tmp_path_factory, tmp_path):
    """A predicted 1F1B step, played in the page: one click on "step ▶", then one press of →, each show the next
    action (its box outlined, the others to come faded, what it waits for dashed), say what each device holds,
    and tell the kernel which action the page shows."""
    started = time.monotonic()
    with _serve(front_end, "stepper.ipynb", _stepper_notebook, ".mpedu-stepper", tmp_path_factory) as server, \
            _opened(playwright, server, tmp_path) as page:
        with _look_here_on_failure(page, server, tmp_path):
            stepper = page.locator(".mpedu-stepper").first
            stepper.scroll_into_view_if_needed()

            def seen(k: int) -> dict:
                """What the page shows, once it shows action k and the kernel knows it."""
                _wait_for(lambda: stepper.get_attribute("data-step") == str(k)
                          and (server.read_state() or {}).get("step") == k, 20, f"action {k} in the page and kernel")
                running = stepper.locator("rect.mpedu-step-running")
                box = running.get_attribute("data-box")
                return {"label": stepper.locator(f"text[data-box='{box}']").text_content(),
                        "running": running.count(), "box": box,
                        "waits": stepper.locator("rect.mpedu-step-waited").evaluate_all(
                            "rects => rects.map((r) => r.dataset.box)"),
                        "transfers": stepper.locator("line.mpedu-step-waited").count(),
                        "future": stepper.locator("rect.mpedu-step-future").count(),
                        "action": stepper.locator(".mpedu-step-action").inner_text(),
                        "memory": stepper.locator(".mpedu-step-device").all_inner_texts()}

            first = seen(1)
            assert first["label"] == "F0" and first["running"] == 1 and first["waits"] == [] and first["future"] == 15
            assert first["action"] == "gpu:0 runs F0, 0.00 → 1.00 ms; it needs only the batch"
            assert first["memory"] == ["gpu:0 holds 1 micro-batch's activations: F0 (2.0 MB)",
                                       "gpu:1 holds no activations (0 MB)"]

            stepper.locator("button", has_text="step ▶").click()
            second = seen(2)
            assert second["label"] == "F1" and second["box"] != first["box"] and second["future"] == 14
            assert second["action"] == "gpu:0 runs F1, 1.00 → 2.00 ms; it needs only the batch"
            assert second["memory"] == ["gpu:0 holds 2 micro-batches' activations: F0 F1 (4.0 MB)",
                                        "gpu:1 holds no activations (0 MB)"]

            page.keyboard.press("ArrowRight")          # the focus is on the button, inside the widget
            third = seen(3)
            assert third["label"] == "F0" and third["box"] not in (first["box"], second["box"])
            # it waits for gpu:0's F0 (the first action's box), over the transfer drawn orange
            assert third["waits"] == [first["box"]] and third["transfers"] == 1
            assert third["action"] == ("gpu:1 runs F0, 1.02 → 2.02 ms; it needs F0 from gpu:0 (sent at 1.00 ms, here "
                                       "at 1.02 ms): gpu:1 waited 1.02 ms for it")
            assert third["memory"] == ["gpu:0 holds 2 micro-batches' activations: F0 F1 (4.0 MB)",
                                       "gpu:1 holds 1 micro-batch's activations: F0 (2.0 MB)"]
            assert server.read_state() == {"step": 3, "label": "F0"}
    print(f"\n[{front_end.id}] step-through test: {time.monotonic() - started:.1f} s")
