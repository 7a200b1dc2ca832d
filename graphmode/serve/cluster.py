"""Replicas of the model server on Ray Serve (`graphmode serve --replicas N`, extra `serve-cluster`).

Ray places, health-checks and restarts the replicas and routes HTTP to them through its proxy
and graphmode's front (cluster_front: it retries a request whose replica died, or answers a
retryable 503); graphmode brings what each replica runs: the same ModelServer and Starlette
app as the plain server (graphmode/serve/app.py), built inside a Ray Serve deployment. A
coordinator actor (cluster_control) rolls a hot reload across the replicas and merges their
/metrics. Nothing is compiled per replica:

  * an encoder is compiled once by the driver and saved as one `.gm` artifact (or the
    `--model` given is one already); every replica, a restarted one included, loads that
    file: no capture, no kernel build (`graphmode.runtime.artifact`), the tokenizer included;
  * a decoder (replicas do not serve decoder artifacts yet) is compiled and warmed once by the driver into
    the shared plan cache; the replicas capture its graphs again but take every plan and
    kernel library from that cache.

Each replica proves the recipe with its own graph's facts, as the plain server does, so the
recipe's SLA and memory budget hold per replica; the budget is also the replica's Ray
`memory` resource, so Ray places no more replicas on a node than their budgets fit.
Autoscaling between `min_replicas` and `max_replicas` follows the recipe's SLA: Ray Serve
applies the count that graphmode's policy (autoscale.sla_policy) gets from the coordinator,
which judges each replica's p99 and queue depth (autoscale.decide). The KB path is passed to every replica, which records to
that one SQLite file (on a shared file system across nodes).

Ray is imported only here and only when a cluster is asked for: `import graphmode.serve`
and the plain server never need it (`require_ray` names the extra when it is missing).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import socket
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphmode.errors import GraphmodeError
from graphmode.progress import OnStage

log = logging.getLogger("graphmode.serve.cluster")

EXTRA = "serve-cluster"
APP_NAME = "graphmode"
DEPLOYMENT = "GraphmodeReplica"
REPLICA_ROUTE = "/v1/replica"
MB = 2**20
SURGE = 1             # replicas started beyond the count during a rolling reload
FRONT_MAX_REQUESTS = 10_000   # the front only relays: the replicas' own limits hold requests back
POLICY = "graphmode.serve.autoscale:sla_policy"   # the replicas' Ray Serve autoscaling policy


def require_ray() -> Any:
    """`ray.serve`, or a clear error naming the extra that installs it."""
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as e:
        raise GraphmodeError(f"serving replicas needs Ray Serve, which is not installed ({e})", where="--replicas",
                             fix=f"pip install 'graphmode[{EXTRA}]' (it pins ray[serve]), or serve one process "
                                 "without --replicas") from None
    return serve


@dataclass
class ClusterConfig:
    """How many replicas, where, and with what resources (the `--replicas` family of flags)."""
    replicas: int = 1                       # the fixed count, or the initial one when autoscaling
    min_replicas: int | None = None         # either bound set: Ray Serve autoscaling between them
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None   # autoscaling: requests per replica (default: the largest batch)
    scale_queue_depth: float | None = None  # autoscaling: waiting requests per replica that add one (default: the largest batch)
    scale_window_s: float = 2.0             # autoscaling: one window of p99 and queue depth
    scale_up_windows: int = 3               # ... over the SLA (or the queue bound) this many windows in a row: one more
    scale_down_windows: int = 15            # ... well under both this many windows in a row: one fewer
    address: str | None = None              # an existing Ray cluster ("auto", "ray://host:10001", ...); None: start one
    host: str = "127.0.0.1"                 # Ray Serve's HTTP proxy
    port: int = 8000
    replica_cpus: float = 1.0
    health_check_period_s: float = 10.0
    replica_ready_timeout_s: float = 600.0          # a replica that is not warm by then fails its start

    def __post_init__(self) -> None:
        checks = [("replicas", self.replicas >= 1),
                  ("min_replicas", self.min_replicas is None or self.min_replicas >= 0),
                  ("max_replicas", self.max_replicas is None or self.max_replicas >= 1),
                  ("replica_cpus", self.replica_cpus > 0),
                  ("health_check_period_s", self.health_check_period_s > 0),
                  ("replica_ready_timeout_s", self.replica_ready_timeout_s > 0),
                  ("target_ongoing_requests", self.target_ongoing_requests is None
                   or self.target_ongoing_requests > 0),
                  ("scale_queue_depth", self.scale_queue_depth is None or self.scale_queue_depth >= 0),
                  ("scale_window_s", self.scale_window_s > 0),
                  ("scale_up_windows", self.scale_up_windows >= 1),
                  ("scale_down_windows", self.scale_down_windows >= 1)]
        for name, ok in checks:
            if not ok:
                raise GraphmodeError("invalid cluster option", where=f"--{name.replace('_', '-')}",
                                     value=getattr(self, name))
        lo, hi = self.bounds
        if not lo <= self.replicas <= hi:
            raise GraphmodeError(f"--replicas {self.replicas} is outside --min-replicas {lo} .. --max-replicas {hi}",
                                 where="--replicas", value=self.replicas, fix="pick a count within the bounds")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        if not self.autoscaling:
            return self.replicas, self.replicas
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
        if lo > hi:
            raise GraphmodeError(f"--min-replicas {lo} is more than --max-replicas {hi}", where="--min-replicas",
                                 value=lo, fix="make --min-replicas at most --max-replicas")
        return lo, hi


@dataclass
class Served:
    """What every replica loads: the model (a `.gm` path, or the spec the driver compiled into
    the shared cache), the recipe (None: the artifact's own), and the model the driver
    compiles a reloaded recipe from (None for an artifact given as `--model`: it serves only
    its own recipe)."""
    model: Any
    recipe: Any
    compiled_by_driver: bool
    seconds: float
    source: Any = None


# ---- the driver: compile once ---------------------------------------------------------------

def replica_config(config: Any, cluster: ClusterConfig) -> Any:
    """The server options every replica gets, and the driver compiles with: absolute paths (a
    replica runs in another folder) and a fixed thread count, by default the CPUs Ray reserves
    per replica. Kernels are built for a thread count, and Ray starts its workers with
    OMP_NUM_THREADS set to their CPUs, so a count left to each process would differ between
    the driver and the replicas and every replica would build its kernels again."""
    threads = config.threads or max(1, math.ceil(cluster.replica_cpus))
    return dataclasses.replace(config, threads=threads, kb=_absolute(config.kb), cache_dir=_absolute(config.cache_dir))


def prepare(model: Any, recipe: Any, config: Any, *, on_stage: OnStage | None = None) -> Served:
    """Compile once (with `replica_config`'s options), before any replica starts. An encoder
    becomes one `.gm` artifact under the cache (`--model` may be one already); a decoder is
    compiled and warmed into the shared plan cache; an eager recipe has nothing to compile.
    The artifact is loaded here once as well: that checks it runs on this host and unpacks it
    into the shared cache, so replicas starting together find it unpacked."""
    import graphmode
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.recipe.targets import pick_target
    from graphmode.serve.server import artifact_path, refuse_tensor_parallel
    t0 = time.perf_counter()
    if artifact_path(model) is not None:
        path = artifact_path(model).resolve()
        graphmode.load(path, cache_dir=config.cache_dir, threads=config.threads, on_stage=on_stage)
        if recipe is not None:
            from graphmode.runtime.artifact import recipe_of
            built, asked = recipe_of(path), load_recipe(recipe)
            if built.hash() != asked.hash():
                raise GraphmodeError(f"{path.name} was compiled with recipe {built.name} #{built.hash()}, not "
                                     f"{asked.name} #{asked.hash()}", where="--recipe",
                                     fix="leave --recipe out to serve the artifact's recipe, or compile this one "
                                         "(graphmode compile --save)")
        return Served(str(path), None, False, time.perf_counter() - t0)
    rec = load_recipe(recipe)
    refuse_tensor_parallel(rec)            # before the driver's compile would start the ranks
    model = _portable(model)
    if rec.exe_mode == "eager":
        return Served(model, rec, False, time.perf_counter() - t0, model)
    cm = graphmode.compile(model, rec, pick_target(rec, config.target), cache_dir=config.cache_dir,
                           threads=config.threads, on_stage=on_stage)     # the target a replica's server picks
    if rec.memory.kv_cache is not None:
        from graphmode.decode.api import engine_of
        cm.warmup()                        # /v1/infer's whole-sequence plans, built lazily by a replica
        engine_of(cm).warmup()             # completions' prefill/decode plans; all of them land in the shared cache
        return Served(model, rec, True, time.perf_counter() - t0, model)
    path = cache_layout(config.cache_dir).artifacts / f"{rec.name}-{rec.hash()}.gm"
    cm.save(path)
    graphmode.load(path, cache_dir=config.cache_dir, threads=config.threads)
    return Served(str(path.resolve()), None, True, time.perf_counter() - t0, model)


def _portable(model: Any) -> Any:
    """A spec naming a file (`path/file.py:function`, `model.onnx`) made absolute: replicas
    may run in another working folder."""
    if not isinstance(model, str):
        return model
    file, sep, func = model.partition(":")
    if file.endswith((".py", ".onnx")) and Path(file).exists():
        return str(Path(file).resolve()) + sep + func
    return model


# ---- the replica ------------------------------------------------------------------------------

class GraphmodeReplica:
    """One replica: a ModelServer and its app, which HTTP requests reach through the front
    (cluster_front, `forward`). Ray Serve calls `reconfigure`, which starts the server and
    returns once the recipe is warm or raises with the server's error; only then does Ray
    route to it. `check_health` fails when the
    server has failed, so Ray replaces the replica and shows the error in its status."""

    def __init__(self, model: Any, recipe: Any, config: Any):
        from ray import serve

        from graphmode.serve.server import ModelServer
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.changed = threading.Event()
        self.pushing: asyncio.Task | None = None
        self.app: ReplicaApp | None = None
        self.server = ModelServer(model, recipe, config=config, on_state=lambda state, error: self.changed.set())

    async def _start(self) -> None:
        """The server and its app, started on the replica's event loop (where `forward` runs);
        the app's lifespan is this and `__del__`: the front is the HTTP ingress, not this."""
        from graphmode.serve.app import create_app
        self.app = ReplicaApp(create_app(self.server), self)
        await self.server.start()

    async def __del__(self) -> None:
        """Ray's graceful stop, once the requests held here are answered: the server's stop."""
        if self.app is not None:
            await self.server.stop()

    async def forward(self, request: dict, body: bytes) -> Any:
        """A request from the front (cluster_front.GraphmodeFront), through this replica's app:
        the ASGI messages it sends, as they come (a stream's events included), in lists."""
        from graphmode.serve.cluster_front import relay
        async for batch in relay(self.app, request, body):
            yield batch

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        if self.app is None:
            await self._start()
        deadline = time.monotonic() + float(user_config.get("replica_ready_timeout_s", 600.0))
        while self.server.state not in ("ready", "failed"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise GraphmodeError(f"replica {self.replica} was not warm within "
                                     f"{user_config.get('replica_ready_timeout_s')} s", where="--replica-ready-timeout-s")
            self.changed.clear()
            if self.server.state not in ("ready", "failed"):
                await asyncio.to_thread(self.changed.wait, min(left, 5.0))
        self.check_health()
        if self.pushing is None:
            self.pushing = asyncio.get_running_loop().create_task(self._push_metrics())

    def metrics_text(self) -> bytes:
        """This replica's Prometheus text, its queue depth read now (as the single server's /metrics)."""
        server = self.server
        if server.batcher is not None:
            server.metrics.queue_depth.labels(server.target_name).set(server.batcher.depth())
        return server.metrics.text()

    async def _push_metrics(self) -> None:
        """Every METRICS_PUSH_S, this replica's metrics to the coordinator, for the cluster's /metrics."""
        from graphmode.serve.cluster_control import METRICS_PUSH_S
        while True:
            try:
                await coordinator().push.remote(self.replica, self.metrics_text())
            except Exception as e:  # noqa: BLE001 - the next push tries again
                log.warning("replica %s: metrics not pushed: %s", self.replica, e)
            await asyncio.sleep(METRICS_PUSH_S)

    def check_health(self) -> None:
        if self.server.state == "failed":
            e = self.server.error
            raise GraphmodeError(f"replica {self.replica}: {e.message if e else 'the recipe could not be loaded'}",
                                 where=getattr(e, "where", None) or "startup", fix=getattr(e, "fix", None))

    def describe(self) -> dict[str, Any]:
        """Which replica answered, what it loaded, and how many kernels it compiled (0 for one
        serving an artifact or the shared cache)."""
        from graphmode.backends.cpu.build import compiles_in_process
        dep = self.server.active
        artifact = getattr(dep.cm, "artifact", None) if dep is not None else None
        return {"replica": self.replica, "pid": os.getpid(), "state": self.server.state,
                "version": dep.version if dep is not None else None,
                "artifact": artifact and {"path": artifact["path"], "digest": artifact["digest"]},
                "kernel_compiles": compiles_in_process()}


def coordinator() -> Any:
    """The cluster's coordinator actor (cluster_control.Coordinator)."""
    import ray

    from graphmode.serve.cluster_control import COORDINATOR, NAMESPACE
    return ray.get_actor(COORDINATOR, namespace=NAMESPACE)


class ReplicaApp:
    """The model server's app, plus the replica's name on every answer (`X-Graphmode-Replica`)
    and `GET /v1/replica` (GraphmodeReplica.describe): behind Ray's proxy a client sees one
    endpoint; these say which replica answered."""

    def __init__(self, app: Any, replica: GraphmodeReplica):
        self.app, self.replica = app, replica
        self.header = (b"x-graphmode-replica", replica.replica.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == REPLICA_ROUTE and scope["method"] == "GET":
            return await self._answer(send, 200, self.replica.describe())
        route = (scope["method"], scope["path"])
        if route == ("PUT", "/v1/recipe"):
            return await self._reload(scope, receive, send)
        if route == ("GET", "/metrics"):
            return await self._metrics(send)
        if route == ("GET", "/v1/recipe"):
            return await self._recipe(send)
        await self.app(scope, receive, self._labelled(send))

    def _labelled(self, send: Any) -> Any:
        async def labelled(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)
        return labelled

    async def _reload(self, scope: dict, receive: Any, send: Any) -> None:
        """PUT /v1/recipe: the single server's checks of the request (admin token, query,
        content type, size), then the coordinator's rolling reload (cluster_control)."""
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import Response

        from graphmode.serve.app import (RECIPE_MAX_BYTES, JSONAnswer, authorize, error_response, read_body,
                                         recipe_kind, reload_options)
        cfg, request = self.replica.server.config, Request(scope, receive)
        try:
            authorize(request, cfg.admin_token)
            reload_options(request)
            kind = recipe_kind(request.headers.get("content-type"))
            body = await read_body(request, RECIPE_MAX_BYTES, cfg.body_timeout_s)
            status, answer = await coordinator().reload.remote(body, kind)
            response: Response = JSONAnswer(answer, status_code=status,
                                            headers={"Location": "/v1/recipe"} if status == 202 else None)
        except ClientDisconnect:
            response = Response(status_code=400)
        except GraphmodeError as e:
            response = error_response(e)
        except Exception as e:  # noqa: BLE001 - the coordinator unreachable (a Ray error): retryable
            from graphmode.serve.errors import NotReady
            response = error_response(NotReady(f"the cluster's coordinator did not answer ({type(e).__name__})",
                                               where="PUT /v1/recipe", fix="retry in a few seconds"))
        await response(scope, receive, self._labelled(send))

    async def _metrics(self, send: Any) -> None:
        """GET /metrics: every replica's series, labelled `replica` (this one's read now)."""
        from graphmode.serve.cluster_control import merge_metrics
        try:
            texts = await coordinator().metrics.remote()
        except Exception as e:  # noqa: BLE001 - this replica's own series still answer
            log.warning("metrics of the other replicas unavailable: %s", e)
            texts = {}
        texts[self.replica.replica] = self.replica.metrics_text()
        body = await asyncio.to_thread(merge_metrics, texts)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self.replica.server.metrics.content_type.encode()), self.header]})
        await send({"type": "http.response.body", "body": body})

    async def _recipe(self, send: Any) -> None:
        """GET /v1/recipe: this replica's view, the cluster's rollout (`rollout`) and autoscaler
        (`autoscaler`: desired, running, why)."""
        view = self.replica.server.recipe_view()
        try:
            view["rollout"] = await coordinator().status.remote()
            view["autoscaler"] = await coordinator().autoscaler.remote()
        except Exception as e:  # noqa: BLE001
            view["rollout"] = {"state": "unknown", "error": f"the coordinator did not answer ({type(e).__name__})"}
        await self._answer(send, 200, view)

    async def _answer(self, send: Any, status: int, body: dict[str, Any]) -> None:
        from graphmode.serve.codec import dumps
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), self.header]})
        await send({"type": "http.response.body", "body": dumps(body)})


def deployment_options(recipe: Any, cluster: ClusterConfig, config: Any) -> dict[str, Any]:
    """Ray Serve options from the recipe and the flags: the replica count or the autoscaling
    bounds, the CPUs and the memory budget each replica reserves, the health-check period;
    and the rollout of a reload: one replica more than the count while it rolls (SURGE), so an
    old replica serves until its replacement is warm."""
    actor: dict[str, Any] = {"num_cpus": cluster.replica_cpus}
    budget = recipe.memory.budget_mb
    if isinstance(budget, (int, float)) and budget > 0:
        actor["memory"] = int(budget * MB)
    opts: dict[str, Any] = {"name": DEPLOYMENT, "ray_actor_options": actor,
                            "health_check_period_s": cluster.health_check_period_s,
                            "graceful_shutdown_timeout_s": config.shutdown_grace_s + 1.0,
                            "user_config": {"replica_ready_timeout_s": cluster.replica_ready_timeout_s},
                            "max_surge_percent": max(1, 100 * SURGE // cluster.bounds[1])}
    if cluster.autoscaling:
        lo, hi = cluster.bounds
        target = cluster.target_ongoing_requests or float(_largest_batch(recipe))
        opts["autoscaling_config"] = {"min_replicas": lo, "initial_replicas": cluster.replicas, "max_replicas": hi,
                                      "target_ongoing_requests": target, "policy": {"policy_function": POLICY},
                                      "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}   # the policy's windows
        opts["max_ongoing_requests"] = max(1, int(target * 4))
    else:
        opts["num_replicas"] = cluster.replicas
    return opts


def scale_rule(recipe: Any, cluster: ClusterConfig, config: Any) -> Any:
    """When the autoscaler adds or removes a replica (autoscale.ScaleRule), or None for a fixed
    count: the recipe's sla.p99_ms with the server's SLA margin and sample floor, the queue
    bound (default: one full batch waiting per replica) and the windows from the flags."""
    from graphmode.serve.autoscale import ScaleRule, sla_p99
    if not cluster.autoscaling:
        return None
    lo, hi = cluster.bounds
    queue = cluster.scale_queue_depth if cluster.scale_queue_depth is not None else float(_largest_batch(recipe))
    return ScaleRule(min_replicas=lo, max_replicas=hi, sla_p99_ms=sla_p99(recipe), queue_bound=queue,
                     margin=config.sla_margin, up_windows=cluster.scale_up_windows,
                     down_windows=cluster.scale_down_windows, min_samples=config.sla_min_samples,
                     window_s=cluster.scale_window_s)


def _largest_batch(recipe: Any) -> int:
    bd = recipe.model.batch_dim if recipe.model is not None else "batch"
    return recipe.dim_range(bd)[1] if bd in recipe.dims else 1


# ---- the cluster ------------------------------------------------------------------------------

class ClusterServer:
    """Ray (a local cluster started here, or `address`), Ray Serve's proxy on host:port, and the
    replicas of `served`; `stop` deletes the application, and stops Ray if it started it."""

    def __init__(self, served: Served, config: Any, cluster: ClusterConfig):
        self.served, self.config, self.cluster = served, replica_config(config, cluster), cluster
        self.started_ray = False
        self.cluster_gone = False          # the Ray cluster it started ended with its process group
        self._stopping = threading.Lock()
        self.coordinator: Any = None       # the Ray actor of cluster_control.Coordinator, while started
        self.url = f"http://{cluster.host}:{cluster.port}"

    def start(self) -> "ClusterServer":
        self.connect()
        return self.launch()

    def connect(self) -> None:
        """Ray started here or joined (in the main thread: ray.init installs signal handlers)."""
        import ray
        require_ray()
        if ray.is_initialized():
            return
        keep = _SigtermKept()
        try:
            if self.cluster.address is None:
                bound = (self.cluster.max_replicas or self.cluster.replicas) + SURGE
                self.started_ray = True      # from its first process on: stop() ends what it started
                ray.init(num_cpus=max(os.cpu_count() or 1, int(bound * self.cluster.replica_cpus + 0.999)),
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                self._join(ray)
        except SystemExit as e:
            if e.code != signal.SIGTERM:
                raise
            raise KeyboardInterrupt from None    # Ray's own SIGTERM handler ran before ours was back
        finally:
            keep.restore()

    def launch(self) -> "ClusterServer":
        """Serve's proxy, the coordinator and the replicas, until every replica is warm. Its Ray
        calls block in native code, where no signal reaches Python: a caller that must stop on
        SIGTERM meanwhile runs it in another thread (`graphmode serve` does)."""
        import ray
        from ray import serve

        from graphmode.serve.cluster_control import COORDINATOR, NAMESPACE, Coordinator
        serve.start(http_options={"host": self.cluster.host, "port": self.cluster.port})
        try:
            recipe = served_recipe(self.served)
            self.coordinator = ray.remote(Coordinator).options(
                name=COORDINATOR, namespace=NAMESPACE, num_cpus=0, max_concurrency=16,
                get_if_exists=False).remote(self.served, recipe, self.config, self.cluster,
                                                        scale_rule(recipe, self.cluster, self.config))
            ray.get(self.coordinator.ready.remote())
            deploy(self.served, recipe, self.config, self.cluster)
        except BaseException:
            self.stop()
            raise
        return self

    def _join(self, ray: Any) -> None:
        address = self.cluster.address
        check_address(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            raise _join_error(address, e) from None

    def status(self) -> Any:
        return app_status()

    def replica_states(self) -> dict[str, int]:
        return replica_states()

    def replica_actors(self) -> list[str]:
        """The Ray actor names of the running replicas (namespace `serve`)."""
        import ray
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::")
                      and f"#{DEPLOYMENT}#" in a["name"])

    def stop(self) -> None:
        with self._stopping:         # once at a time: a launch that fails as the caller stops stops too
            self._stop()

    def _stop(self) -> None:
        import ray
        if self.cluster_gone or self.started_ray and ray.is_initialized() and _local_cluster_gone():
            self._gone("the local Ray cluster stopped with this process: nothing to undeploy")
            return
        if not ray.is_initialized():
            return
        finished, failed = in_thread(self._undeploy, "graphmode-undeploy")
        wait_s = self.config.shutdown_grace_s + UNDEPLOY_S
        if not finished.wait(wait_s):
            self._gone(f"Ray did not answer the stop within {wait_s:g} s (its cluster may have stopped with this "
                       "process group): not waiting for it")
            return
        try:
            if failed:
                raise failed[0]
        finally:
            if self.started_ray:
                ray.shutdown()
                self.started_ray = False

    def _undeploy(self) -> None:
        import ray
        from ray import serve
        serve.delete(APP_NAME)
        if self.coordinator is not None:
            ray.kill(self.coordinator)
            self.coordinator = None
        if self.started_ray:
            serve.shutdown()

    def _gone(self, why: str) -> None:
        """A signal to the whole process group (Ctrl-C, `kill -- -PGID`, a container's stop) ended the
        Ray cluster this process started along with it: nothing is left to undeploy, and Serve's calls
        would wait on the dead GCS for a minute, then end the process with exit 1."""
        if not self.cluster_gone:
            log.info(why)
        self.coordinator, self.started_ray, self.cluster_gone = None, False, True

    def __enter__(self) -> "ClusterServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def in_thread(work: Any, name: str) -> tuple[threading.Event, list[BaseException]]:
    """`work()` started in a daemon thread: the event set when it ends, and what it raised (for the
    caller to raise in its own thread). Ray's calls block in native code, where no signal reaches
    Python and no timeout applies: a caller waits on the event in bounded steps instead."""
    finished, failed = threading.Event(), []

    def run() -> None:
        try:
            work()
        except BaseException as e:
            failed.append(e)
        finally:
            finished.set()
    threading.Thread(target=run, name=name, daemon=True).start()
    return finished, failed


UNDEPLOY_S = 20.0        # past the replicas' shutdown grace: Ray's stop calls get this long to answer


def _local_cluster_gone(within_s: float = 1.5) -> bool:
    """Whether a process of the Ray cluster this process started exits within `within_s` (a
    signal to the process group reached them as it reached this process, which may notice it
    first; the GCS then stops answering before it exits). Ray's own record of the processes it
    started; False where it keeps none."""
    try:
        from ray._private import worker
        node = worker._global_node
        if node is None:
            return False
        end = time.monotonic() + within_s
        while not node.dead_processes():
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True
    except Exception:       # another Ray version's internals: undeploy as usual
        return False


class _SigtermKept:
    """The process's SIGTERM handler across `ray.init`, which installs its own (ending the process
    with exit 15, or 134 and a C++ stack): a SIGTERM while the replicas start (Kubernetes, `kill`,
    a supervisor) stops the server as Ctrl-C does."""

    def __init__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.handler = signal.getsignal(signal.SIGTERM) if main else None

    def restore(self) -> None:
        if self.handler is not None:
            signal.signal(signal.SIGTERM, self.handler)


def served_recipe(served: Served) -> Any:
    """The recipe `served` serves: its own, or its artifact's."""
    from graphmode.recipe import load_recipe
    from graphmode.runtime.artifact import recipe_of
    return load_recipe(served.recipe) if served.recipe is not None else recipe_of(served.model)


def deploy(served: Served, recipe: Any, config: Any, cluster: ClusterConfig) -> None:
    """Run (or roll to) the application serving `served`; returns once every replica is warm,
    raises the replicas' error when they cannot start. Each call is a new deployment version
    (Ray Serve draws one when none is given), so a second call rolls the replicas."""
    from ray import serve

    from graphmode.serve.cluster_front import FRONT, GraphmodeFront
    from graphmode.serve.app import RECIPE_MAX_BYTES
    cls = serve.deployment(GraphmodeReplica)
    replicas = cls.options(**deployment_options(recipe, cluster, config)).bind(served.model, served.recipe, config)
    front = serve.deployment(serve.ingress()(GraphmodeFront)).options(
        name=FRONT, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FRONT_MAX_REQUESTS,
        max_surge_percent=100, graceful_shutdown_timeout_s=config.shutdown_grace_s + 2.0,
        health_check_period_s=cluster.health_check_period_s)
    app = front.bind(replicas, max(int(config.max_body_mb * MB), RECIPE_MAX_BYTES) + 1)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError:
        pass                       # a failed deployment: wait_running says why, from its replicas
    wait_running(cluster.replica_ready_timeout_s)


def app_status() -> Any:
    from ray import serve
    return serve.status().applications.get(APP_NAME)


def replica_states() -> dict[str, int]:
    app = app_status()
    dep = app.deployments.get(DEPLOYMENT) if app is not None else None
    return dict(dep.replica_states) if dep is not None else {}


def wait_running(timeout: float) -> None:
    """Until the application runs (every replica warm), or its deployment failed (raised
    with Ray's message, which carries the replica's error)."""
    deadline = time.monotonic() + timeout
    while True:
        app = app_status()
        state = str(getattr(app, "status", "")).rsplit(".", 1)[-1]
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            dep = app.deployments.get(DEPLOYMENT)
            error, fix = _replica_error(dep.message if dep else app.message)
            raise GraphmodeError(f"the replicas did not start: {error}", where="--replicas",
                                 fix=fix or "`serve status` and the Ray logs (session_latest/logs in Ray's "
                                            "temp folder) say more")
        if time.monotonic() > deadline:
            raise GraphmodeError(f"the replicas were not running within {timeout:g} s "
                                 f"({replica_states()})", where="--replica-ready-timeout-s")
        time.sleep(0.2)


def check_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Refuse a HOST:PORT where nothing listens, at once (Ray itself retries an unreachable
    address for minutes); `auto` and None are Ray's to resolve."""
    if address is None:
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise _join_error(address, e) from None


def _join_error(address: str, e: BaseException) -> GraphmodeError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return GraphmodeError(f"cannot join the Ray cluster at {address}: {first}", where="--address", value=address,
                          fix="start it with `ray start --head` (which prints its address) and pass that; with "
                              "Ray's token authentication on, set RAY_AUTH_MODE=token and give this machine the "
                              "cluster's token (~/.ray/auth_token or RAY_AUTH_TOKEN)")


def _replica_error(message: str) -> tuple[str, str | None]:
    """The replica's own error out of Ray's report (a traceback): its last `...Error: ` line,
    and the `fix:` line a graphmode error carries below it."""
    lines = (message or "").splitlines()
    last = max((i for i, line in enumerate(lines) if "Error: " in line), default=None)
    if last is None:
        return message or "no message from Ray", None
    fix = next((line.strip()[len("fix:"):].strip() for line in lines[last + 1:last + 3]
                if line.strip().startswith("fix:")), None)
    return lines[last].split("Error: ", 1)[1].strip(), fix


def _absolute(path: Any) -> Any:
    return str(Path(path).resolve()) if path is not None else None
