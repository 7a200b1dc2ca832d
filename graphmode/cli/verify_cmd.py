"""`graphmode verify`: graph vs eager for every bucket; on a mismatch, bisect to the pass and
node that introduced it, and with --fix print the recipe change that removes it."""
from __future__ import annotations

import copy
import difflib
import json
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import KbPath, kb_file, recipe_or_draft
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import GraphmodeNotice
from graphmode.progress import stage
from graphmode.recipe.buckets import all_buckets, bucket_for, dim_buckets, dim_range
from graphmode.verify.eager import run_reference
from graphmode.verify.bisect import top1_cell


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


def inside_shape(rec, env: dict[str, int]) -> dict[str, int] | None:
    """The smallest request that maps to bucket `env`: padded along every dim that can be."""
    per_dim = dim_buckets(rec)
    out = {}
    for d, v in env.items():
        lo, _ = dim_range(rec.dims[d])
        below = [b for b in per_dim[d] if b < v]
        out[d] = max(lo, (max(below) + 1) if below else lo)
    return None if out == env else out


def verify_cases(rec, buckets: list[dict[str, int]]) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(request shape, bucket) pairs: each bucket filled exactly, a shape strictly inside it (the
    padding path), and the smallest admissible shape."""
    cases = []
    for env in buckets:
        cases.append((dict(env), dict(env)))
        inside = inside_shape(rec, env)
        if inside is not None:
            cases.append((inside, dict(env)))
    smallest = {d: dim_range(spec)[0] for d, spec in rec.dims.items()}
    bucket = bucket_for(rec, smallest)
    if bucket is not None and all((smallest, bucket) != c for c in cases):
        cases.append((smallest, bucket))
    return cases


@app.command("verify")
def verify_cmd(
    model: str = typer.Option(..., "--model"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="default: the recipe graphmode.compile would draft"),
    max_buckets: Optional[int] = typer.Option(None, "--max-buckets", help="check only the first N buckets"),
    seed: int = typer.Option(0, "--seed"),
    fix: bool = typer.Option(False, "--fix", help="propose the recipe change that removes a mismatch"),
    cache_dir: Optional[Path] = CacheDir,
    kb: Optional[Path] = KbPath,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check graph mode against eager PyTorch in every bucket, filled exactly and padded
    (fp32: rel L2 < 1e-5); on a mismatch, bisect to the pass and node that introduced it."""
    from graphmode.kb.record import record_verify
    from graphmode.paths import cache_layout
    from graphmode.recipe import pick_target
    from graphmode.recipe.fixes import propose_fix

    rec = recipe_or_draft(recipe, model, lambda text: err_console.print(text, markup=False, highlight=False,
                                                                        soft_wrap=True))
    mode = "graph" if rec.exe_mode == "eager" else rec.exe_mode
    proved_on = pick_target(rec, None, cache_dir=cache_layout(cache_dir).targets)   # the recipe's default target
    buckets = all_buckets(rec)[:max_buckets] if max_buckets else all_buckets(rec)
    contract = None
    with ExitStack() as stack:
        on_stage = stack.enter_context(progress())
        if rec.parallel is not None and rec.parallel.tensor > 1:
            cm, results, failure = _verify_ranks(model, rec, proved_on, mode, buckets, seed=seed,
                                                 cache_dir=cache_dir, stack=stack, on_stage=on_stage)
            src = cm.source
        else:
            cm, src, contract, results, failure = _verify_plans(model, rec, proved_on, mode, buckets, seed=seed,
                                                                cache_dir=cache_dir, stack=stack, on_stage=on_stage)
    if failure and fix:
        change = propose_fix(rec, failure["divergence"])
        failure["fix"] = change
        failure["diff"] = "" if not change else recipe_diff_text(recipe, change) if recipe is not None else \
            yaml.safe_dump(change, sort_keys=False)      # a drafted recipe: the change to make in its file
    ok = failure is None
    # (a rank group's shards are in its processes: the knowledge base describes one process's plans)
    note = record_verify(kb_file(kb, cache_dir), cm, proved_on, results, failure) if contract is not None else None
    if note:
        err_console.print(f"warning: {note}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        d = {"model": model, "recipe": rec.name, "ok": ok, "cases": results,
             "contract": contract.to_json() if contract is not None else None}
        if failure:
            dv = failure["divergence"]
            d["failure"] = {"bucket": failure["bucket"], "shape": failure["shape"], "stage": dv.stage,
                            "pass": dv.pass_name, "node": dv.node, "op": dv.op, "rel_l2": dv.rel_l2,
                            "fix": failure.get("fix"), "diff": failure.get("diff")}
        print(json.dumps(_finite_json(d), indent=2, default=str))
    else:
        _print_verdict(model, rec, src, contract, buckets, results, failure, fix)
    raise typer.Exit(0 if ok else 1)


def _verify_plans(model, rec, proved_on, mode, buckets, *, seed, cache_dir, stack, on_stage):
    """Every case through this process's plans; a mismatch is bisected to a pass or an instruction."""
    import torch.utils._pytree as pytree

    from graphmode.compiler import lower_model
    from graphmode.runtime.compiled import CompiledModel
    from graphmode.verify.bisect import (Divergence, bisect, bisect_plan, checked_precision, compare_outputs,
                                         logit_outputs, output_labels, reference_divergence)

    low = lower_model(model, rec, proved_on, mode=mode, keep_snapshots=True, on_stage=on_stage,
                      cache_dir=cache_dir)
    src, graph, opt, contract = low.source, low.graph, low.optimize_report, low.verdict
    cm = CompiledModel(src, rec, None, low.captured, graph, (low.capture_report, opt), mode=mode,
                       cache_dir=cache_dir, verdict=contract)
    results = []
    failure = None
    cases = verify_cases(rec, buckets)
    checking = stack.enter_context(stage(on_stage, "verify", total=len(cases)))
    for shape, env in cases:
        inputs = cm.sample_inputs(shape, seed=seed)      # index inputs inside the tables they pick from
        refs = run_reference(src.reference, inputs, shape,
                             "eager PyTorch" if src.module is not None else "ONNX Runtime")
        direct = shape == env
        if direct:           # the plan itself, so a mismatch can be bisected to a pass or an instruction
            exe = cm.executable(env)
            got_map = exe.run(inputs)
            from graphmode.runtime.tail import model_outputs     # (not its input updates; its tail)
            got = model_outputs(cm, [got_map[o] for o in graph.outputs], inputs, env)
            path = "graph"
        else:                # through the runtime: pad, run the bucket's plan, slice back
            got = pytree.tree_leaves(cm(**inputs))
            path = cm.last_path.get("path", "graph")
            # the plan that ran: a value that recurred has its own (dims.D.exact_plans), eager has none
            env = dict(shape if path == "eager" else cm.last_path.get("bucket") or env)
            if path == "eager" and src.module is None:     # the fallback: ONNX Runtime as it ships
                refs = run_reference(lambda x: src.reference(x, optimized=True), inputs, shape, "ONNX Runtime")
        checks = compare_outputs(output_labels(src, graph, len(got)), got, refs, *checked_precision(rec),
                                 logits=logit_outputs(graph, len(got)))
        ok = len(got) == len(refs) and all(c.ok for c in checks)
        results.append({"shape": shape, "bucket": env, "path": path, "ok": ok,
                        "outputs": [c.to_json() for c in checks]})
        if not ok and failure is None:
            flipped = [c for c in checks if c.rel_l2 <= c.tolerance and not c.ok and not c.vacuous]
            div = reference_divergence(checks)       # eager NaN/inf throughout: nothing to bisect
            if div is None and flipped:          # within the error bound, but the rounding moved a confident top-1
                t1 = flipped[0].top1
                div = Divergence("quantize_weights", None, None, flipped[0].rel_l2, "weights",
                                 {"weights": rec.precision.weights, "flips": t1.flips, "positions": t1.positions})
            elif div is None and direct:
                tol = max(c.tolerance for c in checks)
                with stage(on_stage, "bisect", detail=cm.bucket_key(env)):
                    div = bisect(opt.snapshots, inputs, refs, tol)
                    if div is None:
                        div = bisect_plan(graph, exe, inputs, tol)
            elif div is None:
                div = Divergence(None, None, None, max(c.rel_l2 for c in checks), "padding",
                                 {"shape": shape, "bucket": env})
            failure = {"bucket": env, "shape": shape, "divergence": div}
        checking.step(f"{cm.bucket_key(shape)} in bucket {cm.bucket_key(env)}: {'ok' if ok else 'MISMATCH'}")
    nan_model = failure is not None and failure["divergence"].stage == "reference"   # decoding it says nothing more
    if rec.memory.kv_cache is not None and src.module is not None and not nan_model:   # a decoder: its decode steps
        with stage(on_stage, "verify decode", detail="greedy steps against eager"):
            row, div = _verify_decode(cm, rec, seed)
        results.append(row)
        if div is not None and failure is None:
            failure = {"bucket": row["bucket"], "shape": row["shape"], "divergence": div}
    return cm, src, contract, results, failure


def _finite_json(v):
    """`v` with every non-finite float as text ("inf", "nan"): JSON has no Infinity, and strict parsers
    (Go, JavaScript, Python's with parse_constant) refused a rel L2 of Infinity."""
    if isinstance(v, float) and v != v or isinstance(v, float) and v in (float("inf"), float("-inf")):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_json(x) for x in v]
    return v


def _verify_decode(cm, rec, seed):
    """The decode engine's steps against eager (decode/check.py): a results row, and the divergence
    when they differ."""
    from graphmode.errors import ContractViolation
    from graphmode.verify.bisect import Divergence
    from graphmode.decode.check import check_decode
    try:
        d = check_decode(cm, rec, seed=seed)
    except ContractViolation as e:          # the engine refuses a step whose logits are not finite
        kv = rec.memory.kv_cache.dtype or rec.precision.compute
        row = {"shape": {"decode": "greedy"}, "bucket": {"kv": kv}, "path": "decode", "ok": False,
               "outputs": [{"name": "decode logits", "rel_l2": float("inf"), "tolerance": None, "error": e.message}]}
        return row, Divergence(None, None, None, float("inf"), "decode", {"kv": kv, "refused": e.message})
    row = {"shape": {"prompts": "+".join(map(str, d.prompts)), "new tokens": d.steps},
           "bucket": {"kv": d.kv_dtype}, "path": "decode", "ok": d.ok, "outputs": [d.to_json()]}
    if d.ok:
        return row, None
    return row, Divergence(None, None, None, d.rel_l2, "decode",
                           {"kv": d.kv_dtype, "prompt": d.worst_prompt, "step": d.worst_step,
                            "flips": d.top1.flips if d.top1 is not None else 0, "tolerance": d.tolerance})


def _verify_ranks(model, rec, proved_on, mode, buckets, *, seed, cache_dir, stack, on_stage):
    """A tensor-parallel recipe: every case through its rank group (rank 0 answers), against
    eager in this process. No bisection runs across ranks (each holds its own shard): a
    mismatch names the group, and a narrow wire (comm.dtype) is what --fix widens."""
    import torch.utils._pytree as pytree

    from graphmode.compiler import compile as gm_compile
    from graphmode.verify.bisect import (Divergence, checked_precision, compare_outputs, output_labels,
                                         reference_divergence)

    tp = gm_compile(model, rec, proved_on, mode=mode, cache_dir=cache_dir, on_stage=on_stage)
    stack.callback(tp.close)
    src = tp.source
    compute, weights = checked_precision(rec)
    results, failure = [], None
    cases = verify_cases(rec, buckets)
    checking = stack.enter_context(stage(on_stage, "verify", total=len(cases)))
    for shape, env in cases:
        inputs = tp.sample_inputs(shape, seed=seed)
        refs = run_reference(src.reference, inputs, shape, "eager PyTorch" if src.module is not None else "ONNX Runtime")
        got = pytree.tree_leaves(tp(**inputs))
        path = tp.last_path.get("path", "graph")
        env = dict(shape if path == "eager" else tp.last_path.get("bucket") or env)
        if path == "eager" and src.module is None:     # the fallback: ONNX Runtime as it ships
            refs = run_reference(lambda x: src.reference(x, optimized=True), inputs, shape, "ONNX Runtime")
        checks = compare_outputs(output_labels(src, None, len(got)), got, refs, compute, weights)
        ok = len(got) == len(refs) and all(c.ok for c in checks)
        results.append({"shape": shape, "bucket": env, "path": path, "ok": ok, "outputs": [c.to_json() for c in checks]})
        if not ok and failure is None:
            worst = max((c.rel_l2 for c in checks), default=float("inf"))
            flipped = next((c for c in checks if c.rel_l2 <= c.tolerance and not c.ok and not c.vacuous), None)
            div = reference_divergence(checks)
            if div is None and flipped is not None and weights == rec.precision.weights != "f32":   # their rounding
                div = Divergence("quantize_weights", None, None, flipped.rel_l2, "weights",
                                 {"weights": weights, "flips": flipped.top1.flips, "positions": flipped.top1.positions})
            elif div is None:
                div = Divergence(None, None, None, worst, "parallel",
                                 {"ranks": rec.parallel.tensor, "comm": rec.parallel.comm.dtype})
            failure = {"bucket": env, "shape": shape, "divergence": div}
        key = ",".join(f"{k}={v}" for k, v in sorted(shape.items()))
        checking.step(f"{key} on {rec.parallel.tensor} ranks: {'ok' if ok else 'MISMATCH'}")
    nan_model = failure is not None and failure["divergence"].stage == "reference"
    if rec.memory.kv_cache is not None and src.module is not None and not nan_model:
        # a decoder's ranks decode through a group of their own (paged graphs, KV pools split by heads):
        # the forward group is stopped first, so the two never hold the machine's memory together
        from graphmode.api import compile as decoding_compile
        tp.close()
        with stage(on_stage, "verify decode", detail=f"greedy steps on {rec.parallel.tensor} ranks against eager"):
            dec = decoding_compile(model, rec, proved_on, cache_dir=cache_dir, on_stage=on_stage)
            stack.callback(dec.close)
            row, div = _verify_decode(dec, rec, seed)
        results.append(row)
        if div is not None and failure is None:
            failure = {"bucket": row["bucket"], "shape": row["shape"], "divergence": div}
    return tp, results, failure


def _print_verdict(model, rec, src, contract, buckets, results, failure, fix) -> None:
    from graphmode.cli.compile_cmd import print_contract
    from graphmode.verify.bisect import checked_precision
    if contract is not None:
        print_contract(contract)
    else:
        console.print(f"tensor parallel: {rec.parallel.tensor} ranks, the wire in {rec.parallel.comm.dtype}; "
                      "every request through the rank group (rank 0 answers)", markup=False, highlight=False)
    weights = checked_precision(rec)[1]
    narrowed = f"{weights} weights" if weights == rec.precision.weights else f"the {weights} wire (parallel.comm.dtype)"
    ref = "eager" if src.module is not None else "ONNX Runtime"      # what an ONNX file is checked against
    t = Table(title=f"graph vs {ref}: {model} with {rec.name} ({len(buckets)} buckets, {len(results)} shapes)")
    narrow = weights != "f32"     # then logits are also judged on top-1 agreement
    for c in ("request", "bucket", "path", "worst rel L2", "tolerance") + (("top-1 agree",) if narrow else ()) + (
            "ok",):
        t.add_column(c, overflow="fold")
    for r in results:
        worst = max(r["outputs"], key=lambda o: o["rel_l2"]) if r["outputs"] else {"rel_l2": float("inf"),
                                                                                 "tolerance": 0.0}
        row = [",".join(f"{k}={v}" for k, v in r["shape"].items()),
               "- (no plan)" if r["path"] == "eager" else ",".join(f"{k}={v}" for k, v in r["bucket"].items()),
               r["path"], f"{worst['rel_l2']:.2e}",
               "-" if worst["tolerance"] is None else f"{worst['tolerance']:.0e}"]
        if narrow:
            # logits only: a top-1 over a hidden state's features (BERT's last_hidden_state) means nothing
            top = [o["top1"] for o in r["outputs"] if (o.get("top1") or {}).get("judged")]
            low = min(top, key=lambda t: t["share"]) if top else None
            row.append(top1_cell(low) if low else "- (no logits)")
        t.add_row(*row, "yes" if r["ok"] else "[red]NO[/]")
    console.print(t)
    partial = sorted({f"{o['name']!r}" for r in results for o in r["outputs"]
                      if o.get("eager_nonfinite") and o["eager_nonfinite"]["count"] < o["eager_nonfinite"]["of"]})
    if partial:
        warnings.warn(GraphmodeNotice(
            f"eager's own output(s) {', '.join(partial)} hold NaN or inf values: there the check asks only that "
            "graphmode's are NaN or the same inf too, and the rel L2 covers the finite values (--json: "
            "eager_nonfinite per output)"), stacklevel=1)
    if failure:
        what = "nothing verified" if failure["divergence"].stage == "reference" else "mismatch"
        console.print(f"[red]{what}[/] at request {failure['shape']} (bucket {failure['bucket']}): "
                      f"{failure['divergence'].describe()}")
        if fix:
            if failure.get("diff"):
                console.print("proposed recipe change:")
                console.print(failure["diff"], markup=False, highlight=False)
            elif failure["divergence"].stage == "reference":
                console.print("no recipe change can: the model's own outputs are not finite")
            else:
                console.print("no recipe change is known to remove it; this is a graphmode bug — report it")
    else:
        judged = any((o.get("top1") or {}).get("judged") for r in results for o in r["outputs"])
        top1 = (f"; {narrowed}: no logit position's top-1 that the f32 model decided "
                "(led by more than the rounding noise, or by 4:1 or more) changed" if judged else
                f"; {narrowed}: within the weight-only error bound, "
                "and no top-1 check ran (only logits are judged on their decisions: an output named logits, or "
                "as wide as the model's token table; name a classifier's output logits, e.g. return "
                "{'logits': y})")
        eager = sum(r["path"] == "eager" for r in results)
        console.print(f"all shapes match {ref} within tolerance (every bucket filled, padded, and the "
                      "smallest admissible shape)" + (top1 if narrow else ""))
        if eager:
            console.print(f"{eager} of {len(results)} request(s) ran eagerly, where the contract sends them (no "
                          "plan holds those shapes): their rows compare the reference with itself, as it "
                          "ships, and check nothing graphmode compiled", markup=False, highlight=False)
