"""Hot reload and renegotiation: a recipe checked now (in the sandbox, then proved with the
running model's facts), compiled and warmed in the background, then swapped in; SLA drift
starts a reload to the next variant."""
from __future__ import annotations

import logging
import weakref
from typing import Any

from graphmode.errors import ConstraintError, GraphmodeError, RecipeError
from graphmode.monitor import DriftEvent
from graphmode.serve.deployment import Deployment, ReloadTicket, _facts_key
from graphmode.serve.errors import NotReady, ReloadBusy, ServerFault, detach

log = logging.getLogger("graphmode.serve")


class Reloading:
    """ModelServer's reload concern (a mixin: it reads the server's config, metrics, locks,
    sandbox and active deployment)."""

    def _set_state(self, state: str, error: GraphmodeError | None = None) -> None:
        self.state, self.error = state, detach(error) if error is not None else None
        if self.on_state is not None:
            try:
                self.on_state(state, error)
            except Exception:  # noqa: BLE001 - a callback must not break the server
                log.exception("on_state callback failed")

    def _initial_deploy(self) -> None:
        self._set_state("warming")
        try:
            with self._prove_lock:
                dep = self._build(self.recipe, "initial")
                for i, v in enumerate(self.variants):
                    try:
                        self._prove(v, dep.facts if _facts_key(v) == dep.facts_key else None)
                    except GraphmodeError as e:
                        e.where = f"variant[{i}]: {e.where}" if e.where else f"variant[{i}]"
                        raise
            self._activate(dep)
            self.metrics.reloads.labels(self.target_name, "initial", "swapped").inc()
            self._set_state("ready")
            self.sandbox.prewarm()           # the first PUT /v1/recipe need not wait for its imports
        except GraphmodeError as e:
            if self.stopping:
                log.info("stopped while loading the recipe")
                return
            log.error("cannot load the recipe: %s", e)
            self.metrics.reloads.labels(self.target_name, "initial", _outcome(e)).inc()
            self._set_state("failed", e)
        except Exception as e:  # noqa: BLE001 - reported, not raised, from a thread
            log.exception("cannot load the recipe")
            self._set_state("failed", ServerFault(f"{type(e).__name__}: {e}", where="startup"))

    def check_recipe(self, body: bytes, kind: str, origin: str = "api") -> Any:
        """Untrusted recipe text (`kind` "json" or "yaml") -> its resolved Recipe, checked in the
        sandbox; a refusal is counted and raised (RecipeRefused). Blocks: call it off the loop."""
        try:
            return self.sandbox.check(body, kind)
        except RecipeError:
            if self.stopping:
                raise NotReady("the server is shutting down", where="recipe",
                               fix="send the recipe to the server that replaces this one") from None
            self.metrics.reloads.labels(self.target_name, origin, "refused").inc()
            raise

    def request_reload(self, recipe: Any, origin: str = "api") -> ReloadTicket | None:
        """Validate now (raises with the reasons), then compile, warm up and swap in the
        background. Returns the ticket, or None when that version is already serving."""
        from graphmode.recipe import load_recipe
        if self.active is None:
            raise NotReady("the server is still loading its first recipe", fix="retry when /readyz answers 200")
        # proofs share Z3's (thread-unsafe) context with a compile: none while one compiles
        if self._compiling() or not self._prove_lock.acquire(timeout=self.config.request_timeout_s):
            raise self._busy(origin)
        try:
            try:
                recipe = self.precheck(self._checked(load_recipe(recipe), "recipe"))
            except GraphmodeError as e:
                self.metrics.reloads.labels(self.target_name, origin, _outcome(e)).inc()
                raise
            if recipe.hash() == self.active.version:
                self.metrics.reloads.labels(self.target_name, origin, "unchanged").inc()
                return None
            ticket = self._start_reload(recipe, origin)
        finally:
            self._prove_lock.release()
        if ticket is None:
            raise self._busy(origin)
        return ticket

    def _compiling(self) -> bool:
        return self.reload is not None and self.reload.state == "compiling"

    def _busy(self, origin: str) -> ReloadBusy:
        busy = self.reload
        self.metrics.reloads.labels(self.target_name, origin, "busy").inc()
        return ReloadBusy(f"recipe {busy.version if busy else '?'} is still loading", where="recipe",
                          fix="wait until GET /v1/recipe shows reload.state != compiling, then retry")

    def _start_reload(self, recipe: Any, origin: str, reason: str = "") -> ReloadTicket | None:
        with self._reload_lock:
            if self._compiling():
                return None
            ticket = ReloadTicket(recipe.hash(), recipe.name, origin,
                                  self.active.version if self.active else None, reason)
            self.reload = ticket
        self._spawn(self._reload_worker, recipe, ticket, name=f"graphmode-reload-{ticket.id}")
        return ticket

    def _reload_worker(self, recipe: Any, ticket: ReloadTicket) -> None:
        try:
            with self._prove_lock:
                dep = self._build(recipe, ticket.origin, ticket)
            self._activate(dep)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), "swapped").inc()
            log.info("swapped to recipe %s (%s), was %s", dep.name, dep.version, ticket.previous)
            ticket.finish("swapped")
        except GraphmodeError as e:
            (log.info if self.stopping else log.error)("recipe %s not loaded: %s", ticket.version, e)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), _outcome(e)).inc()
            ticket.finish("failed", e)
        except Exception as e:  # noqa: BLE001 - reported on the ticket, the old recipe keeps serving
            log.exception("recipe %s not loaded", ticket.version)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), "failed").inc()
            ticket.finish("failed", ServerFault(f"{type(e).__name__}: {e}", where="reload"))

    def _on_drift(self, ref: "weakref.ref[Deployment]", ev: DriftEvent) -> None:
        dep = ref()
        if dep is None or dep is not self.active:
            return                      # late samples of a retired version
        outcome = self.renegotiator.on_drift(ev)
        self.metrics.renegotiations.labels(dep.version, self.target_name, outcome).inc()
        log.warning("SLA drift on %s: %s -> %s", dep.version, ev.describe(), outcome)

    def _renegotiate(self, index: int, variant: Any, ev: DriftEvent) -> bool:
        return self._start_reload(variant, f"variant[{index}]", reason=ev.describe()) is not None


def _outcome(e: BaseException) -> str:
    return "refused" if isinstance(e, (RecipeError, ConstraintError)) else "failed"


def _origin_label(origin: str) -> str:
    return "variant" if origin.startswith("variant") else origin
