"""shardline's TensorBoard plugin: the step-time breakdown view and a trace viewer, offline.

Registered through the ``tensorboard_plugins`` entry point (``shardline = shardline.profiling.present.tb_plugin:
ShardlineLoader``). It reads what ``write_tensorboard`` wrote: every ``<run>/plugins/shardline/manifest.json``
under TensorBoard's ``--logdir`` lists the run's profiled windows (``window_<s>.json``) and the traces of each.

Routes, under ``/data/plugin/shardline``:

=====================  ===============================================================================
``/index.js``          the frontend (an ES module; TensorBoard calls its ``render()`` in the plugin iframe)
``/static/<name>``     the other frontend assets (files of ``tb_static/``, listed once at start)
``/runs``              JSON: runs -> windows -> traces (labels and kinds) and whether the viewer is installed
``/window``            ``?run=&window=``: the window's JSON (breakdown, comm by dim, wait/transfer, bubbles)
``/trace``             ``?run=&window=&index=``: one listed trace (gzip files sent with Content-Encoding)
``/viewer/<name>``     the trace viewer of the ``xprof`` package (``trace_viewer_index.html`` and ``.js``),
                       when it is installed; 404 otherwise
=====================  ===============================================================================

Serving rule: a request names files only by keys of listings the plugin built itself (asset names, run /
window / index). No part of a request is ever joined to a filesystem path, and every listed trace must resolve
to a regular file inside its run folder (so a manifest cannot point outside the log directory either).
Everything is served from this process; the pages' Content-Security-Policy allows only this origin.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from tensorboard.plugins import base_plugin
from werkzeug import wrappers
from werkzeug.wsgi import wrap_file

PLUGIN_NAME = "shardline"
MANIFEST = "manifest.json"
STATIC_DIR = Path(__file__).with_name("tb_static")
#: The files of xprof's viewer that a non-streaming Chrome-trace view needs.
VIEWER_FILES = ("trace_viewer_index.html", "trace_viewer_index.js")
INSTALL_HINT = "pip install shardline[tensorboard]"
#: Same-origin only: scripts, styles, frames, fetches and images never leave this server.
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; frame-src 'self'; "
       "object-src 'none'; base-uri 'self'")

log = logging.getLogger(__name__)


class TraceKind(str, enum.Enum):
    MERGED = "merged"
    RAW = "raw"


_MIME = {".js": "application/javascript", ".css": "text/css", ".html": "text/html", ".json": "application/json",
         ".svg": "image/svg+xml", ".png": "image/png"}


def _listed(folder: Path, names=None) -> dict[str, Path]:
    """Regular files directly in ``folder`` (only ``names`` when given), by name; no links, no subfolders."""
    if not folder.is_dir():
        return {}
    files = {p.name: p for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    return files if names is None else {n: files[n] for n in names if n in files}


def viewer_dir() -> Path | None:
    """xprof's ``static`` folder when the package is installed (found without importing it), else None."""
    try:
        spec = importlib.util.find_spec("xprof")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if all((folder / name).is_file() for name in VIEWER_FILES) else None


def viewer_version() -> str | None:
    try:
        return importlib.metadata.version("xprof")
    except importlib.metadata.PackageNotFoundError:
        return None


def _respond(body, content_type: str, *, code: int = 200, encoding: str | None = None,
             length: int | None = None):
    """A response with our headers; ``body`` is bytes/str, or a WSGI file wrapper streamed as it is read."""
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache, must-revalidate"}
    if encoding:
        headers["Content-Encoding"] = encoding
    if length is not None:
        headers["Content-Length"] = str(length)
    if content_type.startswith("text/") or content_type.endswith(("javascript", "json")):
        content_type += "; charset=utf-8"
    return wrappers.Response(body, status=code, content_type=content_type, headers=headers,
                             direct_passthrough=length is not None)


def _not_found(what: str):
    return _respond(json.dumps({"error": f"not found: {what}"}), "application/json", code=404)


def _bad_request(message: str):
    return _respond(json.dumps({"error": message}), "application/json", code=400)


def _expect(value, kind: type, what: str):
    """``value`` when it is a ``kind``; else a ``TypeError`` naming what it is."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} is {_JSON_NAMES.get(type(value), type(value).__name__)}, not {_JSON_NAMES[kind]}")
    return value


_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


def _manifest_problem(exc: BaseException) -> str:
    """One line on why a manifest was not read."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deep to decode"
    if isinstance(exc, KeyError):
        return f"no {exc} key"
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc})"
    return str(exc) if isinstance(exc, TypeError) else f"{type(exc).__name__}: {exc}"


class ShardlinePlugin(base_plugin.TBPlugin):
    """The plugin object TensorBoard holds (one per server)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._logdir = Path(context.logdir).resolve() if context.logdir else None
        self._static = _listed(STATIC_DIR)
        if "index.js" not in self._static:  # a wheel built without the package data: say so, do not crash TB
            log.error("shardline TensorBoard plugin: its frontend files are missing from %s; reinstall shardline "
                      "(the wheel must include shardline/profiling/present/tb_static/*)", STATIC_DIR)
        viewer = viewer_dir()
        self._viewer = _listed(viewer, VIEWER_FILES) if viewer else {}
        self._warned: set = set()  # (manifest, mtime) already warned about

    # --- TensorBoard's interface ---------------------------------------------------------------------------------

    def get_plugin_apps(self):
        return {"/index.js": self._serve_index, "/static/*": self._serve_static, "/runs": self._serve_runs,
                "/window": self._serve_window, "/trace": self._serve_trace, "/viewer/*": self._serve_viewer}

    def is_active(self) -> bool:
        return bool(self._manifests())

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Shardline", disable_reload=True)

    # --- the listing ------------------------------------------------------------------------------------------

    def _manifests(self) -> dict[str, Path]:
        """Run name (relative to the logdir, "." for the logdir itself) -> its plugin folder."""
        if self._logdir is None or not self._logdir.is_dir():
            return {}
        out = {}
        for manifest in sorted(self._logdir.rglob(MANIFEST)):
            folder = manifest.parent
            if folder.name != PLUGIN_NAME or folder.parent.name != "plugins" or manifest.is_symlink():
                continue
            run = folder.parent.parent
            out[run.relative_to(self._logdir).as_posix()] = folder
        return out

    def listing(self) -> dict[str, dict]:
        """run -> window name -> {"data": Path, "first_step": int, "traces": [(label, kind, Path)]}, keeping
        only entries that resolve to regular files inside their run folder. A run whose manifest cannot be
        read or is not the shape ``write_tensorboard`` writes is left out, with a warning logged (once per
        version of the file): the other runs are served."""
        runs: dict[str, dict] = {}
        for run, folder in self._manifests().items():
            try:
                runs[run] = self._run_entries(folder)
            except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                self._warn_once(folder / MANIFEST, _manifest_problem(exc))
        return runs

    def _run_entries(self, folder: Path) -> dict[str, dict]:
        """The windows one manifest lists (see ``listing``); raises where the manifest is malformed."""
        run_dir = folder.parent.parent.resolve()
        manifest = _expect(json.loads((folder / MANIFEST).read_text()), dict, "the manifest")
        windows = _expect(manifest["windows"], list, "windows")
        entries = {}
        for window in windows:
            _expect(window, dict, "a window")
            data = self._inside(run_dir, Path("plugins", PLUGIN_NAME, str(window.get("data", ""))))
            if data is None:
                continue
            traces = []
            for trace in _expect(window.get("traces", []), list, "a window's traces"):
                _expect(trace, dict, "a trace")
                path = self._inside(run_dir, Path(str(trace.get("path", ""))))
                if path is not None:
                    traces.append((str(trace.get("label", path.name)), str(trace.get("kind", "raw")), path))
            first_step = window.get("first_step")
            if first_step is not None:
                _expect(first_step, int, "a window's first_step")
            entries[str(window.get("name"))] = {"data": data, "first_step": first_step, "traces": traces}
        return entries

    def _warn_once(self, manifest: Path, problem: str) -> None:
        try:
            version = manifest.stat().st_mtime_ns
        except OSError:
            version = None
        if (manifest, version) not in self._warned:
            self._warned.add((manifest, version))
            log.warning("shardline plugin: skipping the run of %s: %s", manifest, problem)

    @staticmethod
    def _inside(run_dir: Path, relative: Path) -> Path | None:
        if relative.is_absolute():
            return None
        try:
            path = (run_dir / relative).resolve()
            if not path.is_relative_to(run_dir) or not path.is_file():
                return None
        except (OSError, ValueError):  # a NUL in the name, a loop of links: nothing to serve
            return None
        return path

    # --- routes -----------------------------------------------------------------------------------------------

    @wrappers.Request.application
    def _serve_index(self, request):
        return self._asset(self._static, "index.js")

    @wrappers.Request.application
    def _serve_static(self, request):
        return self._asset(self._static, request.path.rsplit("/static/", 1)[-1])

    @wrappers.Request.application
    def _serve_viewer(self, request):
        return self._asset(self._viewer, request.path.rsplit("/viewer/", 1)[-1])

    def _asset(self, files: dict[str, Path], name: str):
        path = files.get(name)
        if path is None:
            return _not_found(name)
        return _respond(path.read_bytes(), _MIME.get(path.suffix, "application/octet-stream"))

    @wrappers.Request.application
    def _serve_runs(self, request):
        body = {"viewer": {"available": bool(self._viewer), "version": viewer_version() if self._viewer else None,
                           "install": INSTALL_HINT},
                "runs": {run: [{"name": name, "first_step": w["first_step"],
                                "traces": [{"index": i, "label": label, "kind": kind, "file": path.name}
                                           for i, (label, kind, path) in enumerate(w["traces"])]}
                               for name, w in windows.items()]
                         for run, windows in self.listing().items()}}
        return _respond(json.dumps(body), "application/json")

    def _window(self, request):
        run, name = request.args.get("run", ""), request.args.get("window", "")
        return self.listing().get(run, {}).get(name), f"run={run!r} window={name!r}"

    @wrappers.Request.application
    def _serve_window(self, request):
        window, what = self._window(request)
        try:
            return _respond(window["data"].read_bytes(), "application/json") if window else _not_found(what)
        except OSError:  # gone since it was listed
            return _not_found(what)

    @wrappers.Request.application
    def _serve_trace(self, request):
        index = request.args.get("index", "")
        # ASCII digits only: str.isdigit() also takes "²" or "٣", which int() refuses or reads differently.
        if not (index.isascii() and index.isdigit()):
            return _bad_request(f"index={index!r}: expected a trace's index, a whole number in ASCII digits")
        window, what = self._window(request)
        if window is None or int(index) >= len(window["traces"]):
            return _not_found(f"{what} index={index!r}")
        _, _, path = window["traces"][int(index)]
        # Streamed: a trace can be hundreds of MB. A gzip file goes out as is; the browser inflates it.
        try:
            handle = path.open("rb")
        except OSError:  # gone since it was listed
            return _not_found(f"{what} index={index!r}")
        return _respond(wrap_file(request.environ, handle), "application/json", length=path.stat().st_size,
                        encoding="gzip" if path.suffix == ".gz" else None)


class ShardlineLoader(base_plugin.TBLoader):
    """The ``tensorboard_plugins`` entry point."""

    def load(self, context: base_plugin.TBContext) -> ShardlinePlugin:
        return ShardlinePlugin(context)
