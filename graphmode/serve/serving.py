"""Serving requests on the active deployment: the batcher's worker runs built buckets only;
a request for a bucket not built yet waits for its build off the serving path."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Future
from typing import Any, Mapping

import torch

from graphmode.errors import ContractViolation, GraphmodeError, RankFailure
from graphmode.monitor import bucket_label
from graphmode.runtime.shaping import merged_requests
from graphmode.serve.batching import Pending, merge, split
from graphmode.serve.deployment import Deployment
from graphmode.serve.errors import NotReady, RequestTimeout

log = logging.getLogger("graphmode.serve")
WHOLE_SEQUENCE = "whole-sequence graph"      # the build key of a decoder's lowering for /v1/infer


class Serving:
    """ModelServer's request path (a mixin: it reads the server's config, loop, batcher,
    builder thread and build table)."""

    async def infer(self, dep: Deployment, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        assert self.loop is not None and self.batcher is not None, "start() the server first"
        deadline = time.monotonic() + self.config.request_timeout_s
        await self.whole_sequence(dep, deadline)
        p = dep.prepare(inputs)
        bucket = dep.cm.bucket_for(p.dims) if dep.cm.mode != "eager" else None
        if bucket is not None and not dep.cm.is_built(bucket):
            await self._built(dep, bucket, deadline)
        p.future = self.loop.create_future()
        self.batcher.submit(p)
        try:
            return await self._until(p.future, deadline)
        except asyncio.TimeoutError:
            dep.monitor.request_status("timeout")
            raise RequestTimeout(f"no answer within {self.config.request_timeout_s:g} s", where="request",
                                 fix="raise --request-timeout-s or lower the load") from None

    async def _until(self, waited: Any, deadline: float) -> Any:
        """`waited`'s result; asyncio.TimeoutError past `deadline`; NotReady (503) once the shutdown
        grace is over (ModelServer.end_requests), the request's wait given up."""
        task = asyncio.ensure_future(waited)
        ending = getattr(self, "_ending", None)
        stop = asyncio.ensure_future(ending.wait()) if ending is not None else None
        try:
            await asyncio.wait({task} | ({stop} if stop else set()), timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:      # the client went away: its queued request is not run (as wait_for did)
            task.cancel()
            raise
        finally:
            if stop is not None and not stop.done():
                stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        if stop is not None and stop.done():
            raise NotReady("the server is shutting down: this request did not finish within its shutdown grace",
                           where="request", fix="retry it (on another replica, or once the server is back); "
                           "--shutdown-grace-s gives open requests longer")
        raise asyncio.TimeoutError

    async def _built(self, dep: Deployment, bucket: Mapping[str, int], deadline: float) -> None:
        """Wait (without holding the serving thread) until `bucket` is built; 503 past the deadline."""
        fut = self.build_in_background(dep, bucket)
        try:
            await self._until(asyncio.shield(asyncio.wrap_future(fut)), deadline)
        except asyncio.TimeoutError:
            raise NotReady(f"the plan for bucket {bucket_label(bucket)} is still being built", where="bucket",
                           value=dict(bucket), fix="retry in a moment: the build goes on") from None

    async def whole_sequence(self, dep: Deployment, deadline: float | None = None) -> None:
        """Until `dep`'s whole-sequence graph is lowered: a decoder's is, on the build thread, for
        the first request that needs it (/v1/infer, KServe); 503 past the deadline (the lowering
        goes on). A recipe that graph refuses is answered with the lowering's typed error (422)."""
        from graphmode.decode.tensor_parallel import TensorParallelDecoder
        if isinstance(dep.cm, TensorParallelDecoder):
            raise GraphmodeError("a tensor-parallel decoder's ranks hold only the paged decode graph: /v1/infer and "
                                 "KServe are not served on them", where="parallel.tensor",
                                 fix="POST /v1/completions, or serve with parallel.tensor: 1 for /v1/infer")
        if (getattr(dep.cm, "artifact", None) or {}).get("decoder") is not None:
            raise GraphmodeError("a decoder's .gm holds only the paged decode graph: /v1/infer and KServe are not "
                                 "served from it", where="model", value=dep.cm.artifact["path"],
                                 fix="POST /v1/completions, or serve the model itself for /v1/infer")
        if not getattr(dep.cm, "pending", False):
            return
        fut = self._once((dep.version, WHOLE_SEQUENCE), self._lower_whole_sequence, dep)
        if deadline is None:
            deadline = time.monotonic() + self.config.request_timeout_s
        try:
            await self._until(asyncio.shield(asyncio.wrap_future(fut)), deadline)
        except asyncio.TimeoutError:
            raise NotReady("the decoder's whole-sequence graph (/v1/infer, KServe) is still being lowered",
                           where="model", fix="retry in a moment: the lowering goes on") from None

    def _lower_whole_sequence(self, dep: Deployment) -> None:
        log.info("lowering the whole-sequence graph of %s for its first /v1/infer or KServe request", dep.version)
        with self._prove_lock:           # its proof shares Z3's (thread-unsafe) context with a reload's
            dep.cm.lower_now()

    def build_in_background(self, dep: Deployment, bucket: Mapping[str, int]) -> Future:
        """Build `bucket` of `dep` on the build thread (once, however many ask): the future of it."""
        key = (dep.version, dep.cm.bucket_key(bucket))
        return self._once(key, dep.cm.executable, dict(bucket))

    def _once(self, key: tuple[str, str], fn: Any, *args: Any) -> Future:
        """`fn(*args)` on the build thread, once while it runs however many ask: its future."""
        with self._builds_lock:
            fut = self._builds.get(key)
            if fut is None:
                log.info("building %s of %s off the serving path", key[1], key[0])
                fut = self.builder.submit(fn, *args)
                self._builds[key] = fut
                fut.add_done_callback(functools.partial(self._build_done, key))
        return fut

    def _build_done(self, key: tuple[str, str], fut: Future) -> None:
        with self._builds_lock:
            self._builds.pop(key, None)
        err = fut.exception() if not fut.cancelled() else None
        if err is not None:      # a recipe the whole-sequence graph refuses: said once, answered per request
            refused = key[1] == WHOLE_SEQUENCE and isinstance(err, GraphmodeError)
            (log.info if refused else log.error)("building %s of %s failed: %s", key[1], key[0], err)

    def _max_rows(self, dep: Deployment) -> int:
        return dep.max_rows

    def _run_batch(self, batch: list[Pending]) -> list[Any]:
        """Worker thread: one model call for the batch; a failing batch is retried request
        by request so one bad request cannot fail its neighbours."""
        try:
            return self._execute(batch)
        except RankFailure as e:                 # an encoder's ranks are down: no request of it can run
            from graphmode.serve.generation import ranks_down
            log.error("the tensor-parallel ranks are down: %s", e.message)
            batch[0].deployment.monitor.request_status("error")
            return [ranks_down(e) for _ in batch]
        except Exception as e:  # noqa: BLE001
            if len(batch) > 1:
                log.warning("batch of %d failed (%s: %s); running its requests one by one", len(batch),
                            type(e).__name__, e)
                return [r for p in batch for r in self._run_batch([p])]
            dep = batch[0].deployment
            if isinstance(e, ContractViolation):
                dep.monitor.request_status("contract")
            else:
                log.exception("request failed")
                dep.monitor.request_status("error")
            return [e]

    def _execute(self, batch: list[Pending]) -> list[dict[str, Any]]:
        dep = batch[0].deployment
        cm = dep.cm
        if len(batch) > 1:
            inputs, dims = merge(batch, dep.recipe.inputs, dep.batch_dim)
        else:
            inputs, dims = batch[0].inputs, batch[0].dims
        bucket = cm.bucket_for(dims) if cm.mode != "eager" else None
        if bucket is None and len(batch) > 1 and cm.mode != "eager":
            raise ContractViolation(f"no bucket holds the merged batch {dims}")   # retried one by one
        if bucket is not None and len(batch) > 1 and not cm.is_built(bucket):
            self.build_in_background(dep, bucket)      # merged shapes use it once it is built
            return [r for p in batch for r in self._run_batch([p])]
        t0 = time.perf_counter()
        with dep.monitor.collect() as kinds:
            try:
                with torch.inference_mode(), merged_requests(len(batch) > 1):
                    out = cm(**inputs)
            except ContractViolation:
                dep.monitor.record_operation(kinds or {"shape"})
                raise
        dt = time.perf_counter() - t0
        label = "eager" if bucket is None or "fallback" in kinds else bucket_label(bucket)
        flat = dep.flatten(out)
        parts = split(flat, dep.output_axes, batch, dep.batch_dim) if len(batch) > 1 else [flat]
        dep.monitor.model_call(dt, label, len(batch))
        done = time.perf_counter()
        results = []
        rows = dims.get(dep.batch_dim, 1) if dep.batch_dim else 1
        for p, outs in zip(batch, parts):
            latency = done - p.arrived
            dep.monitor.observe_request(latency, label, p.dims, kinds)
            results.append({"outputs": dict(zip(dep.names_for(len(outs)), outs)),
                            "bucket": bucket, "recipe_version": dep.version, "recipe_name": dep.name,
                            "batch": {"requests": len(batch), "rows": rows}, "request_dims": p.dims,
                            "latency_ms": round(latency * 1e3, 3), "model_ms": round(dt * 1e3, 3)})
        return results
