"""``hpsweep report DIR``: one self-contained HTML page about a finished (or running) sweep.

The page is built from what every backend leaves on disk (``run-*/trial.json``, ``best_run.json``),
so Optuna, Ray and W&B sweeps are reported alike: the records become an in-memory Optuna study
and Optuna's plotly visualisations draw it: optimisation history, parameter importances,
parallel coordinates and intermediate values (the curves of pruned trials), followed by the
trial table and the best run. plotly.js is inlined once; the page needs no network.

    >>> write_report(Path("out"))
    PosixPath('out/report.html')
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.stopping import last_line
from hpsweep.search.warm_start import read_taken
from hpsweep.train.metrics import SPEED_SUFFIXES

REPORT_FILE = "report.html"
_STATES = {"complete": "COMPLETE", "pruned": "PRUNED", "failed": "FAIL", "stopped": "FAIL"}


def write_report(output_dir: Path, path: Path | None = None, *, name: str | None = None) -> Path:
    """Write the report of the sweep in ``output_dir`` (atomically) and return its path.

    ``name``: the sweep's home as the page names it (an object-store URL whose records were
    downloaded to ``output_dir``); default: the folder's absolute path.
    """
    records = runs.read_trials(output_dir)
    if not records:
        raise UserError(
            f"{name or output_dir}: no trials found (no run-*/trial.json); give the --output-dir of a sweep"
        )
    best = runs.read_best(output_dir)
    page = render(
        name or str(output_dir.resolve()),
        records,
        best,
        read_taken(output_dir),
        stopped=last_line(output_dir, records),
    )
    path = path or output_dir / REPORT_FILE
    runs.write_text(path, page)
    return path


# --- records -> an Optuna study ------------------------------------------------------------------------


def build_study(records: Sequence[runs.TrialRecord]) -> Any:
    """An in-memory Optuna study holding ``records`` (running trials are left out)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    directions = records[0].directions
    study = optuna.create_study(directions=directions, study_name="hpsweep-report")
    distributions = infer_distributions(records)
    for r in records:
        state = _STATES.get(r.state)
        if state is None:
            continue
        values = None
        if state == "COMPLETE" and r.objective is not None:
            values = r.objective if isinstance(r.objective, list) else [r.objective]
        elif state == "COMPLETE":
            state = "FAIL"
        params = {k: _plain(v) for k, v in r.params.items() if k in distributions}
        study.add_trial(
            optuna.trial.create_trial(
                state=getattr(optuna.trial.TrialState, state),
                values=values,
                params=params,
                distributions={k: distributions[k] for k in params},
                intermediate_values=intermediate_values(r) if len(directions) == 1 else None,
                user_attrs={"run": Path(r.run_dir).name, "hpsweep_number": r.number},
            )
        )
    return study


def infer_distributions(records: Sequence[runs.TrialRecord]) -> dict[str, Any]:
    """A distribution per param, from the values the trials took (the space is not on disk for
    every backend): ints -> IntDistribution, floats -> FloatDistribution (log when they span
    two orders of magnitude), anything else -> CategoricalDistribution."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    seen: dict[str, list[Any]] = {}
    for r in records:
        for k, v in r.params.items():
            seen.setdefault(k, []).append(_plain(v))
    out: dict[str, Any] = {}
    for name, values in seen.items():
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(values) and all(isinstance(v, int) for v in values):
            out[name] = IntDistribution(min(values), max(values))
        elif len(numbers) == len(values) and all(math.isfinite(v) for v in values):
            low, high = float(min(values)), float(max(values))
            out[name] = FloatDistribution(low, high, log=low > 0 and high / low >= 100)
        else:
            out[name] = CategoricalDistribution(sorted(set(values), key=repr))
    return out


def intermediate_values(record: runs.TrialRecord) -> dict[int, float]:
    """The objective at each evaluation, by training step (what the pruner saw)."""
    name = record.objective_name
    return {
        int(h["step"]): float(h[name])
        for h in record.history
        if isinstance(h.get(name), (int, float)) and "step" in h and math.isfinite(h[name])
    }


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


# --- the page --------------------------------------------------------------------------------------------


def figures(study: Any, objective_name: str) -> list[tuple[str, str, Any]]:
    """``(id, title, figure or a reason it could not be drawn)`` for each plot."""
    from optuna import visualization as vis

    multi = len(study.directions) > 1
    target: Callable | None = (lambda t: t.values[0]) if multi else None
    name = f"{objective_name} (first)" if multi else objective_name
    plots: list[tuple[str, str, Callable[[], Any]]] = []
    if multi:
        plots.append(("pareto-front", "Pareto front", lambda: vis.plot_pareto_front(study)))
    else:
        plots.append(
            (
                "history",
                "Optimisation history",
                lambda: vis.plot_optimization_history(study, target_name=name),
            )
        )
    plots += [
        (
            "importances",
            "Parameter importances",
            lambda: vis.plot_param_importances(study, target=target, target_name=name),
        ),
        (
            "parallel",
            "Parallel coordinates",
            lambda: vis.plot_parallel_coordinate(study, target=target, target_name=name),
        ),
    ]
    if not multi:
        plots.append(
            (
                "intermediate",
                "Intermediate values (pruned trials stop early)",
                lambda: vis.plot_intermediate_values(study),
            )
        )
    out = []
    for pid, title, make in plots:
        try:
            out.append((pid, title, _why_not(pid, study) or make()))
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            out.append((pid, title, f"not drawn: {exc}"))
    return out


def _why_not(pid: str, study: Any) -> str | None:
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    if pid == "importances":
        varied = (
            [
                k
                for k in study.trials[0].distributions
                if len({str(t.params.get(k)) for t in complete}) > 1
            ]
            if study.trials
            else []
        )
        if len(complete) < 2 or not varied:
            return "not drawn: parameter importances need at least 2 complete trials whose params differ"
    if pid in ("history", "parallel", "pareto-front") and not complete:
        return "not drawn: no trial completed yet"
    if pid == "intermediate" and not any(t.intermediate_values for t in study.trials):
        return "not drawn: no trial reported intermediate values"
    return None


def render(
    home: str,
    records: Sequence[runs.TrialRecord],
    best: Any,
    taken: dict[str, Any] | None = None,
    *,
    stopped: str | None = None,
) -> str:
    """The page; ``taken``: the sweep's warm start (`hpsweep.search.warm_start.read_taken`),
    whose trials the table lists after the sweep's own, marked, and the plots leave out;
    ``stopped``: the line saying why a stopping rule ended the sweep
    (`hpsweep.search.stopping.last_line`)."""
    study = build_study(records)
    objective_name = records[0].objective_name
    sections, first = [], True
    for pid, title, fig in figures(study, objective_name):
        if isinstance(fig, str):
            body = f'<p class="note">{html.escape(fig)}</p>'
        else:
            fig.update_layout(title=None, margin={"t": 30}, height=460)
            body = fig.to_html(
                full_html=False,
                include_plotlyjs=first,
                div_id=f"plot-{pid}",
                config={"displaylogo": False},
            )
            first = False
        sections.append(
            f'<section id="{pid}" class="plot"><h2>{html.escape(title)}</h2>{body}</section>'
        )
    counts = {s: sum(r.state == s for r in records) for s in runs.STATES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    backend = records[0].backend
    return _PAGE.format(
        title=html.escape(f"hpsweep report: {home.rstrip('/').rsplit('/', 1)[-1]}"),
        heading=html.escape(f"Sweep {home}"),
        summary=html.escape(
            f"{len(records)} trials ({summary}); backend {backend}; objective {objective_name} "
            f"({', '.join(records[0].directions)}); written {time.strftime('%Y-%m-%d %H:%M')}"
            + (f"; warm-started from {taken['home']}" if taken else "")
            + (f". {stopped.removeprefix('hpsweep: ')}" if stopped else "")
        ),
        best=best_html(best),
        plots="\n".join(sections),
        table=trial_table(records, best) + warm_table(taken, records),
    )


def best_html(best: Any) -> str:
    if not best:
        return '<p class="note">No trial completed: there is no best run yet.</p>'
    items = best if isinstance(best, list) else [best]
    parts = []
    for b in items:
        metrics = {
            k: v
            for k, v in (b.run_summary.get("metrics") or {}).items()
            if not k.endswith(SPEED_SUFFIXES)
        }
        rows = "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
            for k, v in [*b.hyperparameters.items(), *metrics.items()]
        )
        parts.append(
            f"<h3>{html.escape(Path(b.run_dir).name)} (trial {b.run_summary.get('number', '?')}): "
            f"{html.escape(str(b.run_summary.get('objective_name', 'objective')))} = "
            f'{html.escape(_fmt(b.objective))}</h3><table class="kv">{rows}</table>'
            f"<p>checkpoint: <code>{html.escape(str(b.checkpoint))}</code></p>"
        )
    return "".join(parts)


def trial_table(records: Sequence[runs.TrialRecord], best: Any) -> str:
    best_ids = {b.run_id for b in (best if isinstance(best, list) else [best] if best else [])}
    names = sorted({k for r in records for k in r.params})
    head = "".join(
        f"<th>{html.escape(h)}</th>"
        for h in ["#", "run", "state", records[0].objective_name, *names, "evaluations", "time"]
    )
    rows = []
    for r in records:
        cells = [
            str(r.number),
            Path(r.run_dir).name + (" ★" if r.id in best_ids else ""),
            r.state,
            _fmt(r.objective),
            *(_fmt(r.params.get(k, "")) for k in names),
            str(len(r.history)),
            f"{r.duration_s:.1f}s" if r.duration_s is not None else "",
        ]
        css = f' class="{r.state}{" best" if r.id in best_ids else ""}"'
        rows.append(f"<tr{css}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f'<table class="trials"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def warm_table(taken: dict[str, Any] | None, records: Sequence[runs.TrialRecord]) -> str:
    """The warm start's trials (``--warm-start``): given to the search as evaluated, never run here."""
    if not taken or not taken["trials"]:
        return ""
    names = sorted({k for t in taken["trials"] for k in t["params"]})
    head = "".join(
        f"<th>{html.escape(h)}</th>"
        for h in ["earlier #", "state", records[0].objective_name, *names, "evaluations"]
    )
    rows = []
    for t in taken["trials"]:
        cells = [
            str(t["number"]),
            t["state"],
            _fmt(t["value"]),
            *(_fmt(t["params"].get(k, "")) for k in names),
            str(len(t["intermediate"])),
        ]
        row = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        rows.append(f'<tr class="warm">{row}</tr>')
    caption = (
        f"Warm start: {len(rows)} trials of {taken['home']}, given to the search as evaluated "
        f"({taken['outside']} of its {taken['of']} lay outside this space)"
    )
    return (
        f"<h3>{html.escape(caption)}</h3>"
        f'<table class="trials warm"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return json.dumps([float(f"{v:.6g}") if isinstance(v, float) else v for v in value])
    return str(value)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }}
h1 {{ font-size: 1.5em; }} h2 {{ border-bottom: 1px solid #ddd; padding-bottom: .2em; }}
table {{ border-collapse: collapse; font-size: .9em; }} td, th {{ border: 1px solid #ddd; padding: .25em .6em; }}
table.trials th {{ background: #f4f4f4; }} tr.best td {{ font-weight: bold; background: #eaf7ea; }}
tr.pruned td {{ color: #8a6d00; }} tr.warm td {{ color: #555; font-style: italic; }} tr.failed td, tr.stopped td {{ color: #b00; }}
table.kv th {{ text-align: left; background: #f8f8f8; }} .note {{ color: #777; font-style: italic; }}
</style></head>
<body>
<h1>{heading}</h1>
<p>{summary}</p>
<section id="best"><h2>Best run</h2>{best}</section>
{plots}
<section id="trials"><h2>Trials</h2>{table}</section>
</body></html>
"""
