"""`graphmode compile`: capture + passes + memory plans + proof, printed as a compile report."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import GraphmodeError
from graphmode.progress import OnStage, stage


def dump_selection(text: Optional[str], flag: str, pipeline: list[str]):
    """`--dump-ir-before/after` value -> () | "all" | {pass names}, refusing names not in the pipeline."""
    if not text:
        return ()
    if text == "all":
        return "all"
    names = {s.strip() for s in text.split(",")}
    unknown = sorted(names - set(pipeline))
    if unknown:
        raise GraphmodeError(f"no pass {', '.join(unknown)} in this recipe's pipeline", where=flag, value=text,
                             fix=f"one of: {', '.join(pipeline)}, or all")
    return names


def build_report(model: str, recipe_path: Any, target: Optional[str], *, dump_dir: Optional[Path] = None,
                 dump_before: Optional[str] = None, dump_after: Optional[str] = None, plan_buckets: bool = True,
                 cache_dir: Optional[Path] = None, on_stage: Optional[OnStage] = None):
    """The driver's result as a compile report: (report, optimized graph, recipe, source).
    `on_stage` hears capture, passes, proof and memory plans (bucket N of M)."""
    from graphmode.compile_report import bucket_memory, report_of
    from graphmode.compiler import lower_model, refuse_inconsistent
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.recipe.targets import pick_target

    recipe = load_recipe(recipe_path)
    before = dump_selection(dump_before, "--dump-ir-before", recipe.pipeline())
    after = dump_selection(dump_after, "--dump-ir-after", recipe.pipeline())
    tgt = pick_target(recipe, target, cache_dir=cache_layout(cache_dir).targets)
    refuse_inconsistent(recipe, tgt)        # as `recipe validate` and graphmode.compile refuse it
    low = lower_model(model, recipe, tgt, refuse=False, on_stage=on_stage,
                      dump_dir=dump_dir or Path("graphmode-ir-dumps"), dump_before=before, dump_after=after,
                      cache_dir=cache_dir)
    secs = {k: low.timings[k] for k in ("capture", "passes") if k in low.timings}
    memory = []
    if low.graph is not None:
        t0 = time.perf_counter()
        memory = bucket_memory(low.graph, recipe, on_stage) if plan_buckets else []
        secs["memory_plan"] = time.perf_counter() - t0
        secs["verify"] = low.timings["proof"]
    rep = report_of(low, recipe, getattr(tgt, "name", str(tgt)), memory, secs)
    return rep, (low.graph if low.graph is not None else low.captured), recipe, low.source


def print_contract(contract) -> None:
    """The verdict shared with run/verify/serve: padding per dim, refusals, restrictions."""
    if contract.padding is not None:
        for d, v in contract.padding.dims.items():
            color = {"safe": "green", "unsafe": "red", "not padded": "dim"}[v.status]
            note = " — requests off a bucket value run eagerly" if d in contract.exact_dims else ""
            console.print(f"padding {d}: [{color}]{v.status}[/]{note}")
            for f in v.findings:
                console.print(f"  {f.describe()}", markup=False, highlight=False)
    index = getattr(contract, "index", None)
    if index is not None:       # what every request is checked against before it runs (runtime/bounds.py)
        for b in [*index.inputs.values(), *index.columns.values()]:
            console.print(f"index {b.label()}: values checked in [{b.lo}, {b.hi}] ({b.describe()})", markup=False,
                          highlight=False, soft_wrap=True)
        for d, lim in index.dims.items():
            console.print(f"positions {d}: at most {lim.max} ({lim.describe()})", markup=False, highlight=False,
                          soft_wrap=True)
    for issue in contract.restrictions:
        console.print(f"[yellow]restricted[/] {issue.render()}", highlight=False, soft_wrap=True)
    for issue in contract.refusals:
        console.print(f"[red]refused[/] {issue.render()}", highlight=False, soft_wrap=True)


def _print_shard(stats: dict) -> None:
    """What the shard pass did for this rank: its collectives, and the values it gathered whole
    for an op with no rule for a split input (correct, but that op's work is not split: three
    heads over two ranks, say, run whole on every rank)."""
    if not stats:
        return
    said = ", ".join(f"{op} x{n}" for op, n in sorted(stats.get("collectives", {}).items())) or "none"
    console.print(f"tensor parallel (this rank's graph): collectives {said}", markup=False, highlight=False)
    gathered = stats.get("gathered_for", {})
    if gathered:
        console.print("  gathered whole first (no rule splits the value for these ops; they run unsplit on "
                      "every rank): " + ", ".join(f"{op} x{n}" for op, n in sorted(gathered.items())),
                      markup=False, highlight=False, soft_wrap=True)


def print_report(rep, *, max_buckets: int = 12) -> None:
    cap = rep.capture
    console.print(f"[bold]graphmode compile[/] model [cyan]{rep.model}[/] recipe [cyan]{rep.recipe_name}[/] "
                  f"#{rep.recipe_hash} target [cyan]{rep.target}[/] graph #{rep.graph_hash}")
    console.print(f"capture: {cap.source}, {sum(cap.aten_ops.values())} source ops "
                  f"({len(cap.aten_ops)} kinds) -> {rep.nodes_captured} IR nodes in {rep.seconds['capture']:.1f}s")
    if cap.fallbacks:
        # plain lines, not a table: the op name and the source line are what a fix needs, whole
        # and copyable however narrow the terminal or wherever the output is piped
        console.print(f"fallbacks (graph breaks): {sum(f.count for f in cap.fallbacks)}")
        for f in cap.fallbacks:
            console.print(f"  {f.target} x{f.count}: {f.reason}", markup=False, highlight=False, soft_wrap=True)
            console.print(f"    at {f.loc}", markup=False, highlight=False, soft_wrap=True)
    elif getattr(cap, "tail", None) is None:
        console.print("fallbacks: none (the whole model runs as one graph)")
    if getattr(cap, "tail", None) is not None:
        from graphmode.verdict import describe
        console.print(f"eager tail (sizes only the data decides, run after the plan): {len(cap.tail.nodes)} op(s), "
                      f"from {describe(cap.tail)}", markup=False, highlight=False, soft_wrap=True)
    if rep.contract is not None:
        print_contract(rep.contract)
    if rep.passes is None:
        return
    t = Table(title="passes")
    for c in ("#", "pass", "nodes before", "nodes after", "ms", "stats"):
        t.add_column(c, justify="right" if c in ("#", "nodes before", "nodes after", "ms") else "left",
                     overflow="fold")
    for i, p in enumerate(rep.passes.passes):
        stats = ", ".join(f"{k}={v}" for k, v in p.stats.items() if not isinstance(v, (dict, list)))
        t.add_row(str(i), p.name, str(p.nodes_before), str(p.nodes_after), f"{p.seconds * 1e3:.1f}", stats[:80])
    console.print(t)
    _print_shard(rep.passes.stats_of("shard"))
    from graphmode.passes.quantize_weights import weights_summary
    said = weights_summary(rep.passes.stats_of("quantize_weights"))
    if said is not None and not said[1]:           # storing none is a notice, printed as it happens
        console.print(said[0], markup=False, highlight=False, soft_wrap=True)
    if rep.fused_groups:
        kinds: dict[str, int] = {}
        for g in rep.fused_groups:
            kinds[g["kind"]] = kinds.get(g["kind"], 0) + 1
        console.print(f"fused groups: {len(rep.fused_groups)} ("
                      + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) + ")")
        shown: dict[str, int] = {}
        for g in rep.fused_groups:
            sig = f"{g['kind']}: {' + '.join(g['ops'])}"
            shown[sig] = shown.get(sig, 0) + 1
        for sig, n in sorted(shown.items(), key=lambda kv: -kv[1])[:10]:
            console.print(f"  {n:3d} x {sig}")
    if rep.memory:
        t = Table(title=f"memory plan ({len(rep.memory)} buckets)")
        for c in ("bucket", "arena MiB", "lower bound MiB", "arena / bound"):
            t.add_column(c, justify="right", overflow="fold")
        for row in memory_rows(rep.memory, max_buckets):
            t.add_row(*row)
        console.print(t)
        worst = max(rep.memory, key=lambda m: m.ratio)
        console.print(f"worst arena / lower bound: {worst.ratio:.3f} at {worst.bucket}")
    v = rep.validation
    console.print(f"verdict: [bold]{v.verdict}[/]")
    for e in v.errors:                 # a malformed recipe: each field, value and fix
        console.print(f"  error: {e}", markup=False)
    for p in v.proofs:
        console.print(f"  {p.name}: {p.status} — {p.message}", markup=False)
    console.print("time: " + ", ".join(f"{k} {s:.2f}s" for k, s in rep.seconds.items()))


def memory_rows(memory: list, most: int) -> list[tuple[str, str, str, str]]:
    """The memory table's rows: every bucket, or the first and last `most` / 2 and a row that
    says how many are left out between them (--json lists every bucket)."""
    half = most // 2
    cut = len(memory) > most
    rows = [(",".join(f"{k}={v}" for k, v in m.bucket.items()), f"{m.arena_bytes / 2**20:.2f}",
             f"{m.lower_bound_bytes / 2**20:.2f}", f"{m.ratio:.3f}")
            for m in (memory[:half] + memory[-half:] if cut else memory)]
    return rows[:half] + [(f"... {len(memory) - 2 * half} more (--json)", "", "", "")] + rows[half:] if cut else rows


@app.command("compile")
def compile_cmd(
    model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe YAML (default: the recipe graphmode.compile "
                                         "would draft, as run and verify take)"),
    target: Optional[str] = typer.Option(None, "--target", help="target name (default: the recipe's first)"),
    emit_ir: bool = typer.Option(False, "--emit-ir", help="print the optimised IR"),
    dump_ir_before: Optional[str] = typer.Option(None, "--dump-ir-before", help="PASS[,PASS] or all"),
    dump_ir_after: Optional[str] = typer.Option(None, "--dump-ir-after", help="PASS[,PASS] or all"),
    dump_dir: Path = typer.Option(Path("graphmode-ir-dumps"), "--dump-dir", help="where IR dumps go"),
    dry_run: bool = typer.Option(False, "--dry-run", help="capture, optimise and prove; build no kernels"),
    cache_dir: Optional[Path] = CacheDir,
    save: Optional[Path] = typer.Option(None, "--save", help="also build every bucket and write a deployable .gm "
                                        "artifact (recipe, graph, weights, plans, kernels) that graphmode.load() "
                                        "runs without the model's code"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable report"),
) -> None:
    """Compile a model with a recipe and print the compile report."""
    if save is not None and not dry_run:
        from graphmode.runtime.artifact import check_writable
        check_writable(save)
    if dump_ir_before or dump_ir_after:
        from graphmode.paths import writable_output
        writable_output(dump_dir, "--dump-dir", folder=True)
    from graphmode.cli.options import recipe_or_draft
    given = recipe_or_draft(recipe, model, lambda text: err_console.print(text, markup=False, highlight=False,
                                                                          soft_wrap=True))
    with progress() as on_stage:
        rep, graph, recipe_obj, src = build_report(model, given, target, dump_dir=dump_dir,
                                                   dump_before=dump_ir_before, dump_after=dump_ir_after,
                                                   cache_dir=cache_dir, on_stage=on_stage)
        if rep.contract.ok and rep.validation.ok and not dry_run:      # a refused recipe builds no plan
            built, exe = first_plan(graph, recipe_obj, cache_dir, on_stage, target=str(rep.target))
            rep.seconds["first_plan"] = built["seconds"]
        else:
            built = exe = None
    if not rep.contract.ok:
        if as_json:
            print(json.dumps(rep.to_json(), indent=2, default=str))
        else:
            print_report(rep)
        from graphmode.verdict import ContractRefused
        raise typer.Exit(ContractRefused(rep.contract.refusals).exit_code)
    if as_json:
        d = rep.to_json()
        d["first_plan"] = built
        d["dump_files"] = [str(p) for p in getattr(rep, "dump_files", [])]
        if emit_ir:
            d["ir"] = graph.text()
        print(json.dumps(d, indent=2, default=str))
    else:
        print_report(rep)
        if built:
            console.print(f"plan for bucket {built['bucket']}: {built['instructions']} instructions, "
                          f"{built['generated_kernels']} generated kernels, built in {built['seconds']:.2f}s")
            mem = built["memory"]
            console.print(f"memory for bucket {built['bucket']}: constants {mem['constants_bytes'] / 2**20:.1f} MiB "
                          f"(a compiled model keeps the ones passes made in a released file mapping), prepared "
                          f"weights {mem.get('prepared_weights_bytes', 0) / 2**20:.1f} MiB, conv workspace "
                          f"{mem.get('workspace_bytes', 0) / 2**20:.1f} MiB, arena {mem['arena_bytes'] / 2**20:.1f} MiB",
                          highlight=False)
            for group, why in built["kernel_fallbacks"].items():
                console.print(f"  reference path for {group}: {why}", markup=False)
            for line in exe.report_lines():
                console.print(line, markup=False, highlight=False)
        files = getattr(rep, "dump_files", [])
        if files:
            console.print(f"IR dumps: {len(files)} files under {files[0].parent}")
        if emit_ir:
            console.print(graph.text(), markup=False, highlight=False)
    verdict = rep.validation.verdict
    if not rep.validation.ok and not as_json and not rep.validation.errors:
        from graphmode.errors import ConstraintError
        try:
            rep.validation.raise_for_errors()
        except ConstraintError as e:            # the refusal's field, line and fix, as `recipe validate` says it
            err_console.print(f"[bold red]refused:[/] {type(e).__name__}", highlight=False)
            err_console.print(e.render(), markup=False, highlight=False, soft_wrap=True)
    if save is not None and rep.validation.ok and not dry_run:
        with progress() as on_stage:
            saved = save_artifact(src, recipe_obj, target, graph, rep, cache_dir, save, on_stage, spec=model)
        if not as_json:
            console.print(f"saved {save}: {len(saved['buckets'])} bucket(s), {len(saved['kernels'])} kernel "
                          f"libraries, {saved['bytes'] / 2**20:.1f} MiB in {saved['seconds']:.1f}s", highlight=False)
    raise typer.Exit(0 if rep.validation.ok else (1 if verdict in ("refused", "unproved") else 2))


def first_plan(graph, recipe, cache_dir: Optional[Path], on_stage: Optional[OnStage],
               target: str = "host") -> tuple[dict, object]:
    """Build the first bucket's plan and kernels (what the report shows of a built plan):
    (its summary, its executable). The plan goes into the cache as the runtime keys it, so a
    `run`, `serve` or `graphmode.compile` of the same model and recipe after `compile` reads it
    instead of planning again."""
    from graphmode.backends import DEFAULT_DEVICE, get_backend
    from graphmode.paths import cache_layout
    from graphmode.runtime.build import backend_options, build_plan
    from graphmode.runtime.compiled import CompiledModel
    t0 = time.perf_counter()
    env = recipe.buckets()[0]
    with stage(on_stage, "first plan", detail=CompiledModel.bucket_key(env)):
        plan = build_plan(graph, recipe, env)
        _keep_plan(graph, recipe, target, env, plan, cache_dir)
        backend = get_backend(DEFAULT_DEVICE)
        exe = backend.executable(plan, graph.constants, kernel_dir=cache_layout(cache_dir).kernels,
                                 kernel_selection=recipe.codegen.kernel_selection, **backend_options(backend, recipe))
    weights = sum(t.numel() * t.element_size() for t in graph.constants.values())
    return ({"bucket": env, "instructions": len(plan.instructions), "generated_kernels": exe.generated,
             "kernel_fallbacks": exe.kernel_report.get("fallbacks", {}), "tactics": exe.tactics_report,
             "memory": {"constants_bytes": weights, **exe.memory_report()},
             "seconds": round(time.perf_counter() - t0, 3)}, exe)


def _keep_plan(graph, recipe, target: str, env: dict, plan, cache_dir: Optional[Path]) -> None:
    """`plan` into the plan cache under the runtime's key (runtime/build.py cache_key); a cache
    that cannot be written is the runtime's to report, when it builds the plan itself."""
    from graphmode.errors import CacheError
    from graphmode.runtime.build import plan_key
    from graphmode.runtime.cache import ArtifactCache
    cache = ArtifactCache(cache_dir)
    if cache.unusable() is not None or cache.read_only:
        return
    key = plan_key(graph.structural_hash(), recipe, target, env)
    plan.built_for = key
    try:
        cache.put(key, plan.to_json())
    except CacheError:
        pass


def save_artifact(src, recipe, target: Optional[str], graph, rep, cache_dir: Optional[Path], path: Path,
                  on_stage: Optional[OnStage] = None, spec: Optional[str] = None) -> dict:
    """The compiled model of this report, every bucket built through the cache (bucket N of M to
    `on_stage`), as a .gm file. Under `parallel.tensor` N > 1 (the report is rank 0's shard) the
    N ranks are started from `spec` (the --model), each compiling its shard, and save the group:
    one file per rank and the group file at `path` (runtime/rank_artifacts.py). A decoder
    recipe saves its decode engine's paged graph and plans (graphmode/decode/saved.py)."""
    from graphmode.paths import cache_layout
    from graphmode.recipe.targets import pick_target
    from graphmode.runtime.compiled import CompiledModel
    tgt = pick_target(recipe, target, cache_dir=cache_layout(cache_dir).targets)
    if recipe.memory.kv_cache is not None:
        from graphmode.api import compile as gm_decoder      # what is saved is its decode engine's paged graph
        if recipe.parallel is None or recipe.parallel.tensor == 1:
            return gm_decoder(src, recipe, tgt, cache_dir=cache_dir, on_stage=on_stage).save(path)
        with gm_decoder(spec or src, recipe, tgt, cache_dir=cache_dir) as group:     # each rank loads the model
            return group.save(path)
    if recipe.parallel is not None and recipe.parallel.tensor > 1:
        from graphmode.compiler import compile as gm_compile
        with gm_compile(spec or src, recipe, tgt, cache_dir=cache_dir) as tp:     # each rank loads the model
            return tp.save(path)
    cm = CompiledModel(src, recipe, tgt, None, graph, (rep.capture, None), mode=recipe.exe_mode,
                       cache_dir=cache_dir, verdict=rep.contract, on_stage=on_stage)
    return cm.save(path)
