"""`graphmode demo`: the README's main job — real all-MiniLM-L6-v2 compiled with the shipped
recipe, a few sentences encoded, cosine similarities, graph vs eager latency."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.table import Table

from graphmode.cli.app import app, console
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
]
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "recipes" / "minilm_cpu.yaml"


@app.command("demo")
def demo_cmd(
    recipe: Path = typer.Option(DEFAULT_RECIPE, "--recipe", help="recipe for all-MiniLM-L6-v2"),
    iters: int = typer.Option(20, "--iters", help="timed runs per engine"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=1024),
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Compile and run the real all-MiniLM-L6-v2 with the shipped recipe."""
    from graphmode.capture.zoo import build, sentence_embeddings
    from graphmode.cli.compile_cmd import build_report, print_report
    from graphmode.recipe.hashing import recipe_hash
    from graphmode.runtime.compiled import CompiledModel
    from graphmode.runtime.timing import median, time_ms
    from graphmode.verify.numerics import rel_l2

    if threads:
        torch.set_num_threads(threads)
    bundle = build("minilm")
    with progress() as on_stage:
        rep, graph, rec, src = build_report(bundle, str(recipe), None, cache_dir=cache_dir, on_stage=on_stage)
    if not as_json:
        print_report(rep)
    batch = bundle.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with progress() as on_stage, torch.inference_mode():
        cm = CompiledModel(src, rec, None, None, graph, (rep.capture, None), mode="graph", cache_dir=cache_dir,
                           threads=threads, on_stage=on_stage)
        hidden = cm(**inputs)        # builds the request's bucket
    with torch.inference_mode():
        hidden = hidden[0] if isinstance(hidden, (tuple, list)) else hidden
        ref = bundle.module(**inputs)
        ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    emb = sentence_embeddings(hidden, inputs["attention_mask"])
    emb_ref = sentence_embeddings(ref, inputs["attention_mask"])
    cos = emb @ emb.T
    err = rel_l2(hidden, ref)
    t_graph = time_ms(lambda: cm(**inputs), iters=iters)
    padded = cm._pad(inputs, cm.last_bucket)
    with torch.inference_mode():
        t_eager = time_ms(lambda: bundle.module(**inputs), iters=iters)
        t_eager_padded = time_ms(lambda: bundle.module(**padded), iters=iters)
    shape = dict(zip(("batch", "seq"), inputs["input_ids"].shape))
    result = {"recipe": rec.name, "recipe_hash": recipe_hash(rec), "request": {k: int(v) for k, v in shape.items()},
              "bucket": cm.last_bucket, "rel_l2_vs_eager": err,
              "embedding_rel_l2_vs_eager": rel_l2(emb, emb_ref),
              "cosine": {f"{SENTENCES[0]} | {s}": round(float(cos[0, i]), 4) for i, s in enumerate(SENTENCES)},
              "median_ms": {"graphmode": median(t_graph), "eager": median(t_eager),
                            "eager_at_bucket_shape": median(t_eager_padded)},
              "events": dict(cm.events)}
    if as_json:
        result["compile_report"] = rep.to_json()
        print(json.dumps(result, indent=2, default=str))
        return
    console.print(f"\n[bold]encoded {len(SENTENCES)} sentences[/]: request {result['request']} -> bucket "
                  f"{cm.last_bucket}; last_hidden_state rel L2 vs eager {err:.2e}")
    t = Table(title="cosine similarity (graphmode embeddings)")
    t.add_column("")
    for i in range(len(SENTENCES)):
        t.add_column(str(i), justify="right")
    for i, s in enumerate(SENTENCES):
        t.add_row(f"{i} {s}", *[f"{float(cos[i, j]):.3f}" for j in range(len(SENTENCES))])
    console.print(t)
    g, e, ep = median(t_graph), median(t_eager), median(t_eager_padded)
    console.print(f"latency (median of {iters}): graphmode {g:.2f} ms (padded to bucket {cm.last_bucket}), "
                  f"eager PyTorch {e:.2f} ms at the request shape -> graphmode / eager = {g / e:.2f}x; "
                  f"eager at the bucket shape {ep:.2f} ms -> {g / ep:.2f}x")
    console.print("(the recipe's buckets decide the padding; `graphmode bench` measures engines at equal shapes)")
