"""Lifecycle diagrams drawn from the table through a ``transitions`` ``GraphMachine`` (Mermaid, DOT, SVG):
the lifecycle, the callbacks on it, one run's path. Output is deterministic, compared byte for byte."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from transitions import State
from transitions.extensions import GraphMachine

from fsmtrain.core.context import epoch_number
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.lifecycle import FINAL, HOOKS, INITIAL, TRANSITIONS, Guard, Phase, Transition
from fsmtrain.core.run_path import DiagramError, RunPath, read_run_path
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.core.stop import Route, StopReason

__all__ = ["DiagramError", "Format", "GraphvizMissing", "callback_diagram", "dot_digest", "lifecycle_diagram",
           "path_diagram", "read_run_path", "render_svg", "run_diagram", "stop_reasons_for", "write_lifecycle_files",
           "write_run_diagram"]

TITLE = "fsmtrain lifecycle"
SVG_DIGEST_MARK = "fsmtrain-dot-sha256:"
GRAPHVIZ_HINT = ("Graphviz's `dot` program is needed for SVG output and was not found on PATH; install it with "
                 "`apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (Homebrew), "
                 "or use --format mermaid|dot")


class Format(str, Enum):
    MERMAID = "mermaid"
    DOT = "dot"
    SVG = "svg"


SUFFIXES: dict[Format, str] = {Format.MERMAID: ".mmd", Format.DOT: ".dot", Format.SVG: ".svg"}


class GraphvizMissing(RuntimeError):
    """SVG was asked for but Graphviz's ``dot`` is not installed."""


class LabelledState(State):
    """A ``transitions`` state with a ``label`` (MarkupMachine exports it; the graph engines draw it)."""

    def __init__(self, *args: Any, label: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if label:
            self.label = label


# Top to bottom, with a smaller edge font, so the diagram fits a screen.
_MACHINE_ATTRIBUTES: dict[str, str] = {**GraphMachine.machine_attributes, "rankdir": "TB"}
_STYLE_ATTRIBUTES = copy.deepcopy(GraphMachine.style_attributes)
_STYLE_ATTRIBUTES["edge"]["default"]["fontsize"] = "12"  # type: ignore[index]
CALLBACK_BULLET = "- "  # marks a callback line under its hook in the callback view
DOT_NEWLINE = "\\l"  # Graphviz: end a left-aligned line
MERMAID_NEWLINE = "<br/>"

EdgeKey = tuple[str, str, str | None]  # (source, trigger, dest); dest None for an internal move


def _notes(machine: Any, tran: dict[str, Any]) -> list[str]:
    notes: list[str] = machine.edge_notes.get((tran["source"], tran["trigger"], tran.get("dest")), [])
    return notes


class _MermaidLabels:
    """Mixin for ``transitions``' Mermaid engine: a move's ``edge_notes`` go under its label."""

    machine: Any

    def _transition_label(self, tran: dict[str, Any]) -> str:
        text: str = super()._transition_label(tran)  # type: ignore[misc]
        return MERMAID_NEWLINE.join([text, *_notes(self.machine, tran)])


class _DotLabels:
    """Mixin for the graphviz engine: guards and notes on lines of their own under the trigger."""

    machine: Any

    def _transition_label(self, tran: dict[str, Any]) -> str:
        text: str = super()._transition_label(tran)  # type: ignore[misc]
        head = tran.get("label", tran["trigger"])
        guards = text[len(head):].strip()  # transitions appends " [internal]" and " [a & !b]" to the label
        lines = [head, *(f"  {g}" for g in _guard_lines(guards)), *_notes(self.machine, tran)]
        return DOT_NEWLINE.join(lines) + DOT_NEWLINE

    def _add_edges(self, transitions: list[dict[str, Any]], container: Any) -> None:
        super()._add_edges(transitions, _OneLinePerTransition(container))  # type: ignore[misc]


def _guard_lines(guards: str, width: int = 32) -> list[str]:
    """``[internal] [a & !b & !c]`` as short lines: each bracket, broken after an ``&`` past ``width``."""
    lines: list[str] = []
    for group in filter(None, guards.replace("] [", "]\n[").split("\n")):
        line = ""
        for part in group.split(" & "):
            if line and len(line) + len(part) > width:
                lines.append(line + " &")
                line = "  " + part
            else:
                line = f"{line} & {part}" if line else part
        lines.append(line)
    return lines


class _OneLinePerTransition:
    """Passes edges on to the graphviz graph without the `` | `` between merged transitions."""

    def __init__(self, graph: Any) -> None:
        self._graph = graph

    def edge(self, src: str, dst: str, label: str = "", **attrs: Any) -> None:
        self._graph.edge(src, dst, label=label.replace(DOT_NEWLINE + " | ", DOT_NEWLINE), **attrs)


class LifecycleGraphMachine(GraphMachine):
    state_cls = LabelledState
    machine_attributes = _MACHINE_ATTRIBUTES
    style_attributes = _STYLE_ATTRIBUTES

    def __init__(self, *args: Any, edge_notes: dict[EdgeKey, list[str]] | None = None, **kwargs: Any) -> None:
        self.edge_notes = dict(edge_notes or {})
        super().__init__(*args, **kwargs)

    def _init_graphviz_engine(self, graph_engine: str) -> type:
        base: type = super()._init_graphviz_engine(graph_engine)
        mixin = _DotLabels if graph_engine == "graphviz" else _MermaidLabels
        return type(f"_Lifecycle{base.__name__}", (mixin, base), {})


def stop_reasons_for(t: Transition) -> tuple[StopReason, ...]:
    """Which stop reasons can take transition ``t`` into ``train_end``, read from its guards."""
    if t.dest is not FINAL:
        return ()
    if Guard.FAULTED in t.conditions:
        routes = {Route.FAULT}
    elif Guard.IMMEDIATE_STOP in t.conditions:
        routes = {Route.REQUEST}
    elif Guard.CAN_CONTINUE in t.unless:
        routes = {Route.EPOCHS, Route.REQUEST}
    else:
        routes = set(Route)
    return tuple(r for r in StopReason if r.route in routes)


def _clean(text: str) -> str:
    # Mermaid ends a transition description at ':', ';' or '#'; keep labels free of them.
    return text.replace(":", " ").replace(";", ",").replace("#", "no.")


@dataclass
class _Edge:
    t: Transition
    label: str
    notes: list[str] = field(default_factory=list)  # lines under the label (callbacks on the move)


@dataclass
class _Spec:
    """What to draw: node labels (phase -> lines) and the labelled edges, in table order."""

    phases: list[Phase]
    node_lines: dict[Phase, list[str]] = field(default_factory=dict)
    edges: list[_Edge] = field(default_factory=list)
    show_conditions: bool = True
    active: Phase | None = None


def _draw(spec: _Spec, fmt: Format, title: str) -> str:
    """``spec`` in ``fmt``, drawn by ``transitions``' own graph engine (SVG: ``dot -Tsvg`` of the DOT)."""
    mermaid = fmt is Format.MERMAID
    newline = MERMAID_NEWLINE if mermaid else DOT_NEWLINE
    labels = {phase: newline.join([phase.value, *lines]) for phase, lines in spec.node_lines.items() if lines}
    states = [{"name": phase.value, "label": labels.get(phase)} for phase in spec.phases]
    transitions: list[dict[str, Any]] = []
    notes: dict[EdgeKey, list[str]] = {}
    for edge in spec.edges:
        dest = None if edge.t.internal else edge.t.dest.value
        if edge.notes:
            notes[(edge.t.source.value, edge.t.trigger, dest)] = edge.notes
        # Guard names as strings: a drawn machine is never triggered, so they are never resolved.
        transitions.append({"trigger": edge.t.trigger, "source": edge.t.source.value, "dest": dest,
                            "conditions": [g.value for g in edge.t.conditions],
                            "unless": [g.value for g in edge.t.unless], "label": edge.label})
    if not mermaid:
        _require_graphviz_package()
    model = SimpleNamespace()  # what the graph machine binds ``get_graph`` to
    machine = LifecycleGraphMachine(
        model=model, states=states, transitions=transitions, auto_transitions=False, title=title,
        initial=INITIAL.value if INITIAL in spec.phases else spec.phases[0].value, edge_notes=notes,
        show_conditions=spec.show_conditions, graph_engine="mermaid" if mermaid else "graphviz")
    graph_obj = machine.model_graphs[id(model)]
    graph_obj.reset_styling()  # no "current state" highlight unless asked for
    if spec.active is not None:
        graph_obj.set_node_style(spec.active.value, "active")
    source: str = model.get_graph().source
    if mermaid:
        # transitions writes the title as a bare line of the front matter; Mermaid reads `title:`.
        source = source.replace(f"---\n{title}\n---\n", f"---\ntitle: {_yaml_scalar(title)}\n---\n", 1)
        # The flat Mermaid engine marks the initial state only; mark the final one too.
        source = source.rstrip("\n") + f"\n  {FINAL.value} --> [*]\n" if FINAL in spec.phases else source
        return source if source.endswith("\n") else source + "\n"
    return render_svg(source) if fmt is Format.SVG else source


def _yaml_scalar(text: str) -> str:
    """``text`` as a YAML value: plain when it can be, else double-quoted (JSON is valid YAML)."""
    plain = text and not any(c in text for c in ":#'\"{}[],&*!|>%@`") and text == text.strip()
    return text if plain else json.dumps(text)


def _require_graphviz_package() -> None:
    """transitions silently falls back to Mermaid text without the ``graphviz`` Python package."""
    from transitions.extensions import diagrams_graphviz

    if getattr(diagrams_graphviz, "pgv", None) is None:
        raise DiagramError("DOT/SVG output needs the `graphviz` Python package (pip install graphviz), "
                           "which transitions uses to write DOT source")


def _lifecycle_edges(notes: dict[int, list[str]] | None = None) -> list[_Edge]:
    edges: list[_Edge] = []
    for i, t in enumerate(TRANSITIONS):
        reasons = stop_reasons_for(t)
        # the reasons under the trigger, a few to a line, so a label stays narrow
        lines = textwrap.wrap("{" + ", ".join(r.value for r in reasons) + "}", 40) if reasons else []
        edges.append(_Edge(t, _clean(t.trigger), [*map(_clean, lines), *(notes or {}).get(i, [])]))
    return edges


def lifecycle_diagram(fmt: Format = Format.MERMAID) -> str:
    """The lifecycle itself: every phase, every transition with trigger, guards and stop reasons."""
    return _draw(_Spec(list(Phase), edges=_lifecycle_edges()), fmt, TITLE)


def _callback_label(runner: CallbackRunner, index: int) -> str:
    entry = runner.entries[index]
    tier = "" if entry.tier is Tier.CORE else f" {entry.tier.name.lower()}"
    return f"{entry.callback.name}({entry.callback.priority}{tier})"


def callback_diagram(callbacks: Sequence[TrainingCallback], fmt: Format = Format.MERMAID,
                     *, include_global: bool = True) -> str:
    """The lifecycle with, on each phase and move, the callbacks that run there in dispatch order."""
    runner = CallbackRunner(callbacks, include_global=include_global)
    node_lines: dict[Phase, list[str]] = {}
    edge_lines: dict[int, list[str]] = {}
    for spec in HOOKS:
        table = runner.table(spec.name)
        if not table:
            continue
        # The hook, then one callback per line, so a label stays narrow.
        lines = [_clean(spec.name), *(_clean(f"{CALLBACK_BULLET}{_callback_label(runner, i)}") for i, _ in table)]
        if spec.trigger is None:
            node_lines.setdefault(spec.phase, []).extend(lines)
            continue
        for i, t in enumerate(TRANSITIONS):
            if t.trigger == spec.trigger and t.dest is spec.phase:
                edge_lines.setdefault(i, []).extend(lines)
    return _draw(_Spec(list(Phase), node_lines=node_lines, edges=_lifecycle_edges(edge_lines)), fmt,
                 f"{TITLE} with callbacks")


def run_diagram(events_path: str | Path, fmt: Format = Format.MERMAID) -> str:
    """The path one run took: each taken edge with its count, the final one with its stop reason."""
    return path_diagram(read_run_path(events_path), events_path, fmt)


def path_diagram(run: RunPath, events_path: str | Path, fmt: Format = Format.MERMAID) -> str:
    """:func:`run_diagram` of a path already counted (a reader that went through the log anyway)."""
    if not run.counts:
        raise DiagramError(f"{events_path}: no transition events; is this an fsmtrain events.jsonl?")
    by_key = {(t.source.value, t.dest.value, t.trigger): t for t in TRANSITIONS}
    edges: list[_Edge] = []
    visited: set[Phase] = {INITIAL}
    for key, t in by_key.items():  # table order keeps the output deterministic
        n = run.counts.get(key, 0)
        if not n:
            continue
        visited.update((t.source, t.dest))
        label = f"{t.trigger} x{n}"
        if key == run.final:
            label += f" / {run.reason or 'unknown'}"
            if run.stop_epoch is not None and run.stop_epoch >= 0:
                label += f" in epoch {epoch_number(run.stop_epoch)}"
            label += f" ({run.epochs_done} epochs done)"
        edges.append(_Edge(t, _clean(label)))
    unknown = sorted(k for k in run.counts if k not in by_key)
    if unknown:
        moves = ", ".join(f"{s}->{d} ({g})" for s, d, g in unknown)
        raise DiagramError(f"{events_path}: moves not in the lifecycle table: {moves}; run `fsmtrain audit`")
    phases = [p for p in Phase if p in visited]
    last = Phase(run.last_phase) if run.last_phase in {p.value for p in Phase} else None
    spec = _Spec(phases, edges=edges, show_conditions=False, active=last)
    source = Path(events_path)
    name = (source if source.is_dir() else source.parent).name or "run"
    ranks = f" on {run.world_size} ranks" if run.world_size > 1 else ""
    return _draw(spec, fmt, f"{TITLE}: run {name}{ranks}")


def write_run_diagram(events_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the Mermaid diagram of a finished run (default: ``lifecycle.mmd`` next to the log)."""
    events = Path(events_path)
    out = Path(out_path) if out_path is not None else events.parent / "lifecycle.mmd"
    out.write_text(run_diagram(events, Format.MERMAID), encoding="utf-8")
    return out


def dot_digest(dot_source: str) -> str:
    return hashlib.sha256(dot_source.encode("utf-8")).hexdigest()


def render_svg(dot_source: str, dot_program: str = "dot") -> str:
    """``dot -Tsvg`` of ``dot_source``, with the DOT's sha256 in a comment (what the staleness check compares)."""
    exe = shutil.which(dot_program)
    if exe is None:
        raise GraphvizMissing(GRAPHVIZ_HINT)
    proc = subprocess.run([exe, "-Tsvg"], input=dot_source.encode("utf-8"), capture_output=True, check=False)
    if proc.returncode != 0:
        raise DiagramError(f"`dot -Tsvg` failed: {proc.stderr.decode(errors='replace').strip()}")
    svg = proc.stdout.decode("utf-8")
    mark = f"<!-- {SVG_DIGEST_MARK} {dot_digest(dot_source)} -->\n"
    head, sep, rest = svg.partition("<svg")
    return head + mark + sep + rest if sep else mark + svg


def svg_recorded_digest(svg_text: str) -> str | None:
    marker = svg_text.find(SVG_DIGEST_MARK)
    return None if marker < 0 else svg_text[marker + len(SVG_DIGEST_MARK):].split()[0]


def write_lifecycle_files(directory: str | Path, *, svg: bool = True) -> list[Path]:
    """Write ``lifecycle.mmd``, ``lifecycle.dot`` and (when ``dot`` is installed) ``lifecycle.svg``."""
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    dot_text = lifecycle_diagram(Format.DOT)
    texts = {"lifecycle.mmd": lifecycle_diagram(Format.MERMAID), "lifecycle.dot": dot_text}
    if svg:
        texts["lifecycle.svg"] = render_svg(dot_text)
    for name, text in texts.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return [out_dir / name for name in texts]
