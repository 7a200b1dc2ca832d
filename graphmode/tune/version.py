"""The tuned recipe: a new version written beside the old one, each changed value explained."""
from __future__ import annotations

import datetime as _dt
import glob
import re
from pathlib import Path
from typing import Any

from graphmode.kb.render import render, shown
from graphmode.recipe import recipe_hash
from graphmode.tune.space import apply
from graphmode.tune.trial import TrialResult


def next_version_path(path: Path) -> Path:
    """`r.yaml` -> `r.v2.yaml`, `r.v2.yaml` -> `r.v3.yaml`; never an existing file."""
    m = re.fullmatch(r"(.*)\.v(\d+)", path.stem)
    stem, n = (m.group(1), int(m.group(2))) if m else (path.stem, 1)
    while True:
        n += 1
        out = path.with_name(f"{stem}.v{n}{path.suffix or '.yaml'}")
        if not out.exists():
            return out


def write_version(path: Path, base_data: dict[str, Any], base: TrialResult, best: TrialResult, *, objective: str,
                  hardware: str, trials: int, out: Path | None = None) -> tuple[Path, Any, bool]:
    """Write the best configuration as the next version of the recipe at `path`; returns
    (its path, the loaded Recipe, whether it was written now). The file is validated before it
    is written; a version with the same content already beside it is returned instead."""
    from graphmode.recipe import load_recipe
    data = apply(base_data, best.config)
    bm, nm = base.metrics, best.metrics
    effect = (f"p99 {shown(bm.get('p99_ms'))} -> {shown(nm.get('p99_ms'))} ms, throughput "
              f"{shown(bm.get('throughput'))} -> {shown(nm.get('throughput'))} items/s")
    notes: dict[str, str] = {}
    for k, v in best.config.items():
        if base.config.get(k) != v and k != "threads":
            where = {"fusion": "optimize.fusion", "fusion.max_ops": "optimize.fusion",
                     "kernel_selection": "codegen.kernel_selection"}.get(k, k)
            was = f"{k} was {base.config.get(k)}"
            notes[where] = f"{notes[where]}, {was}" if where in notes else f"tune (trial {best.index}): {was}"
    notes = {k: f"{v}; {effect}" for k, v in notes.items()}
    threads = best.config.get("threads")
    header = [f"{data.get('name')}: tuned by graphmode tune from {path.name} ({base.recipe_hash}) on {hardware}, "
              f"{_dt.date.today().isoformat()}",
              f"objective {objective}-first over {trials} trial(s): {effect}",
              f"measured with {threads} intra-op thread(s): run and serve it with --threads {threads} (a recipe has "
              "no thread field)" if threads else "",
              f"the comments of {path.name} are not carried over: read them there"]
    text = render(data, notes, [h for h in header if h])
    recipe = load_recipe(text)
    if out is None:
        same = [p for p in _versions(path) if _hash_of(p) == recipe_hash(recipe)]
        if same:                                 # a resumed or repeated run found the same best again
            return same[0], recipe, False
    dest = out or next_version_path(path)
    dest.write_text(text, encoding="utf-8")
    return dest, recipe, True


def _versions(path: Path) -> list[Path]:
    m = re.fullmatch(r"(.*)\.v(\d+)", path.stem)
    stem = m.group(1) if m else path.stem
    return sorted(path.parent.glob(f"{glob.escape(stem)}.v*{path.suffix or '.yaml'}"))


def _hash_of(path: Path) -> str | None:
    from graphmode.errors import GraphmodeError
    from graphmode.recipe import load_recipe
    try:
        return recipe_hash(load_recipe(path))
    except GraphmodeError:
        return None
