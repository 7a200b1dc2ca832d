"""`graphmode run`: compile, run sample inputs, print outputs summary, bucket and timing vs eager."""
from __future__ import annotations

import json
from typing import Optional

import torch
import typer
from rich.table import Table

from graphmode.cli.app import app, console
from graphmode.errors import GraphmodeError


def parse_shape(text: str, dims: list[str]) -> dict[str, int]:
    """'batch=2,seq=16' or '2x16' (in the recipe's dim order) -> {dim: value}."""
    text = text.strip()
    try:
        if "=" in text:
            return {k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))}
        vals = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise GraphmodeError(f"cannot parse shape {text!r}", where="--shape",
                             fix=f"write e.g. {'x'.join(['2'] * len(dims))} or "
                                 f"{','.join(f'{d}=2' for d in dims)}") from None
    if len(vals) != len(dims):
        raise GraphmodeError(f"shape {text!r} has {len(vals)} values, the recipe has dims {dims}", where="--shape")
    return dict(zip(dims, vals))


@app.command("run")
def run_cmd(
    model: str = typer.Option(..., "--model", help="minilm | gpt2 | resnet18 | path.onnx | package.module:function"),
    recipe: str = typer.Option(..., "--recipe"),
    mode: Optional[str] = typer.Option(None, "--mode", help="eager | graph | hybrid (default: the recipe's)"),
    shape: Optional[str] = typer.Option(None, "--shape", help="e.g. 2x16 or batch=2,seq=16"),
    iters: int = typer.Option(10, "--iters"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    metrics: bool = typer.Option(False, "--metrics", help="print the runtime contract metrics"),
    warmup: bool = typer.Option(False, "--warmup", help="build every bucket's plan first (progress bar)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run sample inputs through the compiled model and compare with eager PyTorch."""
    from graphmode.compiler import compile as gm_compile
    from graphmode.recipe import load_recipe
    from graphmode.runtime.timing import median, time_ms
    from graphmode.verify.numerics import rel_l2

    if mode not in (None, "eager", "graph", "hybrid"):
        raise GraphmodeError(f"unknown mode {mode!r}", where="--mode", fix="eager, graph or hybrid")
    if threads:
        torch.set_num_threads(threads)
    rec = load_recipe(recipe)
    cm = gm_compile(model, rec, mode=mode, threads=threads)
    if warmup and cm.mode != "eager":
        cm.warmup(progress=not as_json)
    if metrics:   # the contract monitor times and counts every call (same as the server's)
        from graphmode.monitor import monitored
        cm = monitored(cm)
    dims = list(rec.dims)
    env = parse_shape(shape, dims) if shape else dict(rec.buckets()[0])
    inputs = cm.source.make_inputs(env, seed=0)
    with torch.inference_mode():
        out = cm(**inputs)
    refs = cm.source.reference(inputs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    rows = []
    for i, (o, r) in enumerate(zip(outs, refs)):
        rows.append({"output": i, "shape": list(o.shape), "dtype": str(o.dtype).replace("torch.", ""),
                     "mean": float(o.float().mean()), "std": float(o.float().std()) if o.numel() > 1 else 0.0,
                     "rel_l2_vs_eager": rel_l2(o, r)})
    t_graph = median(time_ms(lambda: cm(**inputs), iters=iters))
    t_eager = median(time_ms(lambda: cm.source.reference(inputs), iters=iters))
    result = {"model": model, "mode": cm.mode, "shape": env, "bucket": getattr(cm, "last_bucket", None),
              "outputs": rows, "median_ms": {"graphmode": t_graph, "eager" if cm.source.module is not None else "onnxruntime": t_eager},
              "speedup_vs_eager": t_eager / t_graph if t_graph else None}
    if metrics:
        result["metrics"] = cm.metrics()
    if as_json:
        print(json.dumps(result, indent=2))
        return
    console.print(f"[bold]{model}[/] mode {cm.mode}, request {env} -> bucket {result['bucket']}")
    t = Table()
    for c in ("output", "shape", "dtype", "mean", "std", "rel L2 vs eager"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["output"]), str(r["shape"]), r["dtype"], f"{r['mean']:.4g}", f"{r['std']:.4g}",
                  f"{r['rel_l2_vs_eager']:.2e}")
    console.print(t)
    console.print(f"median latency: graphmode {t_graph:.2f} ms, eager {t_eager:.2f} ms "
                  f"(graphmode / eager = {t_graph / t_eager:.2f}x)")
    if metrics:
        console.print(f"metrics: {json.dumps(result['metrics'])}")
