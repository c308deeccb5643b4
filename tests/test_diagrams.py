"""``fsmtrain.tools.diagrams.cli``: the committed lifecycle diagrams are fresh and complete, callbacks appear
in the runner's real order, and a real run's path is drawn with its counts and stop edge."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from audit_runs import REPO, RealRuns, read_lines
from system_parts import GRAPHVIZ, MERMAID, require

from fsmtrain.callbacks import (
    CheckpointCallback,
    EarlyStoppingCallback,
    GradientMonitorCallback,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
    WandbLoggingCallback,
)
from fsmtrain.cli import main as cli_main
from fsmtrain.core.context import EpochContext, FaultContext
from fsmtrain.core.drawing import (
    Format,
    GraphvizMissing,
    callback_diagram,
    dot_digest,
    lifecycle_diagram,
    render_svg,
    run_diagram,
    svg_recorded_digest,
    write_run_diagram,
)
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.lifecycle import FINAL, TRANSITIONS, Phase

DIAGRAMS = REPO / "diagrams"
REGENERATE = "fsmtrain diagram --write diagrams"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "fsmtrain", "diagram", *args], capture_output=True, text=True,
                          cwd=REPO, env=full, timeout=120, check=False)


# --- Mermaid structure ------------------------------------------------------------------------------
_STATE = re.compile(r'^state "(?P<label>[^"]*)" as (?P<name>\w+)$')
_EDGE = re.compile(r"^(?P<src>\w+|\[\*\]) --> (?P<dst>\w+|\[\*\])(?:: (?P<label>[^:;#]+))?$")
_OTHER = re.compile(r"^(stateDiagram-v2|direction (LR|TB)|classDef s_\w+ .*|Class \w+ s_\w+|)$")


def parse_mermaid(text: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """A strict reader of the stateDiagram-v2 subset the diagrams use: every line must be a
    front-matter line, a state, an edge, a class line or blank, or this raises."""
    lines = text.splitlines()
    assert lines[0] == "---" and lines[1].startswith("title: ") and lines[2] == "---", "front matter with the title"
    assert lines[3] == "stateDiagram-v2"
    states: dict[str, str] = {}
    edges: list[tuple[str, str, str]] = []
    for raw in lines[3:]:
        line = raw.strip()
        if m := _STATE.match(line):
            states[m["name"]] = m["label"]
        elif m := _EDGE.match(line):
            edges.append((m["src"], m["dst"], m["label"] or ""))
        else:
            assert _OTHER.match(line), f"not stateDiagram-v2 syntax: {raw!r}"
    return states, edges


def _edge_label(edges: list[tuple[str, str, str]], src: str, dst: str) -> str:
    found = [label for s, d, label in edges if (s, d) == (src, dst)]
    assert len(found) == 1, f"one edge {src} -> {dst}, found {found}"
    return found[0]


def test_committed_diagrams_are_fresh() -> None:
    assert (DIAGRAMS / "lifecycle.mmd").read_text(encoding="utf-8") == lifecycle_diagram(Format.MERMAID), \
        f"diagrams/lifecycle.mmd is stale: run `{REGENERATE}`"
    dot = lifecycle_diagram(Format.DOT)
    assert (DIAGRAMS / "lifecycle.dot").read_text(encoding="utf-8") == dot, \
        f"diagrams/lifecycle.dot is stale: run `{REGENERATE}`"
    # The SVG's bytes depend on the local Graphviz; it records the sha256 of the DOT it was drawn from.
    assert svg_recorded_digest((DIAGRAMS / "lifecycle.svg").read_text(encoding="utf-8")) == dot_digest(dot), \
        f"diagrams/lifecycle.svg is stale: run `{REGENERATE}`"


def test_lifecycle_mermaid_has_every_phase_and_transition() -> None:
    states, edges = parse_mermaid((DIAGRAMS / "lifecycle.mmd").read_text(encoding="utf-8"))
    assert set(states) == {p.value for p in Phase}
    assert ("[*]", Phase.CREATED.value, "") in edges and (FINAL.value, "[*]", "") in edges
    for t in TRANSITIONS:
        label = _edge_label(edges, t.source.value, t.dest.value)
        parts = [p.strip() for p in label.split(" | ")]
        mine = [p for p in parts if p.split()[0] == t.trigger]
        assert len(mine) == 1, f"{t.trigger} on {t.source.value}->{t.dest.value}: {label}"
        for g in t.conditions:
            assert g.value in mine[0] and f"!{g.value}" not in mine[0]
        for g in t.unless:
            assert f"!{g.value}" in mine[0]
        if t.internal:
            assert "[internal]" in mine[0]


def test_edges_into_train_end_name_the_stop_reasons() -> None:
    _, edges = parse_mermaid(lifecycle_diagram(Format.MERMAID))
    label = _edge_label(edges, "epoch_end", "train_end")
    finish, abort = label.split(" | ")
    assert finish.replace("<br/>", " ").endswith("{completed, steps, nan, early_stop, pruned, target_reached}")
    assert "{interrupted, error}" in abort
    stop_now = _edge_label(edges, "val", "train_end").split(" | ")[0]
    assert stop_now.startswith("stop_now [immediate_stop]<br/>{") and "completed" not in stop_now


def test_dot_accepts_the_committed_dot_file(tmp_path: Path) -> None:
    dot = require(GRAPHVIZ)
    out = subprocess.run([dot, "-Tsvg", str(DIAGRAMS / "lifecycle.dot")], capture_output=True, text=True,
                         check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    for p in Phase:
        assert f"<title>{p.value}</title>" in out.stdout
    svg = render_svg(lifecycle_diagram(Format.DOT))
    assert svg_recorded_digest(svg) == dot_digest(lifecycle_diagram(Format.DOT)) and "<svg" in svg


# --- readable layout ------------------------------------------------------------------------------
MAX_SVG_PX = 2000  # fits a laptop screen at 100%
MAX_LABEL_LINE = 50  # characters on one label line


def svg_width_px(svg: str) -> float:
    """The root ``<svg width=...>`` in CSS pixels (Graphviz writes points: 1 pt = 4/3 px)."""
    m = re.search(r"<svg\b[^>]*?\swidth=\"([0-9.]+)(pt|px)?\"", svg)
    assert m, "an <svg> element with a width attribute"
    return float(m[1]) * (4 / 3 if m[2] == "pt" else 1)


def _dot_label_lines(dot: str) -> list[str]:
    return [line for label in re.findall(r'label="([^"]*)"', dot) for line in label.split("\\l") if line]


def test_committed_lifecycle_svg_fits_a_screen() -> None:
    width = svg_width_px((DIAGRAMS / "lifecycle.svg").read_text(encoding="utf-8"))
    assert width <= MAX_SVG_PX, f"diagrams/lifecycle.svg is {width:.0f} px wide"
    # The layout is not one long row: the DOT asks for top to bottom.
    assert "rankdir=TB" in (DIAGRAMS / "lifecycle.dot").read_text(encoding="utf-8")


def test_fresh_svgs_fit_a_screen(tmp_path: Path) -> None:
    require(GRAPHVIZ)
    assert svg_width_px(lifecycle_diagram(Format.SVG)) <= MAX_SVG_PX
    assert svg_width_px(callback_diagram(_nine(tmp_path), Format.SVG, include_global=False)) <= MAX_SVG_PX


def test_callback_view_of_the_nine_has_short_lines(tmp_path: Path) -> None:
    dot = callback_diagram(_nine(tmp_path), Format.DOT, include_global=False)
    lines = _dot_label_lines(dot)
    assert "- CheckpointCallback(95)" in lines and "on_epoch_end" in lines  # one callback per line
    too_long = [line for line in lines if len(line) > MAX_LABEL_LINE]
    assert not too_long, f"label lines longer than {MAX_LABEL_LINE} characters: {too_long}"
    # Each transition of a merged edge and its guards get lines of their own.
    assert "finish" in lines and "  [!can_continue]" in lines
    assert "{completed, steps, nan, early_stop," in lines and "pruned, target_reached}" in lines  # wrapped


def test_mermaid_front_matter_names_the_title(tmp_path: Path) -> None:
    assert lifecycle_diagram(Format.MERMAID).startswith("---\ntitle: fsmtrain lifecycle\n---\nstateDiagram-v2\n")
    assert callback_diagram([NaNDetectionCallback()], Format.MERMAID).startswith(
        "---\ntitle: fsmtrain lifecycle with callbacks\n---\n")
    events = tmp_path / "run" / "events.jsonl"
    events.parent.mkdir()
    events.write_text(json.dumps({"event": "transition", "from": "created", "to": "train_begin",
                                  "trigger": "begin", "global_step": 0}) + "\n", encoding="utf-8")
    # A title with a colon is quoted, so the front matter stays valid YAML.
    assert run_diagram(events).startswith('---\ntitle: "fsmtrain lifecycle: run run"\n---\n')


@pytest.mark.timeout(300)
def test_mermaid_itself_parses_the_diagrams_and_the_readme_block(tmp_path: Path) -> None:
    folder = require(MERMAID)  # tests/mermaid after `npm ci` there (./setup.sh runs it), and Node
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("```mermaid\n", 1)[1].split("```", 1)[0]
    nine = _nine(tmp_path)  # built, never started: nothing runs
    texts = {"README": block, "lifecycle": lifecycle_diagram(Format.MERMAID),
             "nine built-ins": callback_diagram(nine, Format.MERMAID)}
    files = []
    for i, text in enumerate(texts.values()):
        files.append(tmp_path / f"d{i}.mmd")
        files[-1].write_text(text, encoding="utf-8")
    broken = tmp_path / "broken.mmd"  # the check can fail: a diagram Mermaid rejects
    broken.write_text(texts["lifecycle"].rstrip("\n") + "\n  --- a line Mermaid rejects\n", encoding="utf-8")
    out = subprocess.run(["node", "check.mjs", *map(str, files), str(broken)], cwd=folder, capture_output=True,
                         text=True, timeout=180, check=False)
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": PARSE " in line)
    titles = {"README": "fsmtrain lifecycle", "lifecycle": "fsmtrain lifecycle",
              "nine built-ins": "fsmtrain lifecycle with callbacks"}
    for name, f in zip(texts, files, strict=True):
        assert lines.get(str(f)) == f"PARSE OK stateDiagram title={titles[name]}", name + ": " + out.stdout
    assert lines[str(broken)].startswith("PARSE FAILED") and out.returncode == 1, out.stdout + out.stderr


@pytest.mark.slow
def test_svg_without_graphviz_names_the_package() -> None:
    with pytest.raises(GraphvizMissing, match=r"apt-get install graphviz.*brew install graphviz"):
        render_svg("digraph {}", dot_program="no-such-dot-program")
    bindir = str(Path(sys.executable).parent)
    res = _cli("--format", "svg", env={"PATH": bindir})
    if shutil.which("dot", path=bindir) is None:
        assert res.returncode == 2 and "graphviz" in res.stderr and "brew" in res.stderr


# --- callbacks on hooks ---------------------------------------------------------------------------
def _nine(tmp: Path) -> list[TrainingCallback]:
    study = optuna.create_study(storage=f"sqlite:///{tmp / 'study.db'}")
    return [
        CheckpointCallback(tmp / "ckpt"), EarlyStoppingCallback(), PrunerCallback(study.ask()),
        WandbLoggingCallback(mode="offline", directory=tmp), OverfitDetectionCallback(),
        LossPredictionCallback(max_epochs=10), GradientMonitorCallback(), OptimizerModeCallback(),
        NaNDetectionCallback(),
    ]


def _hook_groups(lines: list[str]) -> dict[str, str]:
    """``[hook, "- A(5)", "- B(12)", hook2, ...]`` -> ``{hook: "A(5), B(12)", ...}``."""
    out: dict[str, list[str]] = {}
    hook = ""
    for line in lines:
        if line.startswith("- "):
            out[hook].append(line[2:])
        else:
            hook = line
            out[hook] = []
    return {k: ", ".join(v) for k, v in out.items()}


def _hook_lines(text: str) -> dict[str, str]:
    states, _ = parse_mermaid(text)
    out: dict[str, str] = {}
    for label in states.values():
        out.update(_hook_groups(label.split("<br/>")[1:]))
    return out


def test_config_view_lists_the_nine_in_priority_order(tmp_path: Path) -> None:
    hooks = _hook_lines(callback_diagram(_nine(tmp_path), Format.MERMAID, include_global=False))
    # The order DESIGN.md section 5 fixes for the built-ins.
    assert hooks["on_epoch_end"] == ("NaNDetectionCallback(5), GradientMonitorCallback(12), "
                                     "OverfitDetectionCallback(75), WandbLoggingCallback(80), CheckpointCallback(95)")
    assert hooks["on_val_end"] == ("LossPredictionCallback(70), PrunerCallback(85), EarlyStoppingCallback(90), "
                                   "CheckpointCallback(95)")  # a best at a validation inside an epoch
    assert hooks["on_val_begin"].startswith("OptimizerModeCallback(10)")
    assert hooks["on_train_epoch_begin"].startswith("OptimizerModeCallback(10)")


class _Global(TrainingCallback):
    priority = 50

    def on_epoch_end(self, epoch: EpochContext) -> None:
        return None

    def on_exception(self, fault: FaultContext) -> None:
        return None


class _LateGlobal(_Global):
    priority = 95


def test_global_callbacks_appear_in_their_place(tmp_path: Path) -> None:
    nine = _nine(tmp_path)
    with _Global(), _LateGlobal():
        text = callback_diagram(nine, Format.MERMAID)
    hooks = _hook_lines(text)
    assert hooks["on_epoch_end"] == (
        "NaNDetectionCallback(5), GradientMonitorCallback(12), _Global(50 global), OverfitDetectionCallback(75), "
        "WandbLoggingCallback(80), CheckpointCallback(95), _LateGlobal(95 global)")
    # A hook bound to a transition is listed on that transition's edges (on_exception on abort).
    _, edges = parse_mermaid(text)
    abort = _edge_label(edges, "val", "train_end")
    assert abort.endswith("[faulted]<br/>{interrupted, error}<br/>on_exception<br/>- _Global(50 global)<br/>"
                          "- CheckpointCallback(95)<br/>- _LateGlobal(95 global)")  # it saves a pre-empted step there
    # Without the with-block the globals are gone again.
    assert "_Global" not in callback_diagram(nine, Format.MERMAID)


@pytest.mark.slow
def test_config_cli_uses_the_config_callbacks() -> None:
    res = _cli("--config", str(REPO / "configs" / "quickstart.yaml"), "--hpo")
    assert res.returncode == 0, res.stderr
    hooks = _hook_lines(res.stdout)
    assert hooks["on_val_end"].endswith("PrunerCallback(85), EarlyStoppingCallback(90), CheckpointCallback(95)")
    assert hooks["on_epoch_end"].endswith("CheckpointCallback(95)")
    bad = _cli("--config", str(REPO / "configs" / "no-such.yaml"))
    assert bad.returncode == 2 and "no-such.yaml" in bad.stderr


# --- one run's path -------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_view_of_an_early_stopped_run(real_runs: RealRuns, tmp_path: Path) -> None:
    events_path = real_runs.events("early_stopped")
    records = [json.loads(line) for line in read_lines(events_path)]
    epochs = sum(r["event"] == "epoch" for r in records)
    stop = next(r for r in records if r["event"] == "stop_request")
    assert stop["payload"]["reason"] == "early_stop"
    _states, edges = parse_mermaid(run_diagram(events_path, Format.MERMAID))
    assert _edge_label(edges, "epoch_end", "epoch_begin") == f"next_epoch x{epochs - 1}"
    assert _edge_label(edges, "val", "epoch_end") == f"end_epoch x{epochs}"
    final = _edge_label(edges, "epoch_end", "train_end")
    assert final == f"finish x1 / early_stop in epoch {stop['epoch'] + 1} ({epochs} epochs done)"  # 1-based
    # info-level logs carry no per-batch moves: their count comes from global_step
    batches = sum(r["payload"]["batches"] for r in records if r["event"] == "epoch")
    assert _edge_label(edges, "train_step", "train_step") == f"batch x{batches - epochs} [internal]"
    assert "stop_now" not in str(edges)

    out = write_run_diagram(events_path, tmp_path / "lifecycle.mmd")
    assert out.read_text(encoding="utf-8") == run_diagram(events_path)
    res = _cli("--run", str(events_path), "-o", str(tmp_path / "run.dot"))
    assert res.returncode == 0 and "digraph" in (tmp_path / "run.dot").read_text(encoding="utf-8")


@pytest.mark.slow
def test_run_view_of_debug_and_aborted_runs(real_runs: RealRuns) -> None:
    debug = [json.loads(line) for line in read_lines(real_runs.events("debug"))]
    internal = sum(r["event"] == "transition" and r["from"] == r["to"] for r in debug)
    _, edges = parse_mermaid(run_diagram(real_runs.events("debug")))
    assert _edge_label(edges, "train_step", "train_step") == f"batch x{internal} [internal]"
    _, edges = parse_mermaid(run_diagram(real_runs.events("errored")))
    assert _edge_label(edges, "val", "train_end").startswith("abort x1 / error in epoch 2")


@pytest.mark.parametrize(("args", "line"), [
    # a FileNotFoundError and an IsADirectoryError traceback; Mermaid text in a .png with exit 0
    (("-o", "{tmp}/no/such/x.mmd"), "-o {tmp}/no/such/x.mmd: expected a file in an existing folder; found that "
                                    "{tmp}/no/such does not exist"),
    (("-o", "{tmp}/somedir"), "-o {tmp}/somedir: expected a file to write; found a folder"),
    (("-o", "{tmp}/afile/x.mmd"), "-o {tmp}/afile/x.mmd: expected a file in a folder; found {tmp}/afile, a file"),
    (("-o", "{tmp}/life.png"), "-o {tmp}/life.png: expected a file ending in .mmd (mermaid), .dot (dot) or .svg "
                               "(svg, the image format it writes); found .png, a format fsmtrain diagram does not "
                               "write"),
    (("--format", "dot", "-o", "{tmp}/life.svg"), "-o {tmp}/life.svg: expected a .dot file for --format dot; found "
                                                  ".svg, the suffix of --format svg"),
    (("--format", "mermaid", "-o", "{tmp}/life.PNG"), "-o {tmp}/life.PNG: expected a .mmd file for --format mermaid; "
                                                      "found .PNG, a format fsmtrain diagram does not write"),
])
def test_an_output_it_cannot_write_is_one_line_and_nothing_written(
        tmp_path: Path, args: tuple[str, ...], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "somedir").mkdir()
    (tmp_path / "afile").write_text("mine\n")
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    assert cli_main(["diagram", *(a.format(tmp=tmp_path) for a in args)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"fsmtrain diagram: {line.format(tmp=tmp_path)}"]
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "afile").read_text() == "mine\n"


def test_an_output_suffix_that_agrees_or_names_no_format_is_written(tmp_path: Path) -> None:
    assert cli_main(["diagram", "-o", str(tmp_path / "life.DOT")]) == 0  # the suffix picks dot, in any case
    assert (tmp_path / "life.DOT").read_text().startswith("digraph")
    assert cli_main(["diagram", "--format", "dot", "-o", str(tmp_path / "life.gv")]) == 0
    assert cli_main(["diagram", "-o", str(tmp_path / "life.txt")]) == 0  # Mermaid, the default
    assert "stateDiagram-v2" in (tmp_path / "life.txt").read_text()


def test_run_view_rejects_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "events.jsonl"
    bad.write_text("not json\n", encoding="utf-8")
    assert cli_main(["diagram", "--run", str(bad)]) == 2
    assert "events.jsonl:1" in capsys.readouterr().err
    assert cli_main(["diagram", "--run", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
