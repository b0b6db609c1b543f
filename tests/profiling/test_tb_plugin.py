"""shardline's TensorBoard plugin in a real TensorBoard (a subprocess on 127.0.0.1, ``--port 0``) over a log
directory written by ``write_tensorboard``: the data API, the serving rule (only listed files, no traversal),
and, in headless Chromium driven over the DevTools protocol (a pipe, no port), the plugin page and the trace
viewer: no request leaves loopback, no console error, the viewer's model holds every slice of the trace."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import gzip
import http.client
import importlib.metadata
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.present.tb_plugin import INSTALL_HINT, viewer_dir
from shardline.profiling.present.tensorboard import PLUGIN_NAME, write_tensorboard
from shardline.profiling.table.load import load

SERVER_START_S = 90
PREFIX = f"/data/plugin/{PLUGIN_NAME}"
# Without the entry point installed (pyproject not yet applied), TensorBoard's program API loads the plugin;
# "{plugins}" is get_plugins (built-in + entry points) or get_static_plugins (built-in only).
_LAUNCH = ("import sys; from tensorboard import default, program; "
           "from shardline.profiling.present.tb_plugin import ShardlineLoader; "
           "tb = program.TensorBoard(plugins=default.{plugins}() + [ShardlineLoader()]); "
           "tb.configure(argv=[None, *sys.argv[1:]]); sys.exit(tb.main())")


def _entry_point_installed() -> bool:
    return any(ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group="tensorboard_plugins"))


@contextlib.contextmanager
def tensorboard(logdir: Path, *, entry_points: bool = True, env: dict | None = None):
    """A TensorBoard on 127.0.0.1 with an OS-chosen port; yields the port, stops the server on exit.

    ``entry_points=False``: only the built-in plugins and ours (no other package's plugin is loaded)."""
    flags = ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0", "--load_fast", "false"]
    if entry_points and _entry_point_installed():
        command = [sys.executable, "-m", "tensorboard.main", *flags]
    else:
        plugins = "get_plugins" if entry_points else "get_static_plugins"
        command = [sys.executable, "-c", _LAUNCH.format(plugins=plugins), *flags]
    # stderr goes to a file, not a pipe: a pipe nobody drains after start-up could fill and block the server.
    with tempfile.TemporaryDirectory(prefix="shardline-tb-") as scratch:
        log_path = Path(scratch) / "stderr.txt"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file,
                                    env={**os.environ, **(env or {})})
        try:
            yield _port_from(proc, log_path)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _port_from(proc: subprocess.Popen, log_path: Path) -> int:
    """The port from TensorBoard's "TensorBoard x at http://127.0.0.1:PORT/" line, polled under a deadline."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        match = re.search(rb"at http://127\.0\.0\.1:(\d+)/", log_path.read_bytes())
        if match:
            return int(match.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"TensorBoard did not report its port (exit {proc.poll()}): "
                         f"{log_path.read_text(errors='replace')[-2000:]}")


def _get(port: int, path: str) -> tuple[int, dict, bytes]:
    """GET ``path`` exactly as written (http.client does not normalise ``..`` or ``%2F``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Accept-Encoding": "identity"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, synth):
    root = tmp_path_factory.mktemp("tb_plugin")
    rows = []
    for rank in (0, 1):
        rows += synth.zero_tp_offload(rank, t0=1_000_000 + 3_000 * rank)[0]
    synth.write_kineto(rows, root / "traces")
    logs = root / "logs"
    write_tensorboard(load(root / "traces"), logdir=logs / "zero", layout={"tp": 2, "dp": 1, "zero_stage": 2})
    rows, _ = synth.one_f_one_b(2, 4, t0=1_000_000)
    synth.write_kineto(rows, root / "pp")
    write_tensorboard(load(root / "pp"), logdir=logs / "pipeline")
    # A hostile run: its manifest points outside the log directory, directly and through a link.
    (root / "secret.json").write_text('{"secret": 1}')
    evil = logs / "evil" / "plugins" / PLUGIN_NAME
    evil.mkdir(parents=True)
    (evil / "link.json").symlink_to(root / "secret.json")
    (evil / "manifest.json").write_text(json.dumps({"version": 1, "windows": [{
        "name": "w", "first_step": 0, "data": "../../../../secret.json", "traces": [
            {"label": "up", "kind": "raw", "path": "../../secret.json"},
            {"label": "absolute", "kind": "raw", "path": str(root / "secret.json")},
            {"label": "link", "kind": "raw", "path": f"plugins/{PLUGIN_NAME}/link.json"}]}]}))
    return root


@pytest.fixture(scope="module")
def server(logdir):
    with tensorboard(logdir / "logs") as port:
        yield port


def test_data_api_lists_the_plugin_and_returns_the_breakdown(server, logdir):
    status, _, body = _get(server, "/data/plugins_listing")
    listing = json.loads(body)
    assert status == 200 and listing[PLUGIN_NAME]["enabled"] is True
    assert listing[PLUGIN_NAME]["loading_mechanism"]["module_path"] == f"{PREFIX}/index.js"
    runs = json.loads(_get(server, f"{PREFIX}/runs")[2])
    assert set(runs["runs"]) == {"zero", "pipeline", "evil"}
    assert runs["runs"]["evil"] == []  # its window's data lies outside: not listed at all
    assert runs["viewer"]["available"] == (viewer_dir() is not None)
    (window,) = runs["runs"]["zero"]
    status, _, body = _get(server, f"{PREFIX}/window?run=zero&window={window['name']}")
    data = json.loads(body)
    table = breakdown(load(logdir / "traces"))
    assert status == 200 and len(data["breakdown"]) == len(table) == 2
    for record, (_, row) in zip(data["breakdown"], table.sort_values("rank").iterrows()):
        assert all(record[c] == row[c] for c in (*EXCLUSIVE_COLUMNS, "step_ns", "rank"))  # exact integer ns
    assert data["layout"] == {"tp": 2, "dp": 1, "zero_stage": 2}


def test_traces_are_served_as_listed(server, logdir):
    runs = json.loads(_get(server, f"{PREFIX}/runs")[2])["runs"]
    (window,) = runs["zero"]
    kinds = [t["kind"] for t in window["traces"]]
    assert kinds == ["merged", "raw", "raw"]
    raw = window["traces"][1]
    status, headers, body = _get(server, f"{PREFIX}/trace?run=zero&window={window['name']}&index={raw['index']}")
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(body))["distributedInfo"]["rank"] == 0
    assert "default-src 'self'" in headers["Content-Security-Policy"]


@pytest.mark.parametrize("path", [
    "/static/..%2F..%2Ftb_plugin.py", "/static/../tb_plugin.py", "/static/%2e%2e%2ftb_plugin.py",
    "/static/", "/static/index.js%00.css", "/viewer/..%2Fprofile_plugin.py", "/viewer/index.html",
    "/trace?run=..&window=w&index=0", "/trace?run=evil&window=w&index=0", "/trace?run=evil&window=w&index=2",
    "/trace?run=zero&window=window_3&index=-1", "/trace?run=zero&window=window_3&index=9",
    "/trace?run=zero%2F..%2F..&window=window_3&index=0", "/window?run=evil&window=w",
    "/window?run=..%2F..&window=secret",
])
def test_only_listed_files_are_served(server, path):
    status, _, body = _get(server, PREFIX + path)
    assert status in (400, 404), (path, status)
    assert b'"secret": 1' not in body and b"import enum" not in body  # neither the secret nor our source


# --- headless Chromium over the DevTools protocol ---------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT_S = 60


class Browser:
    """Chromium with ``--remote-debugging-pipe``: DevTools messages are NUL-terminated JSON on fds 3 (to the
    browser) and 4 (from it). Records every request URL and every console error / uncaught exception."""

    def __init__(self, profile_dir: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds():  # in the child: the protocol pipes become fds 3 and 4 (moved above 4 first)
            high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             f"--user-data-dir={profile_dir}", "--window-size=1400,1000", "--remote-debugging-pipe",
             "about:blank"], preexec_fn=wire_fds, close_fds=False,  # our other fds are close-on-exec
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.requests: list[str] = []
        self.errors: list[str] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    def call(self, method: str, *, session: bool = False, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + BROWSER_TIMEOUT_S
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._record(reply)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            if not ready:
                raise AssertionError("Chromium did not answer over the DevTools pipe in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise AssertionError(f"Chromium closed the DevTools pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def _record(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"{params['entry']['source']}: {params['entry']['text']} {params['entry'].get('url')}")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, *, what: str):
        """Poll ``expression`` until it is truthy (a page-state condition, not a timing assertion)."""
        deadline = time.monotonic() + BROWSER_TIMEOUT_S
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; console errors: {self.errors}")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True)["data"]))

    def close(self) -> None:
        with contextlib.suppress(OSError, AssertionError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_browser)
        os.close(self._from_browser)


# The plugin's iframe inside TensorBoard's page (same origin, so its document is reachable from the top).
PLUGIN_DOC = ("(() => { for (let i = 0; i < window.frames.length; i++) { try { const f = window.frames[i]; "
              "if (f.location.pathname.endsWith('plugin_entry.html')) return f.document; } catch (e) {} } "
              "return null; })()")
VIEWER = f"{PLUGIN_DOC}?.querySelector('iframe[data-role=viewer-frame]')?.contentDocument" \
         "?.querySelector('tf-trace-viewer')"
SLICES = (f"(() => {{ const m = {VIEWER}?._traceViewer?.model; if (!m) return 0; let n = 0; "
          "for (const p of Object.values(m.processes)) for (const t of Object.values(p.threads)) "
          "n += t.sliceGroup.slices.length; return n; })()")


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    chrome = Browser(tmp_path / "chromium-profile")
    yield chrome
    chrome.close()
    assert _outside(chrome.requests) == [], f"requests left loopback: {_outside(chrome.requests)}"


def _outside(requests: list[str]) -> list[str]:
    return [u for u in requests
            if urlsplit(u).scheme not in ("data", "blob", "about") and urlsplit(u).hostname != "127.0.0.1"]


def test_control_an_outside_request_is_caught(browser):
    # The recorder the other browser tests rely on sees a page's request to another host (.invalid never
    # resolves, and the resolver rules map every name but 127.0.0.1 to NOTFOUND: nothing goes out).
    browser.call("Page.navigate", session=True, url="data:text/html,<img src='http://outside.invalid/x.png'>")
    browser.wait_for("document.images.length === 1 && document.images[0].complete", what="the image attempt")
    assert _outside(browser.requests) == ["http://outside.invalid/x.png"]
    browser.requests.clear()  # this test's own outside request is not a finding of the teardown check
    browser.errors.clear()


def _open_plugin(browser: Browser, port: int) -> None:
    browser.call("Page.navigate", session=True, url=f"http://127.0.0.1:{port}/#{PLUGIN_NAME}")
    browser.wait_for(f"{PLUGIN_DOC}?.body?.dataset?.ready === 'breakdown'", what="the breakdown view")


def test_plugin_page_renders_the_breakdown_offline(server, browser, tmp_path):
    _open_plugin(browser, server)
    rows = browser.evaluate(f"{PLUGIN_DOC}.querySelectorAll('[data-role=breakdown-row]').length")
    # The first run in the listing is shown; each run here has two (rank, step) rows.
    assert rows == 2
    totals = browser.evaluate(f"[...{PLUGIN_DOC}.querySelectorAll('.bar-total')].map(e => e.textContent)")
    assert totals and all(t.endswith(" ms") for t in totals)
    # The bubble table shows the window's numbers: measured fraction vs the (p-1)/(m+p-1) ideal, per rank.
    run = browser.evaluate(f"{PLUGIN_DOC}.querySelector('[data-role=run-select]').value")
    runs = json.loads(_get(server, f"{PREFIX}/runs")[2])["runs"]
    data = json.loads(_get(server, f"{PREFIX}/window?run={run}&window={runs[run][0]['name']}")[2])
    cells = browser.evaluate(f"[...{PLUGIN_DOC}.querySelectorAll('[data-role=bubble-row]')]"
                             ".map(r => [...r.cells].map(c => c.textContent))")
    assert [(c[0], c[7], c[8]) for c in cells] == [
        (str(b["rank"]), f"{100 * b['bubble_fraction']:.1f}%", f"{100 * b['ideal_fraction']:.1f}%")
        for b in data["bubbles"]]
    assert len(cells) == 2 and cells[0][8] == "20.0%"  # p=2, m=4: 1/5
    browser.screenshot(tmp_path / "plugin_breakdown.png")
    assert (tmp_path / "plugin_breakdown.png").stat().st_size > 1000
    assert browser.errors == []
    assert any(f"{PREFIX}/index.js" in u for u in browser.requests)


def test_trace_viewer_holds_every_slice_of_the_raw_trace(server, browser, logdir, tmp_path):
    if viewer_dir() is None:
        pytest.skip("xprof is not installed: the in-page notice is tested instead")
    _open_plugin(browser, server)
    browser.evaluate(f"{PLUGIN_DOC}.querySelector('button[data-view=traces]').click()")
    browser.wait_for(f"{PLUGIN_DOC}.body.dataset.ready === 'traces'", what="the traces view")
    labels = browser.evaluate(f"[...{PLUGIN_DOC}.querySelectorAll('.trace-row b')].map(e => e.textContent)")
    index = labels.index("rank 0")
    browser.evaluate(f"{PLUGIN_DOC}.querySelectorAll('[data-role=open-trace]')[{index}].click()")
    run = browser.evaluate(f"{PLUGIN_DOC}.querySelector('[data-role=run-select]').value")
    source = logdir / ("traces" if run == "zero" else "pp") / "rank0.pt.trace.json.gz"
    expected = sum(e.get("ph") == "X" for e in json.loads(gzip.decompress(source.read_bytes()))["traceEvents"])
    count = browser.wait_for(SLICES, what="the trace viewer's model")
    assert count == expected
    browser.screenshot(tmp_path / "trace_viewer.png")
    # The merged trace (all ranks in one file): every complete event is a slice of the viewer's model too.
    browser.evaluate(f"{PLUGIN_DOC}.querySelectorAll('[data-role=open-trace]')[{labels.index('all ranks (merged)')}]"
                     ".click()")
    merged = next((logdir / "logs" / run / "plugins" / PLUGIN_NAME).glob("*.merged.trace.json.gz"))
    expected = sum(e.get("ph") == "X" for e in json.loads(gzip.decompress(merged.read_bytes()))["traceEvents"])
    # The raw trace of rank 0 has one process (its device); the merged one has the ranks as processes.
    browser.wait_for(f"Object.keys({VIEWER}?._traceViewer?.model?.processes ?? {{}}).length >= 2",
                     what="the merged trace in the viewer")
    assert browser.evaluate(SLICES) == expected
    browser.screenshot(tmp_path / "trace_viewer_merged.png")
    assert browser.errors == []
    assert any("trace_viewer_index.js" in u for u in browser.requests)


# Stock dashboards over the same logdir: each fetches our data (the request named here) and renders offline.
DASHBOARD_DATA = {"custom_scalars": "/data/plugin/custom_scalars/scalars?",
                  "images": "/data/plugin/images/individualImage?",
                  "text": "/data/plugin/text/text?", "hparams": "/data/plugin/hparams/session_groups"}


def test_stock_dashboards_render_our_views_offline(server, browser, tmp_path):
    for dashboard, route in DASHBOARD_DATA.items():
        browser.call("Page.navigate", session=True, url=f"http://127.0.0.1:{server}/#{dashboard}")
        browser.wait_for(f"performance.getEntriesByType('resource').some(e => e.name.includes({route!r}))",
                         what=f"the {dashboard} dashboard's data")
        browser.screenshot(tmp_path / f"{dashboard}.png")
    assert browser.errors == []


def test_viewer_absent_shows_the_install_notice(logdir, tmp_path, browser):
    # A TensorBoard whose "xprof" is an empty package shadowing the real one (no viewer files): the plugin
    # says the viewer is missing and offers the traces for download. xprof's own plugin is not loaded.
    hidden = tmp_path / "no_xprof"
    (hidden / "xprof").mkdir(parents=True)
    (hidden / "xprof" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH", "")) if p)
    with tensorboard(logdir / "logs", entry_points=False, env={"PYTHONPATH": path}) as port:
        assert json.loads(_get(port, f"{PREFIX}/runs")[2])["viewer"]["available"] is False
        assert _get(port, f"{PREFIX}/viewer/trace_viewer_index.html")[0] == 404
        _open_plugin(browser, port)
        browser.evaluate(f"{PLUGIN_DOC}.querySelector('button[data-view=traces]').click()")
        browser.wait_for(f"{PLUGIN_DOC}.body.dataset.ready === 'traces'", what="the traces view")
        notice = browser.evaluate(f"{PLUGIN_DOC}.querySelector('[data-role=viewer-missing]').textContent")
        links = browser.evaluate(f"[...{PLUGIN_DOC}.querySelectorAll('a.download')].length")
        browser.screenshot(tmp_path / "viewer_missing.png")
    assert INSTALL_HINT in notice and links == 3
    assert browser.errors == []
