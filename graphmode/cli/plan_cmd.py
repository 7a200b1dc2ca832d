"""`graphmode plan show`: the execution plan of one bucket, readable or as JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from graphmode.cli.app import app, console
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import GraphmodeError

plan_app = typer.Typer(help="Inspect execution plans.", no_args_is_help=True)
app.add_typer(plan_app, name="plan")


@plan_app.command("show")
def plan_show(
    model: str = typer.Option(..., "--model"),
    recipe: str = typer.Option(..., "--recipe"),
    shape: Optional[str] = typer.Option(None, "--bucket", help="e.g. 1x128 or batch=1,seq=128 (default: first bucket)"),
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Print the ordered instructions, arena offsets and sizes of one bucket's plan."""
    from graphmode.cli.run_cmd import parse_shape
    from graphmode.compiler import lower_model
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe, pick_target
    from graphmode.recipe.buckets import all_buckets, bucket_for, dim_buckets
    from graphmode.runtime.build import build_plan

    rec = load_recipe(recipe)
    env = parse_shape(shape, list(rec.dims), "--bucket") if shape else dict(all_buckets(rec)[0])
    bucket = bucket_for(rec, env)
    if bucket is None:
        raise GraphmodeError(f"shape {env} is outside the recipe's dims", where="--bucket",
                             fix=f"buckets: {dim_buckets(rec)}")
    proved_on = pick_target(rec, None, cache_dir=cache_layout(cache_dir).targets)
    with progress() as on_stage:
        plan = build_plan(lower_model(model, rec, proved_on, on_stage=on_stage).graph, rec, bucket)
    if as_json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        console.print(plan.text(), markup=False, highlight=False)
