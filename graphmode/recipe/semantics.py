"""Layer 2 of verification: cross-field consistency of a recipe (and against a target).

Every problem is a RecipeError with the field path, value, YAML line and fix. Warnings
are things that are legal but probably not meant (fusion enabled without a `fuse` pass).
The checks of the dims and inputs (buckets, values, masks) are in shape_checks.py.
"""
from __future__ import annotations

import functools

import importlib.metadata
import importlib.util
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from graphmode.errors import RecipeError, TargetError
from graphmode.recipe.buckets import dim_range, dim_synthesis
from graphmode.recipe.facts import kv_params
from graphmode.recipe.findings import Findings
from graphmode.recipe.limits import DTYPE_SIZES
from graphmode.recipe.schema import Recipe
from graphmode.recipe.shape_checks import check_dims, check_inputs
from graphmode.targets.registry import HOST, get_target


# ---- environment for `requires` ------------------------------------------------------------

@dataclass(frozen=True)
class Environment:
    """Versions `requires` is checked against. None = not present on this machine."""
    python: str
    torch: Optional[str] = None
    graphmode: Optional[str] = None
    driver: Optional[str] = None
    cuda: Optional[str] = None


def detect_environment() -> Environment:
    """Probe versions without importing torch (metadata + files only)."""
    from graphmode.version import __version__
    try:
        torch_v = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_v = None
    cuda = None
    try:
        spec = importlib.util.find_spec("torch")
        if spec and spec.origin:
            text = (Path(spec.origin).parent / "version.py").read_text()
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", text, re.M)
            cuda = m.group(1) if m else None
    except (OSError, ImportError, ValueError):
        pass
    driver = None
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+([\d.]+)", text)
        driver = m.group(1) if m else None
    except OSError:
        pass
    return Environment(platform.python_version(), torch_v, __version__, driver, cuda)


@dataclass(frozen=True)
class RequireCheck:
    key: str
    constraint: str
    found: Optional[str]
    status: str          # "ok" | "failed" | "n/a"
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "constraint": self.constraint, "found": self.found,
                "status": self.status, "reason": self.reason}


def check_requires(recipe: Recipe, env: Environment, target: Any = None) -> list[RequireCheck]:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    out = []
    for key, spec in recipe.requires.model_dump().items():
        if spec is None:
            continue
        found = getattr(env, key)
        if key in ("driver", "cuda") and (found is None or (target is not None and target.kind == "cpu")):
            why = f"target {target.name!r} is a CPU" if target is not None and target.kind == "cpu" \
                else f"no {key} on this machine"
            out.append(RequireCheck(key, spec, found, "n/a", f"not applicable: {why}"))
            continue
        if found is None:
            out.append(RequireCheck(key, spec, None, "failed", f"{key} is not installed"))
            continue
        try:
            ok = SpecifierSet(spec).contains(Version(found), prereleases=True)
        except InvalidVersion:
            ok = False
        out.append(RequireCheck(key, spec, found, "ok" if ok else "failed",
                                "" if ok else f"{key} {found} does not satisfy {spec}"))
    return out


# ---- the checks -------------------------------------------------------------------------------

@dataclass
class SemanticResult:
    errors: list[RecipeError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    requires: list[RequireCheck] = field(default_factory=list)


def _known_op(name: str) -> bool:
    """Whether an op list entry can match anything: a graphmode op, an ONNX op type (as written,
    lower-cased or `onnx::Type`), an ATen op by short name or `aten.op[.overload]`. Another
    namespace's op (a library's custom op) is taken on trust: its library may not be loaded yet."""
    from graphmode.ir.ops import OPS
    if name in OPS:
        return True
    import onnx.defs
    base = name[len("onnx::"):] if name.startswith("onnx::") else name
    if onnx.defs.has(base) or base in _onnx_lower():
        return True
    parts = name.split(".")
    if len(parts) > 3 or parts[0] in ("torch", "nn", "F"):     # a Python path, not an operator's name
        return False
    if len(parts) > 1 and parts[0] != "aten":
        return True
    import torch
    short = parts[1] if len(parts) > 1 else parts[0]
    try:
        packet = getattr(torch.ops.aten, short)
    except (AttributeError, RuntimeError):
        return False
    return len(parts) < 3 or parts[2] in packet.overloads()


@functools.lru_cache(maxsize=1)
def _onnx_lower() -> frozenset[str]:
    import onnx.defs
    return frozenset(s.name.lower() for s in onnx.defs.get_all_schemas())


class _Checker(Findings):
    """The cross-field checks of one recipe; the dims and inputs are shape_checks.py's."""

    def capture(self) -> None:
        c = self.r.capture
        included = set(c.include_ops)
        for i, op in enumerate(c.exclude_ops):
            if op in included:
                self.err(f"capture.exclude_ops[{i}]", "op is both included and excluded", op)
        if c.exclude_ops and self.r.exe_mode == "graph":
            self.err("capture.exclude_ops", "excluded ops run as eager islands, which exe_mode 'graph' "
                                            "does not allow", c.exclude_ops, fix="set exe_mode: hybrid")
        for field_name, ops in (("include_ops", c.include_ops), ("exclude_ops", c.exclude_ops)):
            for i, op in enumerate(ops):
                if not _known_op(op):
                    self.err(f"capture.{field_name}[{i}]", "no ATen, ONNX or graphmode op has this name (a typo "
                             "would match nothing, silently)", op,
                             fix="name an ATen op ('gelu', 'aten.gelu.default'), an ONNX op type ('Gelu') or a "
                                 "graphmode op (`graphmode ops` lists them)")

    def optimize(self) -> None:
        from graphmode.passes.registry import PRESETS, check_order
        o = self.r.optimize
        if o.preset is not None and o.passes is not None:
            self.err("optimize.preset", "give either a preset or a pass list, not both", o.preset,
                     fix="remove `preset` or `passes`")
        if o.preset is not None and o.preset not in PRESETS:
            self.err("optimize.preset", "unknown preset", o.preset, fix=f"one of: {', '.join(PRESETS)}")
        if o.passes is not None:
            if not o.passes:
                self.err("optimize.passes", "empty pass list", [], fix="use `preset: none` for the minimal pipeline")
            for i, msg in check_order(o.passes):     # "<why>; put <a> before <b>": the last clause is the fix
                why, _, fix = msg.rpartition("; put ")
                self.err(f"optimize.passes[{i}]", why or msg, o.passes[i], fix=f"put {fix}" if why else None)
        f = o.fusion
        if f.min_ops > f.max_ops:
            self.err("optimize.fusion.max_ops", f"max_ops is below min_ops {f.min_ops}", f.max_ops,
                     fix=f"max_ops >= {f.min_ops}")
        pipeline = self.r.pipeline()
        if f.enabled and "fuse" not in pipeline and (o.passes is not None or o.preset in PRESETS):
            self.warn("optimize.fusion.enabled", "fusion is enabled but the pipeline has no 'fuse' pass")
        if not f.enabled and "fuse" in pipeline:
            self.warn("optimize.fusion.enabled", "fusion is disabled: the 'fuse' pass will do nothing")

    def precision(self) -> None:
        p = self.r.precision
        acc = p.accumulate_dtype()
        if DTYPE_SIZES[acc] < DTYPE_SIZES[p.compute]:
            self.err("precision.accumulate", f"accumulating in {acc} is narrower than compute {p.compute}", acc,
                     fix=f"accumulate: {p.compute} or wider")
        if p.weights != "f32":
            if p.compute != "f32":
                self.err("precision.weights", f"weight-only {p.weights} keeps activations in f32; compute is "
                         f"{p.compute}", p.weights, fix="compute: f32 with weights: " + p.weights +
                         ", or weights: f32 with a low-precision compute")
            if "quantize_weights" not in self.r.pipeline():
                o = self.r.optimize
                where = "optimize.passes" if o.passes is not None else f"optimize.preset {o.preset}"
                self.err("precision.weights", f"weights: {p.weights} needs the quantize_weights pass, which "
                         f"{where} leaves out", p.weights,
                         fix="add quantize_weights to optimize.passes after constant_fold (or use a preset)"
                         if o.passes is not None else "preset: default (or list optimize.passes with quantize_weights)")
        if p.int4_activations == "q8" and (p.weights, p.group_size, p.int4_scheme) != ("int4", 32, "symmetric"):
            self.err("precision.int4_activations", "q8 activations meet symmetric int4 codes of group 32 only "
                     f"(llama.cpp q4_0 x q8_0); weights is {p.weights}, group_size {p.group_size}, int4_scheme "
                     f"{p.int4_scheme}", p.int4_activations,
                     fix="weights: int4, group_size: 32, int4_scheme: symmetric; or int4_activations: f32")
        if p.weights != "int4" and (p.group_size != 32 or p.int4_scheme != "symmetric"):
            field = "precision.group_size" if p.group_size != 32 else "precision.int4_scheme"
            self.warn(field, f"{field.split('.')[1]} applies to weights: int4 only; weights is {p.weights}")
        from graphmode.ir.ops import OPS
        for op, dt in p.overrides.items():
            if op not in OPS:       # the precision pass reads the captured graph's ops, never ATen/ONNX names
                what = "an ATen or ONNX name, not a graphmode op" if _known_op(op) else "no op has this name"
                self.err(f"precision.overrides.{op}", f"{what}: overrides apply to the ops of the captured graph "
                         "(the override would narrow nothing, silently)", op,
                         fix="name a graphmode op (`graphmode ops` lists them: softmax, layer_norm, linear, matmul, "
                             "...; matrix products by a weight are linear)")
            elif op == "linear" and dt != "f32" and p.weights != "f32":
                self.err(f"precision.overrides.{op}", f"runs every linear in {dt}, while weights: {p.weights} "
                         "stores linear weights narrow for f32 activations: no weight would be stored "
                         f"{p.weights}, silently", dt,
                         fix=f"remove the linear override (keep weights: {p.weights}), or weights: f32")
        if self.t is None:
            return
        floats = [d for d in self.t.dtypes if d.startswith(("f", "bf"))]
        supported = ", ".join(floats)
        checks = [("precision.compute", p.compute)]
        if p.accumulate:
            checks.append(("precision.accumulate", p.accumulate))
        checks += [(f"precision.overrides.{op}", dt) for op, dt in p.overrides.items()]
        for path, dt in checks:
            if not self.t.supports_dtype(dt):
                self.err(path, f"target {self.t.name!r} does not compute in {dt}", dt, fix=f"one of: {supported}")

    def codegen(self) -> None:
        """A `codegen.isa` cap the target's CPU cannot run would die of SIGILL in the first kernel."""
        if self.t is None or self.t.kind != "cpu":
            return
        from graphmode.backends.cpu.isa import cap_problem
        why = cap_problem(self.r.codegen.isa, self.t.simd, f"target {self.t.name!r} (simd: {', '.join(self.t.simd)})")
        if why is not None:
            self.err("codegen.isa", why[0], self.r.codegen.isa, fix=why[1])

    def determinism(self) -> None:
        """Only the decode engine computes sequences apart; a batch of encoder requests shares
        its GEMMs and padding, so the switch would promise what nothing keeps."""
        if self.r.determinism == "batch_invariant" and self.r.memory.kv_cache is None:
            self.err("determinism", "batch_invariant is kept by the decode engine only (recipes with "
                     "memory.kv_cache)", self.r.determinism,
                     fix="remove determinism, or add memory.kv_cache to decode a causal LM")
        kv = self.r.memory.kv_cache
        if self.r.determinism == "batch_invariant" and getattr(kv, "prefix_caching", None):
            self.err("memory.kv_cache.prefix_caching", "prefix caching prefills a prompt after a prefix another "
                     "sequence computed, under another shape than alone: batch_invariant cannot keep its logits",
                     True, fix="remove prefix_caching (off under batch_invariant) or determinism")

    def memory(self) -> None:
        m = self.r.memory
        if self.t is not None and isinstance(m.budget_mb, (int, float)):
            cap = self.t.memory_bytes / 2**20
            if m.budget_mb > cap:
                self.err("memory.budget_mb", f"budget exceeds target {self.t.name!r} memory of {cap:.0f} MB",
                         m.budget_mb, fix=f"budget_mb <= {cap:.0f}")
        kv = kv_params(self.r)
        if kv is not None:
            for k in ("layers", "kv_heads", "head_dim"):
                if kv[k] is None:
                    self.err(f"memory.kv_cache.{k}", f"KV cache {k} unknown",
                             fix=f"set memory.kv_cache.{k} (or model.{k}): the recipe is proved before any "
                                 "model loads; `graphmode recipe init --model M` writes them from the model's config "
                                 "(num_hidden_layers, num_key_value_heads, head_dim)")
            for k in ("batch_dim", "seq_dim"):
                if kv[k] not in self.r.dims and not (k == "batch_dim" and kv[k] == "batch"):
                    self.err(f"memory.kv_cache.{k}", f"dim {kv[k]!r} is not declared under dims", kv[k],
                             fix=f"one of: {', '.join(self.r.dims)}")
            self.kv_slots(kv)

    def kv_slots(self, kv: dict) -> None:
        """A decoder recipe holds one admissible sequence: its longest prompt (seq_dim's max)
        plus one new token fits a sequence's pages (proved for every seq by prove_kv_pages) and
        the pool; seq_dim is the prompt length, not the batch."""
        seq, batch = kv["seq_dim"], kv["batch_dim"]
        if seq == batch:
            self.err("memory.kv_cache.seq_dim", f"seq_dim and batch_dim are both {seq!r}: the KV pages would be "
                                                "counted per sequence along the batch", seq,
                     fix="seq_dim: the prompt-length dim (seq), batch_dim: the sequences decoded together (batch)")
            return
        pool = self.r.memory.kv_cache.pages
        if seq not in self.r.dims or pool is None or not isinstance(kv["page_size"], int):
            return
        top = dim_range(self.r.dims[seq])[1]
        need = -(-(top + 1) // kv["page_size"])
        if pool < need:
            self.err("memory.kv_cache.pages", f"a pool of {pool} page(s) cannot hold one admissible sequence: the "
                                              f"longest prompt ({seq} = {top}) and one new token need {need} pages "
                                              f"of {kv['page_size']} tokens", pool,
                     fix=f"pages: {need} or more (or leave pages out: batch max x max_pages_per_seq)")

    def model(self) -> None:
        m = self.r.model
        if m is None:
            return
        if m.kind in ("encoder", "decoder"):
            if m.seq_dim not in self.r.dims:
                self.err("model.seq_dim", f"dim {m.seq_dim!r} is not declared under dims", m.seq_dim,
                         fix=f"one of: {', '.join(self.r.dims)}")
            if not (m.hidden and m.layers):
                self.warn("model", f"kind {m.kind} without hidden/layers: using the generic estimate")
        if m.hidden and m.heads and m.hidden % m.heads:
            self.err("model.heads", f"hidden {m.hidden} is not divisible by heads", m.heads)

    def sla(self) -> None:
        s = self.r.sla
        if s is None:
            return
        entries = [("sla", s.p50_ms, s.p99_ms)] + [(f"sla.per_bucket[{i}]", b.p50_ms, b.p99_ms)
                                                   for i, b in enumerate(s.per_bucket)]
        for path, p50, p99 in entries:
            if p50 is None and p99 is None and path != "sla":
                self.err(path, "no p50_ms or p99_ms given", fix="add p50_ms and/or p99_ms")
            if isinstance(p50, (int, float)) and isinstance(p99, (int, float)) and p50 > p99:
                self.err(f"{path}.p50_ms", f"p50 above p99 ({p99} ms)", p50, fix=f"p50_ms <= {p99}")
        for i, b in enumerate(s.per_bucket):
            for dim, sel in b.match.items():
                path = f"sla.per_bucket[{i}].match.{dim}"
                if dim not in self.r.dims:
                    self.err(path, f"dim {dim!r} is not declared under dims", dim,
                             fix=f"one of: {', '.join(self.r.dims)}")
                    continue
                lo, hi = dim_range(self.r.dims[dim])
                a, z = (sel, sel) if isinstance(sel, int) else sel
                if a > z:
                    self.err(path, "range [lo, hi] has lo > hi", sel)
                elif z < lo or a > hi:
                    self.err(path, f"selects nothing: dim {dim} ranges over [{lo}, {hi}]", sel)

    def targets(self) -> None:
        names = [t if isinstance(t, str) else t.name for t in self.r.targets]
        first: dict[str, int] = {}
        for i, n in enumerate(names):
            if first.setdefault(n, i) != i:
                self.err(f"targets[{i}]", "duplicate target", n)
        for i, t in enumerate(self.r.targets):
            if isinstance(t, str) and t.strip().lower() != HOST and first[t] == i:
                try:
                    get_target(t)
                except TargetError as e:
                    self.err(f"targets[{i}]", "unknown target", t, fix=e.fix)

    def aliases(self) -> None:
        names = {i.name for i in self.r.inputs} | set(self.r.outputs)
        owner: dict[str, int] = {}
        for g, group in enumerate(self.r.alias_groups):
            if len(group) < 2:
                self.err(f"alias_groups[{g}]", "an alias group needs at least two names", group)
            for j, n in enumerate(group):
                if n not in names:
                    self.err(f"alias_groups[{g}][{j}]", "not a declared input or output", n,
                             fix=f"one of: {', '.join(sorted(names))}")
                if n in owner and owner[n] != g:
                    self.err(f"alias_groups[{g}][{j}]", f"already in alias group {owner[n]}", n,
                             fix="merge the two groups")
                owner.setdefault(n, g)

    def parallel(self) -> None:
        from graphmode.recipe.parallel_checks import check_parallel
        if self.r.parallel is None or any(e.where and e.where.startswith("dims") for e in self.errors):
            return
        try:
            per_dim = {d: dim_synthesis(s).buckets for d, s in self.r.dims.items()}
        except RecipeError:
            return
        for path, msg, value, fix in check_parallel(self.r, self.t, per_dim):
            self.err(path, msg, value, fix=fix)

    def misc(self) -> None:
        if self.r.replayable and self.r.exe_mode == "eager":
            self.warn("replayable", "replayable has no effect with exe_mode eager")
        if self.r.model and self.r.model.weights_mb and self.r.model.params_m:
            self.warn("model.weights_mb", "both weights_mb and params_m given: weights_mb is used for memory")

    def run(self) -> None:
        check_dims(self)
        check_inputs(self)
        for check in (self.capture, self.optimize, self.codegen, self.precision, self.memory, self.model, self.sla,
                      self.targets, self.aliases, self.determinism, self.parallel, self.misc):
            check()


def check_semantics(recipe: Recipe, target: Any = None, env: Environment | None = None) -> SemanticResult:
    """All layer-2 problems of `recipe` (target-dependent ones only when `target` is given)."""
    c = _Checker(recipe, target)
    c.run()
    res = SemanticResult(sorted(c.errors, key=lambda e: e.line or 0), c.warnings)
    res.requires = check_requires(recipe, env or detect_environment(), target)
    for rc in res.requires:
        if rc.status == "failed":
            path = f"requires.{rc.key}"
            res.errors.append(RecipeError(f"requirement not met: {rc.reason}", where=path, value=rc.constraint,
                                          line=recipe.line_of(path), fix=f"install a {rc.key} matching "
                                                                         f"{rc.constraint} or relax the constraint"))
    return res
