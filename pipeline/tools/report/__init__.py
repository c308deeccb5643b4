"""Reports: one self-contained HTML page of a run or of an Optuna study (``fsmtrain report``), and a
study's text summary (``fsmtrain hpo-report``). Names are imported when first asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

_PAGE = "fsmtrain.tools.report.page"
__all__ = ["ReportError", "render_report", "write_run_report"]
__getattr__, __dir__ = lazy_exports(__name__, {"ReportError": _PAGE, "render_report": _PAGE,
                                               "write_run_report": _PAGE})

if TYPE_CHECKING:
    from fsmtrain.tools.report.page import ReportError, render_report, write_run_report
