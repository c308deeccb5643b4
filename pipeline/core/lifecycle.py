"""The training lifecycle, written once as data.

The loop every fsmtrain run walks (one line per transition of :data:`TRANSITIONS`)::

    created --begin--> train_begin
    train_begin --start_epoch [can_continue]--> epoch_begin
    epoch_begin --batch [has_batch, not immediate_stop]--> train_step
    train_step --batch [has_batch, not immediate_stop]--> train_step        (internal, per batch)
    train_step --validate [not has_batch, not immediate_stop]--> val
    val --end_epoch [not immediate_stop]--> epoch_end
    epoch_end --next_epoch [can_continue]--> epoch_begin
    epoch_end --finish [not can_continue]--> train_end
    train_begin --finish [not can_continue]--> train_end                   (e.g. resuming a finished run)
    epoch_begin | train_step | val --stop_now [immediate_stop]--> train_end
    any non-final phase --abort [faulted]--> train_end

The runtime machine (:func:`build_machine`), the per-batch fast path in the engine, the diagrams,
the replay driver and the audit all read :data:`TRANSITIONS` and :data:`HOOKS`; nothing else lists
phases or legal moves. :func:`check_table` proves at import time that from every phase exactly one
ordinary transition is enabled for every consistent combination of guard facts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from transitions import Machine


class Phase(str, Enum):
    CREATED = "created"
    TRAIN_BEGIN = "train_begin"
    EPOCH_BEGIN = "epoch_begin"
    TRAIN_STEP = "train_step"
    VAL = "val"
    EPOCH_END = "epoch_end"
    TRAIN_END = "train_end"


INITIAL = Phase.CREATED
FINAL = Phase.TRAIN_END


class StopReason(str, Enum):
    """Why a run reached ``train_end``. Extend by subclassing is not possible for Enums, so new
    reasons are added here; every consumer (audit, replay, CLI exit codes) switches on this."""

    COMPLETED = "completed"
    NAN = "nan"
    EARLY_STOP = "early_stop"
    PRUNED = "pruned"
    INTERRUPTED = "interrupted"
    ERROR = "error"


class Guard(str, Enum):
    """Named guard predicates. Each is a pure function of the :class:`Facts` of a running machine."""

    CAN_CONTINUE = "can_continue"  # no stop requested and epochs remain
    HAS_BATCH = "has_batch"  # the train loader has another batch
    IMMEDIATE_STOP = "immediate_stop"  # a stop was requested with immediate=True
    FAULTED = "faulted"  # an exception or interrupt is being handled


@dataclass(frozen=True)
class Facts:
    """The primitive facts guards are computed from."""

    stop_requested: bool
    immediate_stop: bool
    epochs_remain: bool
    has_batch: bool
    faulted: bool

    def holds(self, guard: Guard) -> bool:
        return GUARD_RULES[guard](self)


GUARD_RULES: Mapping[Guard, Callable[[Facts], bool]] = {
    Guard.CAN_CONTINUE: lambda f: f.epochs_remain and not f.stop_requested,
    Guard.HAS_BATCH: lambda f: f.has_batch,
    Guard.IMMEDIATE_STOP: lambda f: f.immediate_stop,
    Guard.FAULTED: lambda f: f.faulted,
}


@dataclass(frozen=True)
class Transition:
    trigger: str
    source: Phase
    dest: Phase
    conditions: tuple[Guard, ...] = ()
    unless: tuple[Guard, ...] = ()
    internal: bool = False  # a self-loop that does not leave or re-enter its phase

    def enabled(self, facts: Facts) -> bool:
        return all(facts.holds(g) for g in self.conditions) and not any(
            facts.holds(g) for g in self.unless
        )

    def guard_label(self) -> str:
        parts = [g.value for g in self.conditions] + [f"not {g.value}" for g in self.unless]
        return ", ".join(parts)


P = Phase
G = Guard

ABORT = "abort"
BATCH = "batch"

TRANSITIONS: tuple[Transition, ...] = (
    Transition("begin", P.CREATED, P.TRAIN_BEGIN),
    Transition("start_epoch", P.TRAIN_BEGIN, P.EPOCH_BEGIN, conditions=(G.CAN_CONTINUE,)),
    Transition("finish", P.TRAIN_BEGIN, P.TRAIN_END, unless=(G.CAN_CONTINUE,)),
    Transition(BATCH, P.EPOCH_BEGIN, P.TRAIN_STEP, (G.HAS_BATCH,), (G.IMMEDIATE_STOP,)),
    Transition(BATCH, P.TRAIN_STEP, P.TRAIN_STEP, (G.HAS_BATCH,), (G.IMMEDIATE_STOP,), internal=True),
    Transition("validate", P.TRAIN_STEP, P.VAL, unless=(G.HAS_BATCH, G.IMMEDIATE_STOP)),
    Transition("validate", P.EPOCH_BEGIN, P.VAL, unless=(G.HAS_BATCH, G.IMMEDIATE_STOP)),
    Transition("end_epoch", P.VAL, P.EPOCH_END, unless=(G.IMMEDIATE_STOP,)),
    Transition("next_epoch", P.EPOCH_END, P.EPOCH_BEGIN, conditions=(G.CAN_CONTINUE,)),
    Transition("finish", P.EPOCH_END, P.TRAIN_END, unless=(G.CAN_CONTINUE,)),
    Transition("stop_now", P.EPOCH_BEGIN, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    Transition("stop_now", P.TRAIN_STEP, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    Transition("stop_now", P.VAL, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    *(
        Transition(ABORT, phase, P.TRAIN_END, conditions=(G.FAULTED,))
        for phase in Phase
        if phase is not FINAL
    ),
)


class HookScope(str, Enum):
    """What a hook's single context argument is."""

    RUN = "run"
    EPOCH = "epoch"
    STEP = "step"
    CHECKPOINT = "checkpoint"
    FAULT = "fault"


@dataclass(frozen=True)
class HookSpec:
    """Where a hook fires: on a transition (by trigger) or inside a phase, in listed order."""

    name: str
    phase: Phase
    scope: HookScope
    trigger: str | None = None  # set when the hook fires as part of a transition
    per_batch: bool = False


_S, _E = HookScope.STEP, HookScope.EPOCH

HOOKS: tuple[HookSpec, ...] = (
    HookSpec("on_train_begin", P.TRAIN_BEGIN, HookScope.RUN),
    HookSpec("on_load_checkpoint", P.TRAIN_BEGIN, HookScope.CHECKPOINT),
    HookSpec("on_train_epoch_begin", P.EPOCH_BEGIN, _E),
    HookSpec("on_batch_begin", P.TRAIN_STEP, _S, trigger=BATCH, per_batch=True),
    HookSpec("on_before_forward", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_after_forward", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_before_backward", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_after_backward", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_before_optimizer_step", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_after_optimizer_step", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_before_zero_grad", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_train_step_end", P.TRAIN_STEP, _S, per_batch=True),
    HookSpec("on_val_begin", P.VAL, _E),
    HookSpec("on_val_end", P.VAL, _E),
    HookSpec("on_before_scheduler_step", P.EPOCH_END, _E),
    HookSpec("on_epoch_end", P.EPOCH_END, _E),
    HookSpec("on_save_checkpoint", P.EPOCH_END, HookScope.CHECKPOINT),
    HookSpec("on_exception", P.TRAIN_END, HookScope.FAULT, trigger=ABORT),
    HookSpec("on_train_end", P.TRAIN_END, HookScope.RUN),
)

HOOK_NAMES: tuple[str, ...] = tuple(h.name for h in HOOKS)
PER_BATCH_HOOKS: tuple[str, ...] = tuple(h.name for h in HOOKS if h.per_batch)

_EPOCH_PHASES = (P.EPOCH_BEGIN, P.TRAIN_STEP, P.VAL, P.EPOCH_END)
# The order in which hooks fire within one epoch; data-flow validation compares positions in it.
EPOCH_HOOK_ORDER: Mapping[str, int] = {
    h.name: i
    for i, h in enumerate(h for h in HOOKS if h.phase in _EPOCH_PHASES and h.scope is not HookScope.CHECKPOINT)
}


_FROM: Mapping[Phase, tuple[Transition, ...]] = {
    phase: tuple(t for t in TRANSITIONS if t.source is phase and t.trigger != ABORT) for phase in Phase
}


def transitions_from(phase: Phase) -> tuple[Transition, ...]:
    """Ordinary (non-abort) transitions leaving ``phase``, in table order."""
    return _FROM[phase]


def legal_moves() -> frozenset[tuple[Phase, Phase, str]]:
    return frozenset((t.source, t.dest, t.trigger) for t in TRANSITIONS)


def transition_for(trigger: str, source: Phase) -> Transition:
    for t in TRANSITIONS:
        if t.trigger == trigger and t.source is source:
            return t
    raise KeyError(f"no transition {trigger!r} from {source.value!r}")


def enabled_transition(phase: Phase, facts: Facts) -> Transition:
    """The one ordinary transition the table allows from ``phase`` given ``facts``."""
    for t in transitions_from(phase):
        if t.enabled(facts):
            return t
    raise LifecycleError(f"no transition enabled from {phase.value!r} with {facts}")


class LifecycleError(RuntimeError):
    """The lifecycle table is inconsistent, or a move it does not allow was attempted."""


def _consistent_facts() -> Iterator[Facts]:
    for stop, immediate, remain, batch in itertools.product((False, True), repeat=4):
        if immediate and not stop:
            continue  # an immediate stop is a stop
        yield Facts(stop, immediate, remain, batch, faulted=False)


def check_table(transitions: tuple[Transition, ...] = TRANSITIONS, hooks: tuple[HookSpec, ...] = HOOKS) -> None:
    """Reject a broken table: unreachable phases, dead ends, ambiguous or missing moves, bad hooks."""
    problems: list[str] = []
    phases = set(Phase)
    edges: dict[Phase, set[Phase]] = {p: set() for p in Phase}
    for t in transitions:
        if t.trigger != ABORT:  # abort reaches train_end from anywhere; a sound table must not need it
            edges[t.source].add(t.dest)
        if t.internal and t.source is not t.dest:
            problems.append(f"internal transition {t.trigger!r} must loop on its phase")
    reach = _closure({INITIAL}, edges)
    problems += [f"phase {p.value!r} is unreachable from {INITIAL.value!r}" for p in phases - reach]
    reverse: dict[Phase, set[Phase]] = {p: set() for p in Phase}
    for src, dests in edges.items():
        for d in dests:
            reverse[d].add(src)
    can_finish = _closure({FINAL}, reverse)
    problems += [f"phase {p.value!r} cannot reach {FINAL.value!r}" for p in phases - can_finish]
    for phase in Phase:
        if phase is FINAL:
            if any(t.source is FINAL for t in transitions):
                problems.append(f"{FINAL.value!r} is final but has outgoing transitions")
            continue
        if not any(t.source is phase and t.trigger == ABORT for t in transitions):
            problems.append(f"phase {phase.value!r} has no {ABORT!r} transition")
        ordinary = [t for t in transitions if t.source is phase and t.trigger != ABORT]
        for facts in _consistent_facts():
            enabled = [t for t in ordinary if t.enabled(facts)]
            if len(enabled) != 1:
                names = [f"{t.trigger}->{t.dest.value}" for t in enabled] or ["none"]
                problems.append(f"from {phase.value!r} with {facts}: enabled {', '.join(names)}")
    triggers = {t.trigger for t in transitions}
    for h in hooks:
        if h.trigger is not None and h.trigger not in triggers:
            problems.append(f"hook {h.name!r} names unknown trigger {h.trigger!r}")
    if len(HOOK_NAMES) != len(set(HOOK_NAMES)):
        problems.append("hook names repeat")
    if problems:
        raise LifecycleError("invalid lifecycle table:\n  " + "\n  ".join(problems))


def _closure(start: set[Phase], edges: Mapping[Phase, set[Phase]]) -> set[Phase]:
    seen = set(start)
    todo = list(start)
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


check_table()


def build_machine(model: Any, guards: Mapping[Guard, Callable[[], bool]]) -> Machine:
    """A plain ``transitions`` machine over ``model`` whose conditions are the live ``guards``."""
    spec = [
        {
            "trigger": t.trigger,
            "source": t.source.value,
            "dest": None if t.internal else t.dest.value,
            "conditions": [guards[g] for g in t.conditions],
            "unless": [guards[g] for g in t.unless],
        }
        for t in TRANSITIONS
    ]
    return Machine(
        model=model,
        states=[p.value for p in Phase],
        transitions=spec,
        initial=INITIAL.value,
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,
    )
