"""Reports: one self-contained HTML page of a run or of an Optuna study (``fsmtrain report``), and a
study's text summary (``fsmtrain hpo-report``). Names are imported when first asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

_PAGE = "fsmtrain.tools.report.page"
__getattr__, __dir__ = lazy_exports(__name__, {
    "ReportError": "fsmtrain.tools.report.run_log", "page": _PAGE, "render_report": _PAGE,
    "write_run_report": _PAGE, "study_report": "fsmtrain.tools.report.hpo_report",
})

__all__ = ["ReportError", "page", "render_report", "study_report", "write_run_report"]

if TYPE_CHECKING:
    from fsmtrain.tools.report.hpo_report import study_report
    from fsmtrain.tools.report.page import page, render_report, write_run_report
    from fsmtrain.tools.report.run_log import ReportError
