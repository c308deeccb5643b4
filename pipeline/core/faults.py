"""One ``exception`` line per failure, and the teardown the engine runs itself when the machine
refuses ``abort``."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from fsmtrain.core.context import RunContext
from fsmtrain.core.lifecycle import ABORT, FINAL, LifecycleError, Phase, Transition, transition_for
from fsmtrain.core.log_file import LogWriteError
from fsmtrain.core.stop import StopReason

__all__ = ["ExceptionLog", "teardown_refused"]


class ExceptionLog:
    """Writes one ``exception`` line per exception, however often it is reported."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self._logged: set[int] = set()

    def __call__(self, exc: BaseException, source: str, **extra: Any) -> None:
        if id(exc) in self._logged:
            return
        self._logged.add(id(exc))
        # A log that can no longer be written must not stop the fault path.
        with contextlib.suppress(LogWriteError):
            self.run.emit(
                "exception", level="error", type=type(exc).__name__, message=str(exc), source=source,
                interrupt=isinstance(exc, KeyboardInterrupt),
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=20)), **extra,
            )


def teardown_refused(run: RunContext, programs: Mapping[Transition, Callable[[], None]], log: ExceptionLog,
                     phase: Phase, refusal: str, exc: BaseException) -> NoReturn:
    """The machine refused ``abort`` from ``phase``: run that ``abort``'s program (the teardown,
    reason ERROR) directly, then raise the refusal, caused by the fault."""
    message = (f"the machine refused {ABORT!r} from {phase.value!r} ({refusal}); the engine ran the teardown "
               f"itself. The fault was {type(exc).__name__}: {exc}")
    refused = LifecycleError(message)
    log(refused, "engine")
    with contextlib.suppress(LogWriteError):
        run.force_stop(StopReason.ERROR, "engine", message)
    run.bind_phase(lambda: FINAL)  # the run is in its teardown, whatever state the machine claims
    try:
        programs[transition_for(ABORT, phase)]()
    except BaseException as err:
        log(err, "teardown")
    raise refused from exc
