"""Post-hoc reports: every section present, every number in the HTML / markdown equal to the analysis frames,
self-contained HTML that headless Chromium renders with no request leaving the machine."""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
import threading
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, breakdown
from shardline.profiling.matching.collectives import match_collectives, wait_transfer
from shardline.profiling.present.cli import main
from shardline.profiling.present.report_html import render_html
from shardline.profiling.present.report_sections import Section, report_sections
from shardline.profiling.table.load import load

MS = Decimal(1_000_000)


def ns(text: str) -> int:
    value = Decimal(text) * MS
    assert value == value.to_integral_value(), text  # ms shown exactly, to the ns
    return int(value)


def check_breakdown_table(shown: pd.DataFrame, bd: pd.DataFrame) -> None:
    """Every number of the shown breakdown table equals the breakdown frame's, and every non-zero column is shown."""
    assert shown["rank"].astype(int).tolist() == bd["rank"].tolist()
    assert shown["step"].astype(int).tolist() == bd["step"].tolist()
    assert [ns(v) for v in shown["step_ms"]] == bd["step_ns"].tolist()
    assert [ns(v) for v in shown["comm_ms"]] == bd["comm_ns"].tolist()
    for column in EXCLUSIVE_COLUMNS:
        if f"{column}_ms" in shown:
            assert [ns(v) for v in shown[f"{column}_ms"]] == bd[column].tolist(), column
        else:
            assert (bd[column] == 0).all(), column
    ratio = [float(v) if v else np.nan for v in shown["overlap_%"]]
    np.testing.assert_allclose(ratio, 100 * bd["overlap_ratio"], atol=0.005)


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory, synth):
    """Two ZeRO/TP/offload ranks and a 3-stage 1F1B pipeline in one job: ranks 0-1 offload, 2-4 pipeline."""
    rows, _ = synth.one_f_one_b(3, 4, f=100, b=200, t0=1_000_000)
    folder = tmp_path_factory.mktemp("report") / "run"
    synth.write_kineto(rows, folder)
    return folder


def test_html_sections_and_numbers_match_the_frames(synth_run, tmp_path, pages):
    out = tmp_path / "report.html"
    assert main(["profile", "report", str(synth_run), "-o", str(out)]) == 0  # format from the suffix
    doc = pages.parse_html(out.read_text())
    assert doc.sections == [s.value for s in Section]
    ts = load(synth_run)
    bd = breakdown(ts)
    check_breakdown_table(pages.frame(doc.tables["breakdown-table"]), bd)
    bubbles = pages.frame(doc.tables["bubbles-table"])
    # 1F1B with equal costs: bubble (p-1)(f+b) of a makespan (m+p-1)(f+b) on every stage; ideal (p-1)/(m+p-1)
    assert [ns(v) for v in bubbles["bubble_ms"]] == [2 * 300] * 3
    assert [ns(v) for v in bubbles["batch_ms"]] == [6 * 300] * 3
    assert bubbles["ideal_%"].tolist() == [f"{100 * 2 / 6:.2f}"] * 3 == bubbles["bubble_%"].tolist()
    assert [ns(v) for v in bubbles["bubble_ms"]] == bd["bubble"].tolist()  # the same time the breakdown gives


def test_html_is_self_contained(synth_run, tmp_path, pages):
    ts = load(synth_run)
    text = render_html(report_sections(ts), events=ts.events)
    doc = pages.parse_html(text)
    assert "script" not in doc.tags and "link" not in doc.tags and "iframe" not in doc.tags
    assert doc.urls and all(u.startswith(("data:image/png;base64,", "#")) for u in doc.urls)
    assert sum(u.startswith("data:image/png") for u in doc.urls) == 3  # breakdown, comm by dim, pipeline
    assert "http://" not in text and "https://" not in text and "url(" not in text


def test_markdown_has_the_same_tables(synth_run, capsys, pages):
    assert main(["profile", "report", str(synth_run), "--format", "md"]) == 0
    text = capsys.readouterr().out
    ts = load(synth_run)
    html_doc = pages.parse_html(render_html(report_sections(ts), events=ts.events))
    md_tables = pages.md_tables(text)
    assert md_tables == list(html_doc.tables.values())
    from shardline.profiling.present.report_sections import TITLES

    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == [TITLES[s] for s in Section]
    position = list(html_doc.tables).index("breakdown-table")  # the findings table may come first
    check_breakdown_table(pages.frame(md_tables[position]), breakdown(ts))


def test_dlrm_report_matches_the_breakdown(dlrm_report, pages):
    ts, sec = dlrm_report
    _check_corpus_report(ts, sec, pages)


@pytest.mark.parametrize(("corpus_path", "rank"), [
    ("tracelens/b200/eager_trace.json.gz", None), ("hta/trace_filter", None), ("hta/cpu_only", None),
    ("hta/amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz", 0), ("hta/nccl_parser_config", None),
    ("nsys_ai/tests/fixtures/h100_2gpu_1s.sqlite", None)])
def test_corpus_reports_match_the_breakdown(traces_dir, corpus_path, rank, pages):
    ts = load(traces_dir / corpus_path, rank=rank)
    _check_corpus_report(ts, report_sections(ts), pages)


def _check_corpus_report(ts, sec, pages) -> None:
    doc = pages.parse_html(render_html(sec, events=ts.events))
    assert doc.sections == [s.value for s in Section]
    bd = breakdown(ts)
    pd.testing.assert_frame_equal(sec.breakdown, bd)
    check_breakdown_table(pages.frame(doc.tables["breakdown-table"]), bd)
    if len(sec.comm_by_dim):
        shown = pages.frame(doc.tables["comm-by-dim-table"])
        for column in ("comm", "exposed", "overlapped"):
            assert [ns(v) for v in shown[f"{column}_ms"]] == sec.comm_by_dim[f"{column}_ns"].tolist()
    if len(sec.top_kernels):
        shown = pages.frame(doc.tables["top-kernels-table"])
        assert shown["name"].tolist() == sec.top_kernels["name"].tolist()
        assert [ns(v) for v in shown["total_ms"]] == sec.top_kernels["total_ns"].tolist()
    if len(sec.wait_transfer):
        shown = pages.frame(doc.tables["wait-transfer-table"])
        assert [ns(v) for v in shown["wait_ms"]] == sec.wait_transfer["wait_ns"].astype(np.int64).tolist()
        assert [ns(v) for v in shown["transfer_ms"]] == sec.wait_transfer["transfer_ns"].astype(np.int64).tolist()


def test_collective_section_is_match_collectives(dlrm_report, pages):
    ts, sec = dlrm_report
    pd.testing.assert_frame_equal(sec.wait_transfer, wait_transfer(match_collectives(ts)))
    doc = pages.parse_html(render_html(sec, events=ts.events))
    straggler = pages.frame(doc.tables["stragglers-table"])
    assert straggler["straggler_rank"].astype(int).tolist() == sec.stragglers["straggler_rank"].tolist()
    assert [ns(v) for v in straggler["caused_wait_ms"]] == sec.stragglers["caused_wait_ns"].astype(np.int64).tolist()


def test_offload_traffic_against_the_events(dlrm_report, pages):
    ts, sec = dlrm_report
    ev = ts.events
    h2d = ev[(ev["category"] == "memcpy_h2d") & (ev["lane"] == "gpu") & (ev["rank"] == 0)]
    row = sec.offload[(sec.offload["rank"] == 0) & (sec.offload["direction"] == "H2D")].iloc[0]
    assert row["copies"] == len(h2d) and row["bytes"] == h2d["msg_bytes"].sum() > 0
    assert row["achieved_gbps"] == pytest.approx(h2d["msg_bytes"].sum() / h2d["dur_ns"].sum(), rel=1e-12)
    assert row["link_gbps"] == 15.75  # Tesla V100-SXM2: PCIe Gen3 x16 to the host
    assert row["of_limit"] == pytest.approx(row["achieved_gbps"] / row["link_gbps"], rel=1e-12)
    assert row["pageable_copies"] == (h2d["memory_kind"] == "Pageable").sum() > 0
    assert row["exposed_ns"] == sec.breakdown.query("rank == 0")["memcpy_h2d"].sum()
    assert "pageable" in sec.notes[Section.OFFLOAD]  # flagged
    shown = pages.frame(pages.parse_html(render_html(sec)).tables["offload-table"])
    assert shown["bytes"].astype(int).tolist() == sec.offload["bytes"].tolist()
    np.testing.assert_allclose(shown["achieved_GB/s"].astype(float), sec.offload["achieved_gbps"], atol=5e-4)


def test_top_kernels_rank_names_by_total_time(traces_dir):
    ts = load(traces_dir / "tracelens" / "b200" / "eager_trace.json.gz")
    kernels = report_sections(ts, top=3).top_kernels
    assert kernels.groupby("category").size().max() <= 3
    compute = ts.events[(ts.events["category"] == "compute") & (ts.events["cat"] == "kernel")]
    want = compute.groupby(compute["name"].astype(str))["dur_ns"].sum().sort_values(ascending=False).head(3)
    got = kernels[kernels["category"] == "compute"]
    assert got["total_ns"].tolist() == want.tolist()


def test_parquet_is_the_breakdown(synth_run, tmp_path):
    out = tmp_path / "b.parquet"
    assert main(["profile", "report", str(synth_run), "-o", str(out)]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out), breakdown(load(synth_run)))


def test_parquet_without_output_is_one_error_line(synth_run, capsys):
    assert main(["profile", "report", str(synth_run), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "needs -o" in err and len(err.splitlines()) == 1


def test_tensorboard_format_writes_event_files(synth_run, tmp_path):
    logdir = tmp_path / "tb"
    assert main(["profile", "report", str(synth_run), "--format", "tensorboard", "-o", str(logdir)]) == 0
    assert list(logdir.rglob("events.out.tfevents.*"))


def test_progress_bar_only_when_asked(synth_run, tmp_path, capsys):
    assert main(["profile", "report", str(synth_run), "-o", str(tmp_path / "a.md")]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest
    assert main(["profile", "report", str(synth_run), "-o", str(tmp_path / "b.md"), "--progress"]) == 0
    assert "stage" in capsys.readouterr().err
    assert (tmp_path / "a.md").read_text() == (tmp_path / "b.md").read_text()


# --- headless Chromium ----------------------------------------------------------------------------------------

def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")


#: Hosts Chromium itself calls at start-up (time sync, component updates, accounts) whatever the page: measured
#: here with about:blank. A page's own request goes elsewhere (the control test below proves it is caught).
_BROWSER_OWN_HOSTS = ("clients2.google.com", "update.googleapis.com", "accounts.google.com", "redirector.gvt1.com")


class _TrapProxy:
    """A loopback 'proxy' that records each request line and answers nothing: with it as the browser's proxy for
    every host, any request that would leave the machine arrives here instead."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.requests: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(1)
            try:
                self.requests.append(conn.recv(512).split(b"\r\n")[0].decode("latin-1"))
            except OSError as exc:
                self.requests.append(f"unreadable request ({exc})")
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()

    def foreign_hosts(self) -> set[str]:
        hosts = set()
        for line in self.requests:
            target = line.split(" ")[1] if " " in line else line
            host = target.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
            if host not in _BROWSER_OWN_HOSTS:
                hosts.add(host)
        return hosts


def _browse(page: Path, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess, _TrapProxy]:
    """Open ``page`` in headless Chromium (fresh profile) behind the trap proxy; returns the run and the trap."""
    proxy = _TrapProxy()
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--no-first-run", "--disable-extensions", f"--user-data-dir={tmp / ('profile' + str(len(extra)))}",
               f"--proxy-server=http://127.0.0.1:{proxy.sock.getsockname()[1]}", "--proxy-bypass-list=<-loopback>",
               *extra, page.as_uri()]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    finally:
        proxy.close()
    return run, proxy


def test_the_request_trap_catches_a_page_request(tmp_path):
    page = tmp_path / "control.html"
    page.write_text('<!DOCTYPE html><html><body><img src="http://cdn.example.invalid/x.png"></body></html>')
    _, proxy = _browse(page, tmp_path, "--dump-dom")
    assert "cdn.example.invalid" in proxy.foreign_hosts()


def test_html_renders_in_headless_chromium_without_requests(synth_run, tmp_path, pages):
    out = tmp_path / "report.html"
    assert main(["profile", "report", str(synth_run), "--format", "html", "-o", str(out)]) == 0
    dom, proxy = _browse(out, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert proxy.foreign_hosts() == set(), proxy.requests
    rendered = pages.parse_html(dom.stdout)
    assert rendered.sections == [s.value for s in Section]
    check_breakdown_table(pages.frame(rendered.tables["breakdown-table"]), breakdown(load(synth_run)))
    shot = tmp_path / "report.png"
    _browse(out, tmp_path, f"--screenshot={shot}", "--window-size=1200,2400")
    import matplotlib.image as mpimg

    pixels = mpimg.imread(io.BytesIO(shot.read_bytes()), format="png")
    assert pixels.shape[:2] == (2400, 1200) and pixels[..., :3].std() > 0.05  # not a blank page
