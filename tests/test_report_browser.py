"""The HTML report in a real browser: headless Chromium (Debian's
``chromium-headless-shell``, which .ci/run installs) opens the report with
the network cut off, and the test fails on any JavaScript error, on any
resource fetched from outside the file, or on a plot without data.

How: a probe script is put first in the page's <head>; it records uncaught
errors, unhandled rejections and console.error calls, and after load writes
what each plot div holds (points per trace, SVG marks drawn) and the
resources the page fetched into a <pre>, which ``--dump-dom`` prints.
Skipped, with the reason, where no Chromium is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")
BROWSER = next((b for b in BROWSERS if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason="no headless Chromium on PATH (apt-get install chromium-headless-shell; "
                            ".ci/run installs it)")

PROBE = """<script>window.__errors=[];
window.addEventListener("error",function(e){__errors.push(String(e.message))});
window.addEventListener("unhandledrejection",function(e){__errors.push("unhandled rejection: "+e.reason)});
(function(){var ce=console.error;console.error=function(){
  __errors.push(Array.prototype.join.call(arguments," "));ce.apply(console,arguments)}})();
window.addEventListener("load",function(){setTimeout(function(){
  var out={errors:__errors,plots:{},resources:performance.getEntriesByType("resource").map(function(r){return r.name})};
  document.querySelectorAll(".plotly-graph-div").forEach(function(d){out.plots[d.id]={
    points:(d.data||[]).map(function(t){return [t.name,(t.x||[]).length]}),
    marks:d.querySelectorAll("g.trace path, g.trace .point").length}});
  var p=document.createElement("pre");p.id="__probe";p.textContent=JSON.stringify(out);
  document.body.appendChild(p)},300)})</script>"""


def open_in_browser(page: Path, tmp_path: Path) -> dict:
    """Load ``page`` with the probe in headless Chromium (network cut off) and
    return what the probe saw."""
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", "--dump-dom",
           probed.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="__probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the probe did not report (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))


def test_probe_catches_a_script_error(tmp_path) -> None:
    """The probe itself: a page whose script throws reports the error (so the
    report test can fail)."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><head></head><body><script>throw new Error('boom')</script>"
                    "</body></html>")
    seen = open_in_browser(page, tmp_path)
    assert seen["errors"] == ["Uncaught Error: boom"] and seen["plots"] == {}


def test_report_renders_in_chromium_without_errors(tmp_path) -> None:
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", str(ROOT / "golden" / "preemption-heavy.parquet"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    seen = open_in_browser(out, tmp_path)
    assert seen["errors"] == []
    assert [u for u in seen["resources"] if not u.startswith(("file:", "data:", "blob:"))] == []
    assert sorted(seen["plots"]) == ["gantt", "timeline"]
    timeline = seen["plots"]["timeline"]
    assert [n for n, points in timeline["points"]] [:3] == ["free blocks", "held blocks", "cached free blocks"]
    assert all(points == 230 for _, points in timeline["points"])  # every series, every step
    assert timeline["marks"] > 0
    gantt = dict(seen["plots"]["gantt"]["points"])
    assert gantt["running"] > 0 and gantt["waiting"] > 0 and gantt["preempted"] == 18
    assert gantt["loading"] == 0  # no KV connector in this scenario
    assert seen["plots"]["gantt"]["marks"] > 0
