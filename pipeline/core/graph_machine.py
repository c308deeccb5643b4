"""The ``transitions`` ``GraphMachine`` the diagrams are drawn with: labelled states, top to bottom, and
each transition, its guards and callbacks on lines of their own, so the drawing stays narrow."""

from __future__ import annotations

import copy
from typing import Any

from transitions import State
from transitions.extensions import GraphMachine

__all__ = ["CALLBACK_BULLET", "DOT_NEWLINE", "MERMAID_NEWLINE", "EdgeKey", "LabelledState", "LifecycleGraphMachine"]


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
