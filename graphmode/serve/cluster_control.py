"""What the replicas of `graphmode serve --replicas` share through one Ray actor, the
coordinator (started by ClusterServer before the replicas, named COORDINATOR in Ray Serve's
namespace, living as long as the application):

  * **rolling hot reload.** A replica forwards `PUT /v1/recipe` here. The recipe is checked
    once: parsed in the recipe sandbox, as the single server does, then compiled and proved
    with the model's own facts by `cluster.prepare`, the driver's one compile (a new `.gm`
    for an encoder, the shared plan cache for a decoder). Only then is the application
    deployed again with it: Ray Serve replaces the replicas a few at a time, starting each
    replacement before it stops an old one (`max_surge_percent`), and routes to a
    replacement only once it has proved and warmed the recipe itself (its `reconfigure`);
    an old replica drains the requests it holds before it stops. A rollout that fails puts
    the previous deployment back. One rollout at a time; the answer to the PUT is 202 once
    the rollout starts (the replica answering it may be one the rollout replaces), and
    `GET /v1/recipe` shows the rollout's state;
  * **metrics.** Every replica pushes its Prometheus text here every METRICS_PUSH_S; the
    replica answering `/metrics` merges its own (fresh) text with the others' (`merge_metrics`),
    every series labelled with its replica: nothing is summed;
  * **autoscaling on the SLA.** Ray's controller asks `scale` (through the deployment's
    policy, autoscale.sla_policy) for the replica count; every window the coordinator turns
    the pushed registries into one window per replica (p99, queue depth) and decides
    (autoscale.decide) against the SLA of the recipe served now. `status` shows the decision.

The class is plain Python: ClusterServer makes it a Ray actor (`ray.remote`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from graphmode.errors import GraphmodeError, RecipeError
from graphmode.serve.autoscale import Reading, ScaleRule, ScaleState, decide, reading, sla_p99, window

COORDINATOR = "graphmode-coordinator"
NAMESPACE = "serve"
METRICS_PUSH_S = 1.0
METRICS_STALE_S = 15.0          # a replica that has not pushed for this long is gone (stopped, killed)
REPLICA_LABEL = "replica"

log = logging.getLogger("graphmode.serve.cluster")


class Coordinator:
    """The rollouts and the replicas' metrics (see the module's docstring)."""

    def __init__(self, served: Any, recipe: Any, config: Any, cluster: Any, scale_rule: ScaleRule | None = None):
        """`recipe`: the one `served` serves (read by the driver: an artifact's, checked on its host);
        `scale_rule`: when to add or remove replicas (autoscaling on), its SLA the recipe's."""
        from graphmode.recipe.targets import pick_target
        from graphmode.serve.sandbox import RecipeSandbox
        self.served, self.recipe, self.config, self.cluster = served, recipe, config, cluster
        self.target = pick_target(self.recipe, config.target)
        self.sandbox = RecipeSandbox(self.target, cpu_s=config.recipe_check_cpu_s,
                                     memory_mb=config.recipe_check_memory_mb, max_plans=config.max_plans)
        self.lock = threading.Lock()
        self.rollout: dict[str, Any] = {"state": "none", "version": self.recipe.hash(), "name": self.recipe.name}
        self.rolling: threading.Thread | None = None     # the rollout under way, if any
        self.pushed: dict[str, tuple[float, bytes]] = {}
        self.rule = scale_rule                          # None: a fixed replica count
        self.scaling: ScaleState | None = None
        self.readings: dict[str, Reading] = {}          # each replica's push at the last window
        self.judged_at = 0.0

    def ready(self) -> bool:
        return True

    # ---- the rolling reload -------------------------------------------------------------------
    def reload(self, body: bytes, kind: str) -> tuple[int, dict[str, Any]]:
        """Check and compile the recipe once, then start the rollout: (HTTP status, JSON body)."""
        from graphmode.serve.errors import ReloadBusy
        with self.lock:
            if self.rollout["state"] in ("checking", "rolling"):
                return _failure(ReloadBusy(f"recipe {self.rollout['version']} is still "
                                           f"{self.rollout['state']}", where="recipe",
                                           fix="wait until GET /v1/recipe shows rollout.state done or failed, "
                                               "then retry"))
            before = dict(self.rollout)
            self.rollout = {"state": "checking", "version": None, "previous": self.recipe.hash()}
        try:
            recipe, served = self._checked(body, kind)
        except Exception as e:  # noqa: BLE001 - answered; the replicas keep the recipe they serve
            with self.lock:
                self.rollout = before
            if not isinstance(e, GraphmodeError):
                log.exception("the new recipe could not be checked")
            return _failure(e)
        if served is None:
            with self.lock:
                self.rollout = before
            return 200, {"status": "unchanged", "version": recipe.hash()}
        with self.lock:
            self.rollout = {"state": "rolling", "version": recipe.hash(), "name": recipe.name,
                            "previous": self.recipe.hash(), "started": time.time()}
            answer = dict(self.rollout)
        self.rolling = threading.Thread(target=self._roll, args=(recipe, served), daemon=True,
                                        name="graphmode-rollout")
        self.rolling.start()
        return 202, {"status": "rolling", **answer}

    def _checked(self, body: bytes, kind: str) -> tuple[Any, Any]:
        """The sandbox's checks, then the one compile and proof; (recipe, None) when it is the one served."""
        from graphmode.serve.cluster import prepare
        from graphmode.serve.sandbox import checked
        from graphmode.serve.server import refuse_tensor_parallel
        if not body.strip():
            raise RecipeError("empty recipe", where="body", fix="send the recipe as YAML or JSON")
        recipe = checked(self.sandbox.check(body, kind), self.target, "recipe", self.config.max_plans)
        refuse_tensor_parallel(recipe)
        if recipe.hash() == self.recipe.hash():
            return recipe, None
        if self.served.source is None:
            raise RecipeError(f"the replicas serve the artifact {self.served.model} as given (--model FILE.gm): it "
                              f"serves only the recipe it was compiled with ({self.recipe.name} "
                              f"#{self.recipe.hash()})", where="recipe",
                              fix="serve the model itself (--model SPEC --recipe ...) to hot-reload recipes across "
                                  "replicas, or compile the new recipe into an artifact and start again with it")
        return recipe, prepare(self.served.source, recipe, self.config)

    def _roll(self, recipe: Any, served: Any) -> None:
        from graphmode.serve.cluster import deploy
        from graphmode.serve.errors import error_dict
        old, old_recipe = self.served, self.recipe
        try:
            deploy(served, recipe, self.config, self.cluster)
            with self.lock:
                self.served, self.recipe = served, recipe
                self.rollout.update(state="done", finished=time.time())
            log.info("rolled every replica to recipe %s (%s)", recipe.name, recipe.hash())
        except Exception as e:  # noqa: BLE001 - reported on the rollout; the previous deployment is put back
            log.error("the rollout of recipe %s failed: %s", recipe.hash(), e)
            with self.lock:
                self.rollout.update(state="failed", error=error_dict(e), finished=time.time())
            try:
                deploy(old, old_recipe, self.config, self.cluster)
            except Exception:  # noqa: BLE001
                log.exception("the previous deployment could not be put back")

    def status(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.rollout)

    def autoscaler(self) -> dict[str, Any]:
        """The autoscaler's rule and last decision (`desired`, `running`, `why`), or `off`."""
        with self.lock:
            if self.rule is None:
                return {"state": "off", "why": "a fixed replica count (--replicas without --min/--max-replicas)"}
            rule = replace(self.rule, sla_p99_ms=sla_p99(self.recipe))
            return {"state": "on", **(self.scaling.to_dict() if self.scaling else {"why": "no window judged yet"}),
                    "rule": rule.to_dict()}

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """The rollout's state once it has ended (or after `timeout_s`, still rolling)."""
        if self.rolling is not None:
            self.rolling.join(timeout_s)
        return self.status()

    # ---- autoscaling -------------------------------------------------------------------------
    def scale(self, running: int, target: int) -> dict[str, Any]:
        """The replica count to aim for (Ray's controller asks about every 0.1 s; a window is
        judged every rule.window_s, from the replicas' pushes since the last one)."""
        now = time.monotonic()
        with self.lock:
            if self.rule is None:
                return {"desired": target}
            if self.scaling is not None and now - self.judged_at < self.rule.window_s:
                return self.scaling.to_dict()
            readings = {replica: reading(text) for replica, (at, text) in list(self.pushed.items())
                        if now - at <= max(3 * METRICS_PUSH_S, self.rule.window_s)}
            windows = {replica: window(self.readings.get(replica), r) for replica, r in readings.items()}
            rule = replace(self.rule, sla_p99_ms=sla_p99(self.recipe))
            before = self.scaling or ScaleState(desired=target)
            self.scaling = decide(rule, before, windows, running, target)
            self.readings, self.judged_at = readings, now
            if self.scaling.desired != before.desired:
                log.info("autoscaling: %s", self.scaling.why)
            return self.scaling.to_dict()

    # ---- metrics ------------------------------------------------------------------------------
    def push(self, replica: str, text: bytes) -> None:
        self.pushed[replica] = (time.monotonic(), text)

    def metrics(self) -> dict[str, bytes]:
        """The latest text of every replica that pushed within METRICS_STALE_S."""
        now = time.monotonic()
        for replica, (at, _) in list(self.pushed.items()):
            if now - at > METRICS_STALE_S:
                del self.pushed[replica]
        return {replica: text for replica, (_, text) in self.pushed.items()}


_asked: dict[str, Any] = {}      # deployment -> the coordinator's answer on its way (a future), in Ray's controller
_coordinator: list[Any] = []


def ask_coordinator(ctx: Any) -> tuple[int, dict[str, Any]]:
    """autoscale.sla_policy's work, in Ray's controller, which must not block: the coordinator's
    last answer (`scale`), and the next question sent (its answer is read on a later call)."""
    key = str(ctx.deployment_id)
    desired = int(ctx.policy_state.get("desired", ctx.target_num_replicas))
    pending = _asked.get(key)
    if pending is not None and pending.done():
        del _asked[key]
        try:
            desired = int(pending.result()["desired"])
        except Exception:  # noqa: BLE001 - the coordinator restarted or stopped: keep the last answer
            _coordinator.clear()
    if key not in _asked:
        try:
            if not _coordinator:
                import ray
                _coordinator.append(ray.get_actor(COORDINATOR, namespace=NAMESPACE))
            _asked[key] = _coordinator[0].scale.remote(ctx.current_num_replicas, ctx.target_num_replicas).future()
        except Exception:  # noqa: BLE001 - no coordinator (stopping): the count stays
            _coordinator.clear()
    return desired, {"desired": desired}


def _failure(e: BaseException) -> tuple[int, dict[str, Any]]:
    from graphmode.serve.errors import ServerFault, error_dict, http_status
    if not isinstance(e, GraphmodeError):
        e = ServerFault(f"{type(e).__name__}: {e}", where="reload")
    status = http_status(e)
    return status, {**error_dict(e), "status": status}


def merge_metrics(texts: dict[str, bytes]) -> bytes:
    """Prometheus texts of several replicas as one exposition: each family once, every sample
    with a `replica` label (nothing summed: a dashboard sums or compares them itself)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar)

    class Merged:
        def collect(self) -> Any:
            return iter(families.values())
    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)
