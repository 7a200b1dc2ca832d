"""`graphmode cache ls|clear|prune|explain`: the on-disk plan cache (and the tactic timing cache)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.errors import GraphmodeError
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import CacheError, GraphmodeError

cache_app = typer.Typer(help="Inspect and manage the artifact cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


def _max_bytes(text: str) -> int:
    """`--max-size`: a size as target files write them (500MB = 500e6, 2GiB, 32K = 32 KiB, bytes)."""
    from graphmode.targets.units import UnitError, parse_bytes
    try:
        n = parse_bytes(text)
    except UnitError as e:
        raise GraphmodeError(f"cannot parse size {text!r}: {e}", where="--max-size", fix=e.fix) from None
    if n < 0:
        raise GraphmodeError("a size cannot be negative", where="--max-size", value=text, fix="e.g. 500MB, 2GiB")
    return n


def _cache(cache_dir: Optional[Path]):
    """The cache these commands inspect: a root that is a file is an error here (a compile runs on
    without caching there, with an `unusable` event; listing it would show an empty cache)."""
    from graphmode.runtime.cache import ArtifactCache
    cache = ArtifactCache(cache_dir)
    if cache.root.exists() and not cache.root.is_dir():
        raise CacheError("the cache root is not a folder", where="--cache-dir" if cache_dir is not None else
                         "$GRAPHMODE_CACHE_DIR", value=str(cache.root),
                         fix="give the folder a compile used (--cache-dir), or leave it out for the default cache")
    return cache


@cache_app.command("ls")
def cache_ls(cache_dir: Optional[Path] = CacheDir, as_json: bool = typer.Option(False, "--json")) -> None:
    """List cached plans with their key fields and sizes."""
    entries = _cache(cache_dir).entries()
    if as_json:
        print(json.dumps([{"digest": e.digest, "key": e.key, "bytes": e.size, "last_used": e.last_used}
                          for e in entries], indent=1))
        return
    t = Table(title=f"{len(entries)} cached plans")
    for c in ("digest", "graph", "recipe", "target", "bucket", "versions", "KiB", "last used"):
        t.add_column(c, overflow="fold")
    for e in entries:
        k = e.key
        if "corrupt" in k:     # removed and rebuilt by the next lookup, or by clear/prune
            t.add_row(e.digest[:12], f"corrupt: {k['corrupt']}", "", "", "", "", f"{e.size / 1024:.1f}", "")
            continue
        t.add_row(e.digest[:12], k.get("graph_hash", "?"), k.get("recipe_hash", "?"), k.get("target", "?"),
                  k.get("bucket", "?"), f"gm {k.get('graphmode', '?')} / torch {k.get('torch', '?')}",
                  f"{e.size / 1024:.1f}", time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)))
    console.print(t)
    libraries = _cache(cache_dir).libraries()
    console.print(f"and {_said(libraries).replace('nothing', 'no kernel libraries')} beside them "
                  "(`cache prune --max-size` weighs these and the plans; the timing cache, host probe and knowledge "
                  "base stay)", highlight=False)
    left = _cache(cache_dir).leftovers()
    if left:
        console.print(f"and {_said(left)} (a build or extraction killed mid-way; `cache prune` removes them)",
                      highlight=False)
    n, size = _onnx_exports(cache_dir)
    if n:
        console.print(f"ONNX exports (the bench's and profile's ONNX Runtime models, in-memory ONNX models): {n} "
                      f"file(s), {size / 2**20:.2f} MiB (`cache clear --onnx` removes them)", highlight=False)


def _onnx_exports(cache_dir: Optional[Path]) -> tuple[int, int]:
    from graphmode.paths import cache_layout
    files = [f for f in cache_layout(cache_dir).onnx.rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


@cache_app.command("clear")
def cache_clear(cache_dir: Optional[Path] = CacheDir,
                timings: bool = typer.Option(False, "--timings", help="also remove the GEMM/conv timing cache "
                                             "(<cache>/tactics): the next compile times every shape again, e.g. "
                                             "after timings were taken on a busy machine"),
                onnx: bool = typer.Option(False, "--onnx", help="also remove the ONNX exports (<cache>/onnx): "
                                          "made again when next needed")) -> None:
    """Remove every cached plan, kernel library and extracted artifact (and with --timings the
    tactic timing cache, with --onnx the ONNX exports)."""
    import shutil

    from graphmode.paths import cache_layout
    cache = _cache(cache_dir)
    console.print(f"removed {_said(cache.clear())}")
    _say_foreign(cache)
    if onnx:
        n, size = _onnx_exports(cache.root)
        try:
            if n:
                shutil.rmtree(cache_layout(cache.root).onnx)
        except OSError as e:
            raise CacheError(f"cannot remove the ONNX exports: {e}", where="--onnx",
                             fix="check the permissions of <cache>/onnx") from None
        console.print(f"removed {n} ONNX export file(s) ({size / 2**20:.2f} MiB)")
    if timings:
        files = sorted(cache_layout(cache.root).tactics.glob("gemm-*.json"))
        try:
            for f in files:
                f.unlink(missing_ok=True)
        except OSError as e:
            raise CacheError(f"cannot remove the timing cache: {e}", where="--timings",
                             fix="check the permissions of <cache>/tactics") from None
        console.print(f"removed {len(files)} timing-cache entries")


@cache_app.command("prune")
def cache_prune(max_size: str = typer.Option(..., "--max-size", help="e.g. 200MB"),
                cache_dir: Optional[Path] = CacheDir) -> None:
    """Remove what interrupted writes left (a build killed mid-way), then the least recently used
    plans, kernel libraries and extracted artifacts until the cache fits --max-size."""
    cache = _cache(cache_dir)
    removed = cache.prune(_max_bytes(max_size))
    console.print(f"removed {_said(removed)}")
    _say_foreign(cache)


def _say_foreign(cache) -> None:
    """What clear and prune left because graphmode did not write it (a --cache-dir that holds a
    project's own plans/ or kernels/)."""
    other = cache.foreign()
    if other:
        shown = ", ".join(str(p.relative_to(cache.root)) for p in other[:5]) + (" ..." if len(other) > 5 else "")
        console.print(f"left {len(other)} item(s) graphmode did not write ({shown}): is --cache-dir a graphmode "
                      "cache folder? remove them yourself if they are not to be kept", markup=False, highlight=False)


def _said(removed) -> str:
    """'3 plans, 5 kernel libraries (1.2 MiB)': what a clear or prune removed, by kind."""
    names = {"plan": ("plan", "plans"), "kernel": ("kernel library", "kernel libraries"),
             "artifact": ("extracted artifact", "extracted artifacts"),
             "leftover": ("folder an interrupted write left", "folders interrupted writes left")}
    counts = [(k, sum(1 for e in removed if e.kind == k)) for k in names]
    parts = [f"{n} {names[k][n != 1]}" for k, n in counts if n] or ["nothing"]
    return f"{', '.join(parts)} ({sum(e.size for e in removed) / 2**20:.2f} MiB)"


@cache_app.command("explain")
def cache_explain(
    model: Optional[str] = typer.Option(None, "--model"),
    recipe: Optional[str] = typer.Option(None, "--recipe"),
    bucket: Optional[str] = typer.Option(None, "--bucket", help="e.g. 1x128 (default: first bucket)"),
    target: str = typer.Option("host", "--target"),
    timings: bool = typer.Option(False, "--timings", help="the GEMM/conv timing cache instead: each entry's "
                                 "winner, the conditions it was timed under (load, CPU-s per wall-s, quiet / "
                                 "noisy / starved) and whether the next plan build times it again"),
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Say whether a lookup hits, and if not which key field differs from the nearest entry
    (--model, --recipe); or, with --timings, what the tactic timing cache holds and under which
    conditions each entry was measured."""
    if timings:
        return _explain_timings(cache_dir, as_json)
    if model is None or recipe is None:
        raise GraphmodeError("cache explain needs a model and a recipe (or --timings)",
                             where="--model" if model is None else "--recipe",
                             fix="graphmode cache explain --model M --recipe R.yaml, or graphmode cache explain "
                                 "--timings")
    from graphmode.cli.run_cmd import parse_shape
    from graphmode.compiler import lower_model
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe, pick_target
    from graphmode.recipe.buckets import all_buckets, bucket_for
    from graphmode.recipe.hashing import recipe_hash
    from graphmode.runtime.cache import make_key

    from graphmode.targets import get_target
    get_target(target, cache_dir=cache_layout(cache_dir).targets)       # an unknown name is refused, not a miss
    rec = load_recipe(recipe)
    env = parse_shape(bucket, list(rec.dims), "--bucket") if bucket else dict(all_buckets(rec)[0])
    planned = bucket_for(rec, env)
    if planned is None:
        raise GraphmodeError(f"{bucket} is outside the recipe's contract: no plan is built or cached for it",
                             where="--bucket", value=bucket,
                             fix="a bucket of the recipe: " + ", ".join("x".join(map(str, b.values()))
                                                                        for b in all_buckets(rec)[:12]))
    if planned != env:          # a request between buckets runs (and is cached) as its bucket
        err_console.print(f"{bucket} runs in bucket {'x'.join(map(str, planned.values()))}: explaining that plan",
                          markup=False, highlight=False)
        env = planned
    with progress() as on_stage:
        graph = lower_model(model, rec, pick_target(rec, None, cache_dir=cache_layout(cache_dir).targets),
                            on_stage=on_stage).graph
    key = make_key(graph.structural_hash(), recipe_hash(rec), target, env, isa=rec.codegen.isa)
    res = _cache(cache_dir).explain(key)
    res["key"] = key
    if as_json:
        print(json.dumps(res, indent=1))
        return
    if res["result"] == "hit":
        console.print(f"hit: entry {res['digest']}")
    else:
        console.print(f"miss: {res['reason']}")
        for k, v in res.get("differs", {}).items():
            console.print(f"  {k}: cached {v['nearest_entry']!r}, wanted {v['wanted']!r}")


# a timing-cache key's fields: its shape, what tells two entries of one shape apart (packed or
# batched B, a bias, an epilogue, cold caches, the dtype...), and what every entry shares
_SHAPE_FIELDS = ("batch", "m", "n", "k", "cin", "h", "w", "cout", "kh", "kw", "stride", "padding", "dilation",
                 "groups")
_NOT_VARIANT = frozenset({"op", "threads", "candidates", "compiler", "target", "version", "statistic",
                          *_SHAPE_FIELDS})


def _explain_timings(cache_dir: Optional[Path], as_json: bool) -> None:
    """One line per timing-cache entry (read through TimingCache.get, so a file it would not
    use is listed as unreadable)."""
    from graphmode.backends.cpu.tactics.cache import RETUNE_NOISY, TimingCache, retime_reason, timed_busy
    from graphmode.backends.cpu.tactics.timing import machine_load
    from graphmode.paths import cache_layout
    folder = cache_layout(cache_dir).tactics
    cache = TimingCache(folder)
    load, cores = machine_load()
    out = []
    for f in sorted(folder.glob("gemm-*.json")):
        try:
            key = json.loads(f.read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            key = None
        e = cache.get(key) if isinstance(key, dict) else None
        if e is None:
            out.append({"file": f.name, "unreadable": True})
            continue
        fastest = min(e["timings_s"], key=e["timings_s"].get) if e["timings_s"] else None
        cond = "starved" if e["starved"] else "busy host" if timed_busy(e) else "noisy" if e["noisy"] else "quiet"
        out.append({"file": f.name, "op": key.get("op"), "shape": {k: key[k] for k in _SHAPE_FIELDS if k in key},
                    "variant": {k: v for k, v in key.items() if k not in _NOT_VARIANT},
                    "threads": key.get("threads"), "fastest": fastest,
                    "fastest_us": round(e["timings_s"][fastest] * 1e6, 2) if fastest else None,
                    "conditions": cond, "load": e["load"], "cores": e["cores"], "cpu_per_wall": e["cpu_per_wall"],
                    "tries": e["tries"], "next_build": retime_reason(e, RETUNE_NOISY, load, cores)
                    or ("uses it until a build finds the host quiet" if timed_busy(e) else "uses it")})
    if as_json:
        print(json.dumps(out, indent=1))
        return
    t = Table(title=f"{len(out)} timing-cache entries in {folder} (host now: load {load} on {cores} cores)")
    for c in ("op", "shape", "variant", "threads", "fastest", "us", "timed", "load/cores", "CPU/wall", "tries",
              "next build"):
        t.add_column(c)
    for r in out:
        if r.get("unreadable"):
            t.add_row(r["file"], "unreadable: the next build times it again", *[""] * 9)
            continue
        s = r["shape"]
        t.add_row(str(r["op"]), " ".join(f"{k}={v}" for k, v in s.items()),
                  ", ".join(k if v is True else f"{k}={v}" for k, v in r["variant"].items() if v is not False),
                  str(r["threads"]), str(r["fastest"]),
                  str(r["fastest_us"]), r["conditions"], f"{r['load']}/{r['cores']}",
                  "-" if r["cpu_per_wall"] is None else f"{r['cpu_per_wall']:.2f}", str(r["tries"]), r["next_build"])
    (console if console.is_terminal else Console(width=200)).print(t)
