"""``fsmtrain report`` pages in real headless Chromium (Debian's ``chromium``), driven over its DevTools
protocol: the page loads with no console error and no network request, every plot is in the DOM
and drawn, and a screenshot of each plot is not blank.

Without Chromium (``./setup.sh`` installs it) the tests skip naming it, or fail under
``FSMTRAIN_REQUIRE_SYSTEM=1`` (CI): tests/system_parts.py."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import optuna
import pytest
import system_parts
from PIL import Image, ImageStat

from fsmtrain.tools.report import render_report
from fsmtrain.tools.report.run import RUN_PLOTS
from fsmtrain.tools.report.study import STUDY_PLOTS

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = system_parts.find_chromium()
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1100,900")


# --- a small DevTools-protocol client -------------------------------------------------------------
class Browser:
    """One headless Chromium with a fresh profile, and a websocket to its one page."""

    def __init__(self, profile: Path) -> None:
        import websocket

        assert CHROMIUM is not None
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)  # its helpers share the group: close() ends them all
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.close()
                raise RuntimeError(f"chromium did not open its DevTools port: {err[-2000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
            pages = [t for t in json.load(resp) if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg["result"]
                return result
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            assert time.monotonic() < deadline, f"no {method} within {timeout} s"
            self.events.append(json.loads(self.ws.recv()))

    def evaluate(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in out, out
        return out["result"]["value"]

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        # Chromium's helper processes outlive a terminated browser for a moment and keep writing into
        # the profile, whose removal then fails ("Directory not empty"): end the whole group.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # helpers still alive after the browser itself exited


@pytest.fixture
def browser() -> Iterator[Browser]:
    system_parts.require(system_parts.CHROMIUM)
    with tempfile.TemporaryDirectory(prefix="fsmtrain-chromium-") as profile:
        b = Browser(Path(profile))
        try:
            yield b
        finally:
            b.close()


class _Ids(HTMLParser):
    """Element ids in a serialized DOM, with the tags found inside each plot figure."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, list[str]] = {}
        self._stack: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        ident = dict(attrs).get("id")
        if tag in ("figure", "section") and ident:
            self.ids[ident] = []
            self._stack.append(ident)
        elif tag in ("figure", "section"):
            self._stack.append(None)
        for open_id in self._stack:
            if open_id:
                self.ids[open_id].append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("figure", "section") and self._stack:
            self._stack.pop()


def load(browser: Browser, page: Path) -> dict[str, Any]:
    """Open ``page``; return the console problems, the requests, the DOM and a full screenshot."""
    for domain in ("Page", "Runtime", "Log", "Network"):
        browser.call(f"{domain}.enable")
    browser.events.clear()
    url = page.resolve().as_uri()
    browser.call("Page.navigate", url=url)
    browser.wait_for("Page.loadEventFired")
    time.sleep(0.5)  # let late console messages and requests arrive
    browser.evaluate("1")  # drains the events queued so far into browser.events
    problems = [e for e in browser.events if e.get("method") in ("Runtime.exceptionThrown",)
                or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert",
                                                                                               "warning"))
                or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))]
    requests = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
    dom = browser.evaluate("document.documentElement.outerHTML")
    rects = browser.evaluate(
        "JSON.stringify([...document.querySelectorAll('figure.plot, section.panel')].map(e => {"
        "const r = e.getBoundingClientRect(); return [e.id, r.x, r.y + window.scrollY, r.width, r.height]; }))")
    size = browser.call("Page.getLayoutMetrics")["cssContentSize"]
    shot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                        clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("L")
    return {"url": url, "problems": problems, "requests": requests, "dom": dom, "rects": json.loads(rects),
            "image": image}


def check_page(result: dict[str, Any], plots: tuple[str, ...], out: Path) -> dict[str, list[str]]:
    assert result["problems"] == [], f"console errors or warnings: {result['problems']}"
    assert result["requests"] == [result["url"]], f"requests besides the page itself: {result['requests']}"
    parser = _Ids()
    parser.feed(result["dom"])
    missing = [p for p in plots if p not in parser.ids]
    assert not missing, f"plots missing from the DOM: {missing}"
    image: Image.Image = result["image"]
    image.save(out)  # kept for a person to look at when a check fails
    assert ImageStat.Stat(image).stddev[0] > 20, "the screenshot is blank"
    rects = {r[0]: r[1:] for r in result["rects"]}
    for plot in plots:
        x, y, w, h = rects[plot]
        assert w > 100 and h > 30, f"{plot} has no size: {w}x{h}"
        crop = image.crop((int(x), int(y), int(x + w), int(y + h)))
        dark = sum(crop.histogram()[:160])  # pixels of lines, bars, text: not background
        assert dark > 400, f"{plot} is blank in the screenshot ({dark} dark pixels)"
    return parser.ids


# --- the pages ------------------------------------------------------------------------------------
def _train(tmp: Path) -> Path:
    """A real digits run: a custom metric (val_accuracy), overfitting flagged, early stopping counted."""
    sets = ["net_config.dropout=0", "optimizer_config.lr=0.01", "epochs=25", "early_stopping.patience=4",
            "callbacks.overfit_detection.warmup_epochs=2", "callbacks.overfit_detection.window_size=1",
            "data_config.val_fraction=0.5"]
    cmd = [sys.executable, "-m", "fsmtrain", "train", str(REPO / "configs" / "digits.yaml")]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    return tmp / "runs" / "digits" / "mlp-digits-seed0"


def _study(tmp: Path, run_dir: Path) -> Path:
    """A real SQLite study with complete and pruned trials; two trials name a run directory."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp / "study.db"
    study = optuna.create_study(study_name="browser", storage=f"sqlite:///{db}",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2),
                                sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        width = trial.suggest_categorical("hidden", [32, 64, 128])
        trial.set_user_attr("run_dirs", [str(run_dir) if trial.number < 2 else str(tmp / f"gone-{trial.number}")])
        value = 1.0
        for step in range(8):
            value = (abs(lr - 0.01) * 20 + 64 / width) / (step + 1) + 0.05
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study.optimize(objective, n_trials=14)
    states = {t.state for t in study.trials}
    assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states
    return db


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_and_study_reports_in_chromium(tmp_path: Path, browser: Browser, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    run_dir = _train(tmp_path)
    db = _study(tmp_path, run_dir)
    study_page, made = render_report(str(db), study="browser")
    run_page = run_dir / "report.html"
    assert made == [run_page] and study_page == tmp_path / "browser-report.html"

    result = load(browser, run_page)
    ids = check_page(result, (*RUN_PLOTS, "plot-metric-val_accuracy"), tmp_path / "run.png")
    for plot in ("plot-loss", "plot-lr", "plot-grad-norm", "plot-overfit", "plot-early-stopping",
                 "plot-metric-val_accuracy"):
        assert "polyline" in ids[plot], f"{plot} has no line"
    assert "line" in ids["plot-grad-norm"] and "line" in ids["plot-early-stopping"]  # threshold and patience
    assert "rect" in ids["plot-overfit"]  # the flagged epochs, shaded
    assert ids["plot-phase-time"].count("rect") >= 4 and ids["plot-callback-time"].count("rect") >= 8
    assert "svg" in ids["diagram-lifecycle"] and "table" in ids["checkpoints"]
    dom = result["dom"]
    assert "predicted final val loss" in dom and "warning threshold 10000" in dom and "patience 4" in dom
    assert "Audit: <span class=\"ok\">OK" in dom

    result = load(browser, study_page)
    ids = check_page(result, STUDY_PLOTS, tmp_path / "study.png")
    assert ids["plot-parallel"].count("polyline") >= 2 and ids["plot-importances"].count("rect") == 2
    assert "polyline" in ids["plot-intermediate"] and "circle" in ids["plot-history"]
    run_link = os.path.relpath(run_page, tmp_path)
    assert dom.count("<tr>") and f'href="{run_link}"' in result["dom"]
    assert "gone-5 (not found)" in result["dom"]
    sizes = {p.name: p.stat().st_size for p in (run_page, study_page)}
    with capsys.disabled():
        print(f"\nreport sizes: {sizes}")


@pytest.mark.timeout(120)
def test_the_checks_catch_a_request_an_error_and_a_blank_page(tmp_path: Path, browser: Browser) -> None:
    """Negative control: the same checks fail on a page that fetches, logs an error, or is empty."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><figure class="plot" id="plot-loss"><img src="http://127.0.0.1:9/x.png">'
                   "</figure><script>console.error('boom')</script></body></html>", encoding="utf-8")
    result = load(browser, bad)
    assert any("boom" in json.dumps(p) for p in result["problems"])
    assert "http://127.0.0.1:9/x.png" in result["requests"]
    with pytest.raises(AssertionError, match="console errors"):
        check_page(result, ("plot-loss",), tmp_path / "bad.png")
    blank = tmp_path / "blank.html"
    blank.write_text('<!DOCTYPE html><html><body><figure class="plot" id="plot-loss" style="width:600px;height:200px">'
                     "</figure></body></html>", encoding="utf-8")
    result = load(browser, blank)
    assert result["problems"] == [] and result["requests"] == [result["url"]]
    with pytest.raises(AssertionError, match="blank"):
        check_page(result, ("plot-loss",), tmp_path / "blank.png")
    with pytest.raises(AssertionError, match="missing from the DOM"):
        check_page(result, ("plot-lr",), tmp_path / "blank.png")
