"""The audit of a run's log: :func:`audit_file` checks one ``events.jsonl`` (hash chain, moves
against the lifecycle, content, checkpoint files) and explains the run; :func:`audit_run_dir`
audits every rank's log of a run directory and that the ranks agreed.

Inside: ``auditor`` (the line-by-line walk), ``chain``, ``seals``, ``content``, ``ending``, ``files``
(the checks it runs), ``ranks`` (a run directory), ``verdict`` (what an audit finds and says) and
``cli`` (``fsmtrain audit``). Torch-free, like everything it reads.
"""

from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.audit.ranks import RankedAudit, audit_run_dir
from fsmtrain.tools.audit.verdict import (
    AuditReadError,
    AuditReport,
    ChainVerdict,
    Explanation,
    Finding,
    SegmentInfo,
    Severity,
    Verdict,
)

__all__ = [
    "AuditReadError", "AuditReport", "ChainVerdict", "Explanation", "Finding", "RankedAudit", "SegmentInfo",
    "Severity", "Verdict", "audit_file", "audit_run_dir",
]
