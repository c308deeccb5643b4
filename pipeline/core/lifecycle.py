"""The training lifecycle as data: :data:`TRANSITIONS` (the moves) and :data:`PROGRAM` (every hook and piece
of work, in order). :func:`check_table` proves at import that from every phase exactly one ordinary transition
is enabled for any consistent facts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum


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


class Guard(str, Enum):
    """Named guard predicates, each a pure function of the :class:`Facts`."""

    CAN_CONTINUE = "can_continue"  # no stop requested and the budget (epochs, max_steps) remains
    HAS_BATCH = "has_batch"  # the train loader has another batch
    IMMEDIATE_STOP = "immediate_stop"  # a stop was requested with immediate=True
    FAULTED = "faulted"  # an exception or interrupt is being handled
    VAL_DUE = "val_due"  # val_every_n_steps divides the global step, not yet validated at it


@dataclass(frozen=True)
class Facts:
    """The primitive facts guards are computed from."""

    stop_requested: bool
    immediate_stop: bool
    epochs_remain: bool  # and steps, under max_steps
    has_batch: bool
    faulted: bool
    val_due: bool = False

    def holds(self, guard: Guard) -> bool:
        if guard is Guard.CAN_CONTINUE:
            return self.epochs_remain and not self.stop_requested
        return bool(getattr(self, guard.value))  # every other guard is the fact of its name


@dataclass(frozen=True)
class Transition:
    trigger: str
    source: Phase
    dest: Phase
    conditions: tuple[Guard, ...] = ()
    unless: tuple[Guard, ...] = ()
    internal: bool = False  # a self-loop that does not leave or re-enter its phase
    # A signal seen at the source is honoured after this move: it completes what the source began (an epoch
    # after its last validation), and a checkpoint before it would run that validation again on resume.
    signal_after: bool = False

    def enabled(self, facts: Facts) -> bool:
        return all(facts.holds(g) for g in self.conditions) and not any(facts.holds(g) for g in self.unless)

    def guard_label(self) -> str:
        return ", ".join([g.value for g in self.conditions] + [f"not {g.value}" for g in self.unless])


P = Phase
G = Guard

ABORT = "abort"
BATCH = "batch"

VAL_CHECK = "val_check"  # a validation inside an epoch (val_every_n_steps)

TRANSITIONS: tuple[Transition, ...] = (
    Transition("begin", P.CREATED, P.TRAIN_BEGIN),
    Transition("start_epoch", P.TRAIN_BEGIN, P.EPOCH_BEGIN, conditions=(G.CAN_CONTINUE,)),
    Transition("finish", P.TRAIN_BEGIN, P.TRAIN_END, unless=(G.CAN_CONTINUE,)),
    Transition(BATCH, P.EPOCH_BEGIN, P.TRAIN_STEP, (G.HAS_BATCH,), (G.IMMEDIATE_STOP, G.VAL_DUE)),
    Transition(BATCH, P.TRAIN_STEP, P.TRAIN_STEP, (G.HAS_BATCH,), (G.IMMEDIATE_STOP, G.VAL_DUE), internal=True),
    Transition("validate", P.TRAIN_STEP, P.VAL, unless=(G.HAS_BATCH, G.IMMEDIATE_STOP)),
    Transition("validate", P.EPOCH_BEGIN, P.VAL, unless=(G.HAS_BATCH, G.IMMEDIATE_STOP)),
    Transition(VAL_CHECK, P.TRAIN_STEP, P.VAL, (G.HAS_BATCH, G.VAL_DUE), (G.IMMEDIATE_STOP,)),
    Transition(VAL_CHECK, P.EPOCH_BEGIN, P.VAL, (G.HAS_BATCH, G.VAL_DUE), (G.IMMEDIATE_STOP,)),  # a resume at it
    Transition("end_epoch", P.VAL, P.EPOCH_END, unless=(G.HAS_BATCH, G.IMMEDIATE_STOP), signal_after=True),
    Transition("resume_train", P.VAL, P.TRAIN_STEP, (G.HAS_BATCH, G.CAN_CONTINUE), (G.IMMEDIATE_STOP,)),
    Transition("cut_epoch", P.VAL, P.EPOCH_END, (G.HAS_BATCH,), (G.CAN_CONTINUE, G.IMMEDIATE_STOP)),
    Transition("next_epoch", P.EPOCH_END, P.EPOCH_BEGIN, conditions=(G.CAN_CONTINUE,)),
    Transition("finish", P.EPOCH_END, P.TRAIN_END, unless=(G.CAN_CONTINUE,)),
    Transition("stop_now", P.EPOCH_BEGIN, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    Transition("stop_now", P.TRAIN_STEP, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    Transition("stop_now", P.VAL, P.TRAIN_END, conditions=(G.IMMEDIATE_STOP,)),
    *(Transition(ABORT, phase, P.TRAIN_END, conditions=(G.FAULTED,)) for phase in Phase if phase is not FINAL),
)


class HookScope(str, Enum):
    """What a hook's (or an action's) single context argument is."""

    RUN = "run"
    EPOCH = "epoch"
    STEP = "step"
    VAL_STEP = "val_step"
    CHECKPOINT = "checkpoint"
    FAULT = "fault"


class Action(str, Enum):
    """Work the engine or its driver does at a fixed point of the lifecycle (not a callback hook)."""

    RESTORE = "restore"  # a resumed run loads its checkpoint (and fires on_load_checkpoint)
    BEGIN_EPOCH = "begin_epoch"  # a fresh epoch context; epoch slots cleared; lr read
    LOAD_EPOCH = "load_epoch"  # the driver prepares the epoch's batches; the first one is fetched
    NEXT_BATCH = "next_batch"  # the step context takes the fetched batch; the one after is fetched
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"
    ZERO_GRAD = "zero_grad"
    COUNT_BATCH = "count_batch"  # batch index and global step move on
    END_TRAIN = "end_train"  # the epoch's training metrics, read from the device once
    CUT_TRAIN = "cut_train"  # the same, for an epoch a stop cuts after a validation inside it
    RESUME_TRAIN = "resume_train"  # back to training after a validation inside the epoch (train mode)
    VAL_BATCH = "val_batch"
    END_VALIDATION = "end_validation"  # validation metrics, read once
    SCHEDULER_STEP = "scheduler_step"
    RECORD_EPOCH = "record_epoch"  # the ``epoch`` event; the epoch counter moves on
    END_RUN = "end_run"  # the driver's teardown
    OUTPUTS = "outputs"  # the run's own files (model.pt, lifecycle.mmd): written before the result says it is over
    RESULT = "result"  # the ``result`` event, always written, last


@dataclass(frozen=True)
class Step:
    """A hook (``action`` None) or an action: on ``trigger`` into ``phase``, else on entering ``phase``;
    ``skip``: the ``StepContext`` flag that leaves it out for one batch."""

    name: str
    phase: Phase
    scope: HookScope
    trigger: str | None = None
    per_batch: bool = False
    skip: str | None = None
    action: Action | None = None


_S, _E, _V, _R = HookScope.STEP, HookScope.EPOCH, HookScope.VAL_STEP, HookScope.RUN
_BWD, _OPT, _ZERO = "skip_backward", "skip_optimizer_step", "skip_zero_grad"
A = Action


def _do(action: Action, phase: Phase, scope: HookScope) -> Step:
    return Step(action.value, phase, scope, action=action)


def _batch(step: str | Action, skip: str | None = None) -> Step:
    name, action = (step.value, step) if isinstance(step, Action) else (step, None)
    return Step(name, P.TRAIN_STEP, _S, trigger=BATCH, per_batch=True, skip=skip, action=action)


# Everything that happens, in the order it happens.
PROGRAM: tuple[Step, ...] = (
    Step("on_train_begin", P.TRAIN_BEGIN, _R),
    _do(A.RESTORE, P.TRAIN_BEGIN, _R),
    Step("on_load_checkpoint", P.TRAIN_BEGIN, HookScope.CHECKPOINT),
    _do(A.BEGIN_EPOCH, P.EPOCH_BEGIN, _E),
    Step("on_train_epoch_begin", P.EPOCH_BEGIN, _E),
    _do(A.LOAD_EPOCH, P.EPOCH_BEGIN, _E),
    _batch(A.NEXT_BATCH),
    _batch("on_batch_begin"),
    _batch("on_before_forward"),
    _batch(A.FORWARD),
    _batch("on_after_forward"),
    _batch("on_before_backward", _BWD),
    _batch(A.BACKWARD, _BWD),
    _batch("on_after_backward", _BWD),
    _batch("on_before_optimizer_step", _OPT),
    _batch(A.OPTIMIZER_STEP, _OPT),
    _batch("on_after_optimizer_step", _OPT),
    _batch("on_before_zero_grad", _ZERO),
    _batch(A.ZERO_GRAD, _ZERO),
    _batch("on_train_step_end"),
    _batch(A.COUNT_BATCH),
    Step(A.END_TRAIN.value, P.VAL, _E, trigger="validate", action=A.END_TRAIN),  # not after a val_check
    Step("on_val_begin", P.VAL, _E),
    Step("on_val_batch_begin", P.VAL, _V, per_batch=True),
    Step(A.VAL_BATCH.value, P.VAL, _V, per_batch=True, action=A.VAL_BATCH),
    Step("on_val_batch_end", P.VAL, _V, per_batch=True),
    _do(A.END_VALIDATION, P.VAL, _E),
    Step("on_val_end", P.VAL, _E),
    Step(A.RESUME_TRAIN.value, P.TRAIN_STEP, _E, trigger="resume_train", action=A.RESUME_TRAIN),
    Step(A.CUT_TRAIN.value, P.EPOCH_END, _E, trigger="cut_epoch", action=A.CUT_TRAIN),
    Step("on_before_scheduler_step", P.EPOCH_END, _E),
    _do(A.SCHEDULER_STEP, P.EPOCH_END, _E),
    Step("on_epoch_end", P.EPOCH_END, _E),
    Step("on_save_checkpoint", P.EPOCH_END, HookScope.CHECKPOINT),
    _do(A.RECORD_EPOCH, P.EPOCH_END, _E),
    Step("on_exception", P.TRAIN_END, HookScope.FAULT, trigger=ABORT),
    Step("on_train_end", P.TRAIN_END, _R),
    _do(A.END_RUN, P.TRAIN_END, _R),
    _do(A.OUTPUTS, P.TRAIN_END, _R),
    _do(A.RESULT, P.TRAIN_END, _R),
)

HOOKS: tuple[Step, ...] = tuple(s for s in PROGRAM if s.action is None)
HOOK_NAMES: tuple[str, ...] = tuple(h.name for h in HOOKS)


def program_for(t: Transition) -> tuple[Step, ...]:
    """The handlers of ``t``: the steps bound to its trigger, then (unless internal) those entering its dest."""
    bound = tuple(s for s in PROGRAM if s.trigger == t.trigger and s.phase is t.dest)
    if t.internal:
        return bound
    return bound + tuple(s for s in PROGRAM
                         if s.trigger is None and s.phase is t.dest and s.scope is not HookScope.CHECKPOINT)


# The phases inside one epoch: a run that leaves one for train_end before the epoch's record is
# written (RECORD_EPOCH, the last step of epoch_end) has cut that epoch short.
EPOCH_PHASES: tuple[Phase, ...] = (P.EPOCH_BEGIN, P.TRAIN_STEP, P.VAL, P.EPOCH_END)
# The order in which hooks fire within one epoch; data-flow validation compares positions in it.
EPOCH_HOOK_ORDER: Mapping[str, int] = {
    h.name: i
    for i, h in enumerate(h for h in HOOKS if h.phase in EPOCH_PHASES and h.scope is not HookScope.CHECKPOINT)
}


_FROM: Mapping[Phase, tuple[Transition, ...]] = {
    phase: tuple(t for t in TRANSITIONS if t.source is phase and t.trigger != ABORT) for phase in Phase
}
_TRIGGERS_FROM: Mapping[Phase, tuple[str, ...]] = {
    phase: tuple(dict.fromkeys(t.trigger for t in moves)) for phase, moves in _FROM.items()
}
_BY_TRIGGER: Mapping[tuple[str, Phase], Transition] = {(t.trigger, t.source): t for t in reversed(TRANSITIONS)}


def transitions_from(phase: Phase) -> tuple[Transition, ...]:
    """Ordinary (non-abort) transitions leaving ``phase``, in table order."""
    return _FROM[phase]


def triggers_from(phase: Phase) -> tuple[str, ...]:
    """The distinct triggers of the ordinary transitions leaving ``phase``, in table order."""
    return _TRIGGERS_FROM[phase]


def enabled_transition(phase: Phase, facts: Facts) -> Transition:
    """The one ordinary transition the table allows from ``phase`` given ``facts``."""
    for t in transitions_from(phase):
        if t.enabled(facts):
            return t
    raise LifecycleError(f"no transition enabled from {phase.value!r} with {facts}")


def signal_waits(phase: Phase, facts: Facts) -> bool:
    """Whether a signal seen at ``phase`` waits for the next boundary: the move ``facts`` enable is ``signal_after``."""
    return any(t.signal_after and t.enabled(facts) for t in _FROM[phase])


def transition_for(trigger: str, source: Phase) -> Transition:
    """The first transition of the table that ``trigger`` fires from ``source``."""
    try:
        return _BY_TRIGGER[trigger, source]
    except KeyError:
        raise KeyError(f"no transition {trigger!r} from {source.value!r}") from None


class LifecycleError(RuntimeError):
    """The lifecycle table is inconsistent, or a move it does not allow was attempted."""


def _consistent_facts() -> Iterator[Facts]:
    return (Facts(stop, immediate, remain, batch, faulted=False, val_due=due)
            for stop, immediate, remain, batch, due in itertools.product((False, True), repeat=5)
            if stop or not immediate)  # an immediate stop is a stop


def check_table(transitions: tuple[Transition, ...] = TRANSITIONS, program: tuple[Step, ...] = PROGRAM) -> None:
    """Reject a broken table: unreachable phases, dead ends, ambiguous or missing moves, bad hooks."""
    problems: list[str] = []
    edges: dict[Phase, set[Phase]] = {p: set() for p in Phase}
    for t in transitions:
        if t.trigger != ABORT:  # abort reaches train_end from anywhere; a sound table must not need it
            edges[t.source].add(t.dest)
        if t.internal and t.source is not t.dest:
            problems.append(f"internal transition {t.trigger!r} must loop on its phase")
    reach = _closure({INITIAL}, edges)
    problems += [f"phase {p.value!r} is unreachable from {INITIAL.value!r}" for p in Phase if p not in reach]
    problems += [f"phase {p.value!r} cannot reach {FINAL.value!r}" for p in Phase if FINAL not in _closure({p}, edges)]
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
    for step in program:
        if step.trigger is not None and not any(t.trigger == step.trigger and t.dest is step.phase
                                                for t in transitions):
            problems.append(f"{step.name!r} is bound to {step.trigger!r}, which never enters {step.phase.value!r}")
        if step.per_batch and step.trigger is None and step.phase is not P.VAL:
            problems.append(f"{step.name!r} runs per batch inside {step.phase.value!r}, which has no batch loop")
    names = [s.name for s in program]
    if len(names) != len(set(names)):
        problems.append("program steps repeat")
    if problems:
        raise LifecycleError("invalid lifecycle table:\n  " + "\n  ".join(problems))


def _closure(start: set[Phase], edges: Mapping[Phase, set[Phase]]) -> set[Phase]:
    """The phases reachable from ``start`` (itself included)."""
    seen = set(start)
    while more := {nxt for p in seen for nxt in edges[p]} - seen:
        seen |= more
    return seen


check_table()
