"""How the server loads a recipe: check it against the model (or the artifact it serves),
compile it through the driver, read the driver's proof (never proving a compiled recipe
again), warm up every bucket or the decode engine, check the memory budget. A decoder
lowers one graph at load, the decode engine's (its whole-sequence graph waits for the first
/v1/infer or KServe request)."""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from graphmode.errors import ConstraintError, RecipeError
from graphmode.monitor import ContractMonitor, SlaDriftProbe, bucket_label
from graphmode.progress import stage
from graphmode.serve.deployment import Deployment, ReloadTicket, _facts_key
from graphmode.serve.errors import NotReady
from graphmode.serve.sandbox import checked

log = logging.getLogger("graphmode.serve")


class Loading:
    """ModelServer's loading concern (a mixin: it reads the server's config, target, model,
    metrics and artifact)."""

    def _resolve_model(self, model: Any) -> Any:
        if self.artifact is not None:
            return None                          # no module: the artifact holds the graph and its plans
        if isinstance(model, str):
            from graphmode.capture.spec import BareModuleError, resolve_model_spec
            try:
                return resolve_model_spec(model)     # built once, reused by every reload
            except BareModuleError as e:         # 'pkg.mod:fn' returning the module alone: the recipe
                return e.module                  # declares its inputs, as for compile, run and generate
        return model

    def _checked(self, recipe: Any, what: str) -> Any:
        """Schema, semantics and the plan bound now (field errors refuse it before anything compiles)."""
        recipe = checked(recipe, self.target, what, self.config.max_plans)
        try:
            self.fits_model(recipe)
        except RecipeError as e:
            e.where = f"{what}: {e.where}" if e.where else what
            raise
        return recipe

    def _facts(self, cm: Any) -> Any:
        """The facts the recipe's proofs are checked against: the driver's (`cm.lowered`), or for
        a loaded artifact its graph's own (None for an eager model: no graph)."""
        if getattr(cm, "facts", None) is not None:      # a tensor-parallel group: rank 0's shard's
            return cm.facts
        from graphmode.compile_report import facts_of
        return facts_of(cm)

    def _prove(self, recipe: Any, facts: Any) -> Any:
        from graphmode.recipe import validate
        from graphmode.recipe.validate import SAVED       # the SLA as compile proves it: with a saved calibration
        report = validate(recipe, self.target, facts, calibration=SAVED, cache_dir=self.config.cache_dir)
        if not report.ok:
            try:
                report.raise_for_errors()
            except ConstraintError as e:
                e.proofs = [p.to_dict() for p in report.proofs]  # type: ignore[attr-defined]
                raise
        return report

    def fits_model(self, recipe: Any) -> None:
        """The recipe must declare the model's inputs, with the model's rank and fixed dims
        (checked now, so the answer to PUT says it instead of a failed background compile)."""
        from graphmode.capture.source import resolve_model
        if self.group is not None:
            self._group_serves(recipe)
        if self.artifact is not None:
            self._artifact_serves(recipe)
            return
        resolve_model(self.model, recipe)                  # names (RecipeError)
        if recipe.memory.kv_cache is not None and recipe.exe_mode != "eager" and tensor_parallel(recipe) == 1:
            from graphmode.decode.api import causal_lm
            from graphmode.decode.engine import check_decoder_recipe
            check_decoder_recipe(causal_lm(self.model, where="--model"), recipe)
        dims = getattr(self.model, "input_dims", None)
        if not isinstance(dims, dict):
            return
        for spec in recipe.inputs:
            want = dims.get(spec.name)
            if want is None:
                continue
            fixed_ok = len(want) == len(spec.shape) and all(
                not isinstance(w, int) or not isinstance(g, int) or w == g for w, g in zip(want, spec.shape))
            if not fixed_ok:
                raise RecipeError(f"input {spec.name!r} has shape {list(spec.shape)} in the recipe but "
                                  f"{list(want)} in the model", where=f"inputs.{spec.name}.shape",
                                  line=recipe.line_of("inputs"), fix=f"declare shape {list(want)}")

    def _artifact_serves(self, recipe: Any) -> None:
        built = self.artifact_recipe
        # resolved on this target both (a rank's file keeps its recipe's ${target...} values unresolved)
        if self._resolved(recipe).hash() != self._resolved(built).hash():
            raise RecipeError(f"the artifact {self.artifact.name} serves only the recipe it was compiled with "
                              f"({built.name} #{built.hash()}), not {recipe.name} #{recipe.hash()}",
                              fix="compile the new recipe into an artifact (graphmode compile --save) and serve "
                                  "that, or serve the model itself (--model SPEC) to hot-reload recipes")

    def _group_serves(self, recipe: Any) -> None:
        """A group started before the server (torchrun's ranks) serves the recipe its ranks compiled, once."""
        started = self.group.recipe
        if getattr(self, "active", None) is not None or self._resolved(recipe).hash() != self._resolved(started).hash():
            raise RecipeError(f"the ranks torchrun started serve the recipe they compiled ({started.name} "
                              f"#{self._resolved(started).hash()}); a reload would need every rank to compile again",
                              where="recipe", fix="stop the group and start it again with the new recipe "
                                                  "(torchrun ... graphmode rank --recipe NEW --serve-port)")

    def precheck(self, recipe: Any) -> Any:
        """Layers 1-3 with the running model's facts; raises RecipeErrors / ConstraintError."""
        self.fits_model(recipe)
        dep = self.active
        facts = dep.facts if dep is not None and _facts_key(recipe) == dep.facts_key else None
        return self._prove(recipe, facts).recipe

    def _build(self, recipe: Any, origin: str, ticket: ReloadTicket | None = None) -> Deployment:
        """Compile (the driver proves with the new graph's facts), warm up every bucket, check memory."""
        from graphmode.compiler import compile as gm_compile
        from graphmode.api import load as load_artifact
        t0 = time.perf_counter()
        ranks = tensor_parallel(recipe)
        with stage(self.on_stage, "ranks", detail=f"{ranks} processes start") \
                if ranks > 1 and self.group is None else nullcontext():
            if self.group is not None:              # started before the server (graphmode rank --serve-port)
                cm = self.group
            elif self.artifact is not None:         # a group file starts its ranks from their own files
                cm = load_artifact(self.artifact, cache_dir=self.config.cache_dir, threads=self.config.threads,
                                   on_stage=self.on_stage)
                self._artifact_serves(cm.recipe)         # the file replaced since it was read: refused
            elif ranks > 1 and recipe.memory.kv_cache is not None:
                cm = self._ranks(recipe, self._heard(ticket))
            else:     # rank processes resolve a spec themselves: a resolved bundle's wrapper need not pickle
                cm = gm_compile(self.model_spec if ranks > 1 and self.model_spec else self.model, recipe, self.target,
                                cache_dir=self.config.cache_dir, threads=self.config.threads,
                                on_stage=self._heard(ticket) if ranks > 1 else self.on_stage)
        if ranks > 1 and recipe.memory.kv_cache is None:
            from graphmode.runtime.served_group import ServedGroup
            cm = ServedGroup(cm)                 # requests checked here, run on the ranks
        try:
            return self._deploy(cm, recipe, origin, ticket, t0)
        except BaseException:
            if tensor_parallel(recipe) > 1:
                cm.close()                       # its rank processes too
            raise

    def _ranks(self, recipe: Any, on_stage: Any) -> Any:
        """A decoder recipe's `parallel.tensor` rank processes, started once for the deployment:
        each compiles its shard and builds its plans (decode/tensor_parallel.py)."""
        from graphmode.decode.api import causal_lm
        from graphmode.decode.tensor_parallel import launch_decoder
        # the transformers model crosses to the ranks (a bundle's wrapper need not pickle)
        return launch_decoder(causal_lm(self.model), recipe, self.target, cache_dir=self.config.cache_dir,
                              threads=self.config.threads, on_stage=on_stage)

    def _heard(self, ticket: ReloadTicket | None) -> Any:
        """The server's progress callback for a rank group's start; a reload's ticket follows rank
        0's plan builds too (the ranks build every plan before they report ready)."""
        if ticket is None:
            return self.on_stage

        def on_stage(s: Any) -> None:
            if s.name == "plans" and s.total:
                ticket.progress = (s.done, s.total)
            if self.on_stage is not None:
                self.on_stage(s)
        return on_stage

    def _deploy(self, cm: Any, recipe: Any, origin: str, ticket: ReloadTicket | None, t0: float) -> Deployment:
        self._unless_stopping()
        decoding = recipe.memory.kv_cache is not None and cm.mode != "eager"
        if decoding:
            # one lowering: the paged graph completions run, proved with its own facts; the
            # whole-sequence graph (/v1/infer, KServe) is lowered on first use (runtime/deferred.py)
            low = self._engine(cm).lowered       # None for a loaded decoder .gm: proved at its compile
            facts, recipe = (low.facts if low is not None else None), self._resolved(recipe)
        else:
            facts = self._facts(cm)
            # the driver proved it with the new graph's facts and the model keeps that proof: it is
            # read, not proved again (an artifact or an eager model, which the driver did not prove here, is)
            recipe = (cm.proof if cm.proof is not None else self._prove(recipe, facts)).recipe
        cfg = self.config
        probe = SlaDriftProbe(window_s=cfg.sla_window_s, step_s=cfg.sla_step_s, margin=cfg.sla_margin,
                              consecutive=cfg.sla_windows, min_samples=cfg.sla_min_samples, clock=self.clock)
        mon = ContractMonitor(recipe, version=recipe.hash(), target=self.target_name, metrics=self.metrics,
                              probe=probe)
        cm.monitor = mon
        dep = Deployment(recipe, cm, mon, origin=origin, facts=facts, max_batch=cfg.max_batch)
        if decoding:
            dep.decoder = self._decoder(dep, ticket)   # its prefill/decode plans, not the whole-sequence buckets
        elif served_group(cm):                   # every rank built every bucket's plan at start
            dep.warmed = len(dep.buckets)
        elif cm.mode != "eager":
            with stage(self.on_stage, "plans", total=len(dep.buckets)) as plans:
                for i, env in enumerate(dep.buckets):
                    self._unless_stopping()
                    cm.executable(env, report_build=False)
                    dep.warmed = i + 1
                    if ticket is not None:
                        ticket.progress = (i + 1, len(dep.buckets))
                    plans.step(bucket_label(env))
            over = mon.check_memory(cm, dep.buckets)
            if over:
                log.warning("recipe %s: plans over the memory budget in buckets %s", dep.version, over)
        log.info("recipe %s (%s) compiled and warm: %d plan(s) in %.1fs", recipe.name, dep.version,
                 dep.plans, time.perf_counter() - t0)
        return dep

    def _engine(self, cm: Any) -> Any:
        """The decode engine of a decoder recipe's model: the deployment's one lowering at load.

        /v1/infer and KServe answer the recipe's whole-sequence contract (input_ids and
        attention_mask -> logits at every position, no cache), completions run the paged graph
        (token ids and their positions over the KV pool -> logits at each sequence's last
        position, graphmode/decode/engine.py: capture, verdict, `to_paged` and the recipe's
        passes, proof). The engine's graph is lowered now and its proof, with that graph's
        facts, is the deployment's; the whole-sequence graph is lowered on the first request
        that needs it (`Serving.whole_sequence`), where a recipe it refuses is answered 422 with
        the reason. Both graphs' parameters are the module's own tensors."""
        from graphmode.decode.api import engine_of
        return engine_of(cm)

    def _resolved(self, recipe: Any) -> Any:
        """The recipe resolved on the target, as a proof's report holds it (the engine's proof
        holds its decode contract: other inputs, no outputs)."""
        from graphmode.recipe.resolve import resolve
        from graphmode.recipe.targets import pick_target
        return resolve(recipe, pick_target(recipe, self.target))

    def _decoder(self, dep: Deployment, ticket: ReloadTicket | None) -> Any:
        """The deployment's decode engine, warmed up, behind its decode thread (completions)."""
        from graphmode.decode.runner import plan_count
        from graphmode.serve.generation import DecodeLoop
        eng = self._engine(dep.cm)
        dep.plans = plan_count(dep.recipe)

        def built(n: int, of: int) -> None:
            dep.warmed, dep.plans = n, of
            if ticket is not None:
                ticket.progress = (n, of)
        self._unless_stopping()
        eng.warmup(built)
        built(dep.plans, dep.plans)        # a tensor-parallel group's ranks built theirs before ready
        series = self.metrics.decode_series(dep.version, self.target_name, speculative="draft_tokens" in eng.stats)
        loop = DecodeLoop(eng, series, name=f"decode-{dep.version}")
        self._decoders.add(loop)
        return loop

    def _unless_stopping(self) -> None:
        """Between the steps of a build: a stopping server abandons it (its thread ends soon)."""
        if self.stopping:
            raise NotReady("the server is shutting down", where="reload")


def tensor_parallel(recipe: Any) -> int:
    from graphmode.compiler import tensor_parallel as degree       # lazily: the server starts without the compiler
    return degree(recipe)


def served_group(cm: Any) -> bool:
    """Whether `cm` is an encoder's rank group (runtime/served_group.py; not imported here: the
    server starts without the compiler)."""
    return getattr(cm, "group", None) is not None


def refuse_tensor_parallel(recipe: Any) -> None:
    """A Ray Serve replica (serve/cluster*.py) runs in one process: `parallel.tensor` > 1 is
    refused (RecipeError), as each replica would have to start and own its rank processes."""
    if tensor_parallel(recipe) > 1:
        raise RecipeError(f"Ray Serve replicas do not run tensor-parallel ranks (tensor {tensor_parallel(recipe)}): "
                          "each replica is one process that Ray places, restarts and scales, and its ranks would be "
                          "processes outside Ray's placement and health checks", where="parallel.tensor",
                          line=recipe.line_of("parallel"),
                          fix="tensor: 1 for replicas; `graphmode serve` without --replicas (one server) starts the "
                              "ranks of a tensor-parallel recipe, encoder or decoder (docs/tensor-parallel.md)")


def artifact_path(model: Any) -> Path | None:
    """`model` as a `.gm` artifact's path, or None when it is anything else."""
    from graphmode.runtime.artifact import is_artifact
    if is_artifact(model):
        return Path(model)
    return None
