"""Reports: one self-contained HTML page of a run or of an Optuna study (``fsmtrain report``), and a
study's text summary (``fsmtrain hpo-report``)."""

from fsmtrain.tools.report.page import ReportError, render_report, write_run_report

__all__ = ["ReportError", "render_report", "write_run_report"]
