"""A suite run as JSON (every case) and as Markdown (date, versions, counts per class, per op).

`publish` puts the Markdown of one suite between its markers in a document (e.g.
docs/conformance.md), so each suite's section is regenerated without touching the others.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

from graphmode.conformance.runner import OUTCOMES, CaseResult, SuiteRun

REASON_CHARS = 110


def to_json(run: SuiteRun) -> dict:
    return {"suite": run.suite, "title": run.title, "date": run.date, "versions": run.versions,
            "total_cases": run.total_cases, "sample": run.sample, "timeout_s": run.timeout_s,
            "subsets": run.subsets, "others": list(run.others), "counts": run.counts(),
            "cases": [r.to_json() for r in run.results]}


def from_json(d: dict) -> SuiteRun:
    return SuiteRun(suite=d["suite"], title=d["title"], date=d["date"], versions=d["versions"],
                    results=[CaseResult.from_json(c) for c in d["cases"]], total_cases=d["total_cases"],
                    sample=d.get("sample"), timeout_s=d.get("timeout_s", 0.0), subsets=d.get("subsets", {}),
                    others=tuple(d.get("others", ())))


def load(path: str | Path) -> SuiteRun:
    return from_json(json.loads(Path(path).read_text()))


def write(run: SuiteRun, out_dir: str | Path) -> tuple[Path, Path]:
    """<out_dir>/<suite>.json and <suite>.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{run.suite}.json", out / f"{run.suite}.md"
    js.write_text(json.dumps(to_json(run), indent=1) + "\n")
    md.write_text(markdown(run))
    return js, md


def _pct(k: int, n: int) -> str:
    return f"{k} ({100 * k / n:.0f}%)" if n else "0"


def _row(label: str, results: Sequence[CaseResult], others: Sequence[str], reason: bool = False) -> str:
    n = len(results)
    c = Counter(r.outcome for r in results)
    cells = [label, str(n), _pct(c["pass"], n)] + [str(c[o]) for o in OUTCOMES[1:]]
    for o in others:            # over the cases the other engine was judged on (it may run on a sample)
        judged = [r for r in results if o in r.others]
        cells.append(_pct(sum(r.others[o] == "pass" for r in judged), len(judged)) + (
            f" of {len(judged)}" if judged and len(judged) != n else "") if judged else "-")
    if reason:
        cells.append(_reason(results))
    return "| " + " | ".join(cells) + " |"


def _reason(results: Sequence[CaseResult]) -> str:
    """The most frequent refusal (or failure) detail of these cases, shortened."""
    bad = [r.detail for r in results if r.outcome != "pass" and r.detail]
    if not bad:
        return ""
    text, _ = Counter(bad).most_common(1)[0]
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def _header(first: str, others: Sequence[str], reason: bool = False) -> list[str]:
    cols = [first, "cases", "pass"] + list(OUTCOMES[1:]) + [f"{o} pass" for o in others]
    if reason:
        cols.append("most common reason (not pass)")
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def markdown(run: SuiteRun) -> str:
    """The section published for one run: summary rows (all cases, then each subset), every case
    that is wrong, crashes or hangs, then the per-op table."""
    scope = (f"a sample of {len(run.results)} of {run.total_cases} cases" if run.sample is not None
             else f"all {len(run.results)} of {run.total_cases} cases" if len(run.results) != run.total_cases
             else f"all {run.total_cases} cases")
    lines = [f"### {run.title}", "",
             f"Run {run.date}: {scope}, per-case timeout {run.timeout_s:g} s. "
             + ", ".join(f"{k} {v}" for k, v in run.versions.items()) + ".", ""]
    lines += _header("subset", run.others)
    lines.append(_row("all", run.results, run.others))
    for tag, label in run.subsets.items():
        sub = [r for r in run.results if tag in r.tags]
        if sub:
            lines.append(_row(label, sub, run.others))
    bad = [r for r in run.results if r.outcome in ("wrong", "crash", "hang")]
    lines += ["", f"Wrong answers, crashes and hangs: {len(bad) or 'none'}."]
    if bad:
        lines.append("")
        lines += [f"- `{r.id}` ({r.op}): **{r.outcome}**: {r.detail.replace('|', '/')}" for r in bad]
    by_op: dict[str, list[CaseResult]] = defaultdict(list)
    for r in run.results:
        by_op[r.op].append(r)
    lines += ["", "<details><summary>Per op</summary>", ""]
    lines += _header("op", run.others, reason=True)
    lines += [_row(op, by_op[op], run.others, reason=True) for op in sorted(by_op, key=str.lower)]
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def _markers(suite: str) -> tuple[str, str]:
    return f"<!-- conformance:{suite}:begin -->", f"<!-- conformance:{suite}:end -->"


def publish(run: SuiteRun, doc: str | Path) -> Path:
    """Replace (or append) this suite's section of `doc` with the run's Markdown."""
    path = Path(doc)
    text = path.read_text() if path.exists() else "# Conformance\n"
    begin, end = _markers(run.suite)
    block = f"{begin}\n{markdown(run).rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    return path
