"""``fsmtrain hpo-report``: what a study found, as text or JSON: counts, best and top trials,
importances, best parameters at the edge of their range, pruning decisions and failures."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import TYPE_CHECKING, Any

from fsmtrain.app.arg_types import positive_int
from fsmtrain.core.context import validation_label
from fsmtrain.core.events import jsonable
from fsmtrain.tools.report.study import IMPORTANCE_METHOD, param_importances, storage_arg

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = ["EDGE_FRACTION", "register_cli", "render", "study_report"]

EDGE_FRACTION = 0.05
"""A best value within this share of its range (in log space for log ranges) is at the edge."""
_STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")


def _trial(t: FrozenTrial) -> dict[str, Any]:
    return {"number": t.number, "value": jsonable(t.value), "params": dict(t.params),
            "run_dirs": t.user_attrs.get("run_dirs", {})}


def _edge(name: str, value: Any, dist: Any) -> dict[str, Any] | None:
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    if low is None or high is None or high <= low or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if type(dist).__name__ == "IntDistribution" and not dist.log:
        side = "lower" if value <= low else "upper" if value >= high else None
    else:
        pos = ((math.log(value) - math.log(low)) / (math.log(high) - math.log(low)) if dist.log
               else (value - low) / (high - low))
        side = "lower" if pos <= EDGE_FRACTION else "upper" if pos >= 1 - EDGE_FRACTION else None
    if side is None:
        return None
    return {"param": name, "value": value, "low": low, "high": high, "edge": side,
            "message": f"best {name}={value:g} is at the {side} edge of its range [{low:g}, {high:g}]: "
                       f"widen the range{' downwards' if side == 'lower' else ' upwards'}"}


def _seen_by_pruner(trials: list[FrozenTrial], pruned: FrozenTrial,
                    attr: dict[str, Any]) -> tuple[list[FrozenTrial], str]:
    """The trials COMPLETE when the pruner decided on ``pruned`` (MedianPruner's basis), and its words."""
    from optuna.trial import TrialState

    at = attr.get("decided_at")
    if isinstance(at, (int, float)) and not isinstance(at, bool):
        bound, basis = float(at), "complete at the decision"
    elif pruned.datetime_complete is not None:
        bound, basis = pruned.datetime_complete.timestamp(), "complete when it ended"
    else:
        bound, basis = math.inf, "complete now"
    return [o for o in trials if o.number != pruned.number and o.state is TrialState.COMPLETE
            and o.datetime_complete is not None and o.datetime_complete.timestamp() <= bound], basis


def _best_so_far(trial: FrozenTrial, step: int, maximize: bool) -> float | None:
    """The trial's best reported value up to Optuna's ``step``: what Optuna's MedianPruner compares."""
    values = [v for s, v in trial.intermediate_values.items() if s <= step and math.isfinite(v)]
    return (max if maximize else min)(values, default=None)


def study_report(study: optuna.study.Study, storage_shown: str, top: int = 5) -> dict[str, Any]:
    """The report as plain data (what ``--json`` prints)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    counts = {s: sum(1 for t in trials if t.state.name == s) for s in _STATES}
    complete = [t for t in trials if t.state is TrialState.COMPLETE and t.value is not None]
    maximize = study.direction.name == "MAXIMIZE"
    ranked = sorted(complete, key=lambda t: t.value if t.value is not None else math.nan, reverse=maximize)
    best = ranked[0] if ranked else None
    importances, why_none = param_importances(study)
    edges = [] if best is None else [
        e for name, value in best.params.items() if (e := _edge(name, value, best.distributions[name])) is not None]
    settings = study.user_attrs.get("fsmtrain", {})
    pruned = []
    for t in [t for t in trials if t.state is TrialState.PRUNED]:
        attr = t.user_attrs.get("pruned") or {}
        step: int = attr.get("validation", t.last_step if t.last_step is not None else -1)  # Optuna's step
        prediction = t.user_attrs.get("predicted_final_loss")
        seen, basis = _seen_by_pruner(trials, t, attr)
        others = sorted(v for o in seen if (v := o.intermediate_values.get(step)) is not None and math.isfinite(v))
        pruned.append({
            "number": t.number, "optuna_step": step,
            **{k: attr.get(k) if "validation" in attr else None for k in ("validation", "epoch", "step")},
            "value": jsonable(t.intermediate_values.get(step)),
            "best_so_far": jsonable(_best_so_far(t, step, maximize)),
            "monitor": attr.get("monitor", "value"),
            "pruner": attr.get("pruner") or settings.get("pruner"), "reason": attr.get("reason"),
            "predicted_final_loss": prediction if isinstance(prediction, dict) else None,
            "others_at_validation": {"n": len(others), "median": statistics.median(others) if others else None,
                                     "basis": basis},
            "params": dict(t.params),
        })
    failed = [{"number": t.number, "error": t.user_attrs.get("error"), "params": dict(t.params),
               "retried_by": [r.number for r in trials if r.system_attrs.get("failed_trial") == t.number]}
              for t in trials if t.state is TrialState.FAIL]
    return {
        "study": study.study_name, "storage": storage_shown, "direction": study.direction.name.lower(),
        "n_trials": len(trials), "counts": counts,
        "best": None if best is None else _trial(best),
        "top": [_trial(t) for t in ranked[:top]],
        "importances": importances, "importances_note": why_none, "importances_method": IMPORTANCE_METHOD,
        "edge_warnings": edges, "pruned": pruned, "failed": failed,
        "settings": settings,
    }


def _short(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in params.items())


def render(report: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {s.lower()}" for s, n in report["counts"].items() if n)
    out = [f"study {report['study']} ({report['direction']}) in {report['storage']}",
           f"trials: {report['n_trials']} ({counts or 'none'})"]
    best = report["best"]
    if best is None:
        out.append("best: none (no completed trial)")
    else:
        out.append(f"best: trial {best['number']}, value {_short(best['value'])}: {_params(best['params'])}")
        out += [f"  seed {seed}: {run_dir}" for seed, run_dir in best["run_dirs"].items()]
    if report["top"]:
        out.append(f"top {len(report['top'])}:")
        out += [f"  #{t['number']:<4} {_short(t['value']):<12} {_params(t['params'])}" for t in report["top"]]
    if report["importances"]:
        out.append(f"parameter importances ({report['importances_method']}):")
        out += [f"  {k:<32} {v:.3f}" for k, v in report["importances"].items()]
    else:
        out.append(f"parameter importances: none ({report['importances_note']})")
    out += [f"warning: {e['message']}" for e in report["edge_warnings"]]
    if report["pruned"]:
        out.append("pruning decisions:")
        out += [f"  trial {p['number']} pruned at {_decision(p)}" for p in report["pruned"]]
    if report["failed"]:
        out.append("failed trials:")
        out += [f"  trial {f['number']}: {f['error']}" + (f"; retried as {f['retried_by']}" if f["retried_by"] else "")
                for f in report["failed"]]
    return "\n".join(out) + "\n"


def _decision(p: dict[str, Any]) -> str:
    """``validation 3 (epoch 3, step 30, val_loss 0.2) by MedianPruner (median at that validation over ...)``."""
    others = p["others_at_validation"]
    if p["reason"]:
        why = f": {p['reason']}"
    elif others["n"]:
        trials = "trial" if others["n"] == 1 else "trials"
        why = f" (median at that validation over the {others['n']} {trials} {others['basis']}: {others['median']:.6g})"
    else:
        why = f" (no trial {others['basis']} had reached that validation)"
    best = p.get("best_so_far")
    best_shown = f"; best so far {_short(best)}" if best is not None and best != p["value"] else ""
    at = {k: p[k] for k in ("validation", "epoch", "step") if p[k] is not None}  # none in an older study
    shown = validation_label(at, f"{p['monitor']} {_short(p['value'])}{best_shown}", last_step=p["optuna_step"])
    return f"{shown} by {p['pruner']}{why}"


def _cmd_report(args: argparse.Namespace) -> int:
    import optuna

    from fsmtrain.app.hpo.storage import StorageError, open_storage, parse_storage, pick_study

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        spec = parse_storage(storage_arg(args.storage), "STUDY_OR_STORAGE")
        storage = open_storage(spec, create=False)
        name = pick_study(storage, args.study, spec.shown)
    except StorageError as exc:
        print(f"fsmtrain hpo-report: {exc}", file=sys.stderr)
        return 2
    study = optuna.load_study(study_name=name, storage=storage)
    report = study_report(study, spec.shown, top=args.top)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        sys.stdout.write(render(report))
    return 0


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain hpo-report`` to the ``fsmtrain`` parser."""
    p = subparsers.add_parser(
        "hpo-report", help="what a study found: counts, best and top trials, importances, edges, pruning",
        description="Report an Optuna study from its storage: a study folder, a .db or journal file, or a URL.")
    p.add_argument("storage", metavar="STUDY_OR_STORAGE",
                   help="runs/<project>/<study>, a study.db / study.journal file, or a database URL")
    p.add_argument("--study", metavar="NAME", help="the study, when the storage holds several")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="list the K best trials (default 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_report)
