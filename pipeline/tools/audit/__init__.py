"""The audit of a run's logs (torch-free): :func:`audit_file` checks and explains one ``events.jsonl``;
:func:`audit_run_dir` every rank's log of a run directory, and that the ranks agreed."""

from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.audit.ranks import RankedAudit, audit_run_dir
from fsmtrain.tools.audit.verdict import AuditReadError, AuditReport, Finding, Severity, Verdict

__all__ = ["AuditReadError", "AuditReport", "Finding", "RankedAudit", "Severity", "Verdict", "audit_file",
           "audit_run_dir"]
