"""`graphmode verify`: graph vs eager for every bucket; on a mismatch, bisect to the pass and
node that introduced it, and with --fix print the recipe change that removes it."""
from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.table import Table

from graphmode.cli.app import app, console


def _merge(base: dict, change: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in change.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def recipe_diff_text(path: str, change: dict) -> str:
    raw = yaml.safe_load(Path(path).read_text())
    new = _merge(raw, change)
    a = yaml.safe_dump(raw, sort_keys=False).splitlines(keepends=True)
    b = yaml.safe_dump(new, sort_keys=False).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, fromfile=path, tofile=f"{path} (fixed)"))


@app.command("verify")
def verify_cmd(
    model: str = typer.Option(..., "--model"),
    recipe: str = typer.Option(..., "--recipe"),
    max_buckets: Optional[int] = typer.Option(None, "--max-buckets", help="check only the first N buckets"),
    seed: int = typer.Option(0, "--seed"),
    fix: bool = typer.Option(False, "--fix", help="propose the recipe change that removes a mismatch"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check graph mode against eager PyTorch in every bucket (fp32: rel L2 < 1e-5)."""
    from graphmode.compiler import capture, optimize
    from graphmode.recipe import load_recipe
    from graphmode.runtime.compiled import CompiledModel
    from graphmode.verify.bisect import bisect, bisect_plan, compare_outputs, propose_fix

    rec = load_recipe(recipe)
    graph0, cap, src = capture(model, rec)
    graph, opt = optimize(graph0, rec, None, buckets=[], keep_snapshots=True)
    cm = CompiledModel(src, rec, None, graph0, graph, (cap, opt), mode="hybrid" if cap.fallbacks else "graph")
    buckets = rec.buckets()
    if max_buckets:
        buckets = buckets[:max_buckets]
    results = []
    failure = None
    for env in buckets:
        inputs = src.make_inputs(env, seed=seed)
        refs = src.reference(inputs)
        exe = cm.executable(env)
        got = exe.run(inputs)
        checks = compare_outputs(list(graph.outputs), [got[o] for o in graph.outputs], refs, rec.precision.compute)
        ok = all(c.ok for c in checks)
        results.append({"bucket": env, "ok": ok,
                        "outputs": [{"name": c.name, "rel_l2": c.rel_l2, "tolerance": c.tolerance} for c in checks]})
        if not ok and failure is None:
            tol = max(c.tolerance for c in checks)
            div = bisect(opt.snapshots, inputs, refs, tol)
            if div is None:
                div = bisect_plan(graph, exe, inputs, tol)
            failure = {"bucket": env, "divergence": div}
    if failure and fix:
        change = propose_fix(rec, failure["divergence"])
        failure["fix"] = change
        failure["diff"] = recipe_diff_text(recipe, change) if change else ""
    ok = failure is None
    if as_json:
        d = {"model": model, "recipe": rec.name, "ok": ok, "buckets": results}
        if failure:
            dv = failure["divergence"]
            d["failure"] = {"bucket": failure["bucket"], "stage": dv.stage, "pass": dv.pass_name, "node": dv.node,
                            "op": dv.op, "rel_l2": dv.rel_l2, "fix": failure.get("fix"), "diff": failure.get("diff")}
        print(json.dumps(d, indent=2, default=str))
    else:
        t = Table(title=f"graph vs eager: {model} with {rec.name} ({len(results)} buckets)")
        for c in ("bucket", "worst rel L2", "tolerance", "ok"):
            t.add_column(c)
        for r in results:
            worst = max(r["outputs"], key=lambda o: o["rel_l2"])
            t.add_row(",".join(f"{k}={v}" for k, v in r["bucket"].items()), f"{worst['rel_l2']:.2e}",
                      f"{worst['tolerance']:.0e}", "yes" if r["ok"] else "[red]NO[/]")
        console.print(t)
        if failure:
            console.print(f"[red]mismatch[/] at bucket {failure['bucket']}: {failure['divergence'].describe()}")
            if fix:
                if failure.get("diff"):
                    console.print("proposed recipe change:")
                    console.print(failure["diff"], markup=False, highlight=False)
                else:
                    console.print("no recipe change is known to remove it; this is a graphmode bug — report it")
        else:
            console.print("all buckets match eager within tolerance")
    raise typer.Exit(0 if ok else 1)
