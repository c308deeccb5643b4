"""The audit of a run's log: :func:`audit_file` checks one ``events.jsonl`` (hash chain, moves
against the lifecycle, content, checkpoint files) and explains the run; :func:`audit_run_dir`
audits every rank's log of a run directory and that the ranks agreed. Torch-free.
"""

from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.audit.ranks import RankedAudit, audit_run_dir
from fsmtrain.tools.audit.verdict import AuditReadError, AuditReport, Finding, Severity, Verdict

__all__ = ["AuditReadError", "AuditReport", "Finding", "RankedAudit", "Severity", "Verdict", "audit_file",
           "audit_run_dir"]
