"""`graphmode serve`: the HTTP inference server (Starlette on uvicorn) over one model.

The socket is bound and /healthz answers at once; the recipe is compiled, proved and
every bucket warmed up in the background, and /readyz answers 200 (and "ready" is
printed) only then. A recipe that cannot be loaded stops the server with its error.

The admin token (`--admin-token`, or GRAPHMODE_ADMIN_TOKEN: this module is the only place
that reads it) guards the state-changing endpoints; without one the server listens only
on a loopback address unless `--insecure-no-auth` says the network is trusted.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, THREADS_HELP, CacheDir, KbPath, kb_file
from graphmode.cli.progress import progress


@app.command("serve")
def serve_cmd(
    model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP
                                                   + " | FILE.gm (an artifact: graphmode compile --save)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="the recipe (YAML) to serve (an artifact's own when "
                                                                "--model is a .gm file)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0 picks a free port"),
    batch_window_ms: float = typer.Option(5.0, "--batch-window-ms",
                                          help="how long a request waits for others to batch with (0: no wait)"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch",
                                            help="rows per model call (default: the largest admissible batch)"),
    max_body_mb: float = typer.Option(16.0, "--max-body-mb", help="larger request bodies get 413"),
    variant: List[str] = typer.Option([], "--variant", help="a validated fallback recipe for SLA renegotiation "
                                                            "(repeatable; used in order)"),
    target: Optional[str] = typer.Option(None, "--target", help="target name or file (default: the recipe's)"),
    cache_dir: Optional[Path] = CacheDir,
    kb: Optional[Path] = KbPath,
    kb_period_s: float = typer.Option(60.0, "--kb-period-s", help="seconds between knowledge-base summaries of "
                                      "the serving recipe version (p50/p99, throughput, P99/P50)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=1024, help=THREADS_HELP),
    request_timeout_s: float = typer.Option(60.0, "--request-timeout-s"),
    sla_window_s: float = typer.Option(10.0, "--sla-window-s", help="drift probe: sliding window length"),
    sla_step_s: Optional[float] = typer.Option(None, "--sla-step-s", help="drift probe: evaluation period "
                                                                          "(default: the window)"),
    sla_margin: float = typer.Option(0.2, "--sla-margin", help="drift when p99 > SLA * (1 + margin)"),
    sla_windows: int = typer.Option(3, "--sla-windows", help="consecutive drifting windows that raise a drift event"),
    sla_min_samples: int = typer.Option(10, "--sla-min-samples", help="requests a window needs to be judged"),
    renegotiate_interval_s: float = typer.Option(300.0, "--renegotiate-interval-s",
                                                 help="one renegotiation token per this many seconds"),
    renegotiate_burst: int = typer.Option(1, "--renegotiate-burst", help="token bucket capacity"),
    admin_token: Optional[str] = typer.Option(None, "--admin-token", envvar="GRAPHMODE_ADMIN_TOKEN",
                                              show_envvar=True, show_default=False,
                                              help="Bearer token that PUT /v1/recipe needs (prefer the environment "
                                                   "variable: a flag shows in the process list)"),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth",
                                          help="listen on a non-loopback address without an admin token"),
    header_timeout_s: float = typer.Option(10.0, "--header-timeout-s",
                                           help="a request's headers must arrive within this (else 408)"),
    body_timeout_s: float = typer.Option(60.0, "--body-timeout-s",
                                         help="a request's body must arrive within this (else 408)"),
    recipe_check_s: float = typer.Option(10.0, "--recipe-check-s",
                                         help="CPU seconds the sandbox may spend checking one PUT recipe"),
    max_plans: int = typer.Option(1024, "--max-plans", help="most buckets (plans) a recipe may ask for"),
    shutdown_grace_s: float = typer.Option(5.0, "--shutdown-grace-s", help="on Ctrl-C / SIGTERM, open requests "
                                           "and generations get this long to finish (then streams end with an "
                                           "error event)"),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error"),
    replicas: Optional[int] = typer.Option(None, "--replicas", min=1, help="serve N replicas on Ray Serve (the "
                                           "serve-cluster extra): compiled once here, loaded by every replica"),
    min_replicas: Optional[int] = typer.Option(None, "--min-replicas", min=0, help="autoscaling on the "
                                               "recipe's SLA: fewest replicas (sets autoscaling on)"),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas", min=1, help="autoscaling on the "
                                               "recipe's SLA: most replicas (sets autoscaling on)"),
    target_ongoing_requests: Optional[float] = typer.Option(
        None, "--target-ongoing-requests", help="autoscaling: requests in flight per replica Ray Serve routes "
        "(a replica takes 4x this at most; default: the recipe's largest batch)"),
    scale_queue_depth: Optional[float] = typer.Option(
        None, "--scale-queue-depth", help="autoscaling: waiting requests per replica that add one (default: the "
        "recipe's largest batch)"),
    scale_window_s: float = typer.Option(2.0, "--scale-window-s", help="autoscaling: one window of p99 and queue "
                                         "depth"),
    scale_up_windows: int = typer.Option(3, "--scale-up-windows", help="autoscaling: windows in a row over the "
                                         "SLA (or the queue bound) that add a replica"),
    scale_down_windows: int = typer.Option(15, "--scale-down-windows", help="autoscaling: windows in a row well "
                                           "under both that remove one"),
    address: Optional[str] = typer.Option(None, "--address", help="join this Ray cluster (auto | HOST:6379 | "
                                          "ray://HOST:10001); default: start a local one for the server's lifetime"),
    replica_cpus: float = typer.Option(1.0, "--replica-cpus", help="CPUs Ray reserves per replica"),
    replica_ready_timeout_s: float = typer.Option(600.0, "--replica-ready-timeout-s",
                                                  help="a replica not warm by then fails its start"),
) -> None:
    """Serve a model over HTTP: /v1/infer, /v1/completions (decoders), KServe v2 /v2/..., /v1/recipe (hot
    reload), /healthz, /readyz, /metrics."""
    import logging

    import torch

    from graphmode.errors import GraphmodeError
    from graphmode.serve.app import check_exposure
    from graphmode.serve.server import ModelServer, ServeConfig, artifact_path

    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise GraphmodeError(f"unknown log level {log_level!r}", where="--log-level",
                             fix="debug, info, warning or error")
    if admin_token is None and "GRAPHMODE_ADMIN_TOKEN" in os.environ:
        admin_token = os.environ["GRAPHMODE_ADMIN_TOKEN"]   # set but empty: refused below, never "no token"
    cluster = None
    if any(v is not None for v in (replicas, min_replicas, max_replicas, address, target_ongoing_requests)):
        from graphmode.serve.cluster import ClusterConfig, check_address, require_ray
        require_ray()                      # before anything compiles: the extra is named at once
        check_address(address)             # ... and an address where no cluster answers
        if variant:
            raise GraphmodeError("--variant is not supported with replicas yet: SLA renegotiation is one server's "
                                 "answer to its own drift, and each replica would switch to a variant on its own, "
                                 "leaving the replicas on different recipes behind one endpoint", where="--variant",
                                 fix="with replicas, scale on the SLA instead (--min-replicas/--max-replicas), or "
                                     "roll a variant to every replica yourself (PUT /v1/recipe with the admin token); "
                                     "or serve the variants on one server without --replicas")
        cluster = ClusterConfig(replicas=replicas or min_replicas or 1, min_replicas=min_replicas,
                                max_replicas=max_replicas, target_ongoing_requests=target_ongoing_requests,
                                scale_queue_depth=scale_queue_depth, scale_window_s=scale_window_s,
                                scale_up_windows=scale_up_windows, scale_down_windows=scale_down_windows,
                                address=address, host=host, port=port, replica_cpus=replica_cpus,
                                replica_ready_timeout_s=replica_ready_timeout_s)
    if recipe is None and artifact_path(model) is None:
        raise GraphmodeError("--recipe is needed", where="--recipe",
                             fix="pass the recipe to serve (only a .gm artifact carries its own)")
    config = ServeConfig(target=target, cache_dir=cache_dir, kb=kb_file(kb, cache_dir), kb_period_s=kb_period_s,
                         threads=threads, batch_window_ms=batch_window_ms,
                         max_batch=max_batch, max_body_mb=max_body_mb, request_timeout_s=request_timeout_s,
                         sla_window_s=sla_window_s, sla_step_s=sla_step_s, sla_margin=sla_margin,
                         sla_windows=sla_windows, sla_min_samples=sla_min_samples,
                         renegotiate_interval_s=renegotiate_interval_s, renegotiate_burst=renegotiate_burst,
                         admin_token=admin_token, insecure_no_auth=insecure_no_auth,
                         header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                         recipe_check_cpu_s=recipe_check_s, max_plans=max_plans, shutdown_grace_s=shutdown_grace_s)
    check_exposure(host, config)           # before the model is built: a refused address fails fast
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    if cluster is not None:
        _serve_cluster(model, recipe, config, cluster)
        return
    run_http(lambda on_state, on_stage: ModelServer(model, recipe, variants=list(variant), config=config,
                                                    on_state=on_state, on_stage=on_stage), host, port, level)


def warm_count(recipe: Any) -> int:
    """The plans a server builds before ready: one per bucket, or a decoder's prefill/decode plans."""
    from graphmode.recipe.buckets import plans_count
    if recipe.memory.kv_cache is None:
        return plans_count(recipe)
    from graphmode.decode.runner import plan_count
    return plan_count(recipe)


def run_http(make_server: Any, host: str, port: int, level: str) -> None:
    """Build the server (make_server(on_state, on_stage): a ModelServer that warms up in the
    background) and serve it on host:port until Ctrl-C or SIGTERM; its load failure is raised."""
    import logging

    from graphmode.errors import GraphmodeError
    from graphmode.serve.app import bind, create_app, uvicorn_server

    failure: list[GraphmodeError] = []
    holder: dict = {}

    def on_state(state: str, error: GraphmodeError | None) -> None:
        if state == "ready":
            dep = server.active
            warm = f"{len(dep.buckets)} bucket(s) warm" if dep.decoder is None else \
                "decoder warm (POST /v1/completions, /v1/chat/completions)"
            console.print(f"[bold green]ready[/] recipe {dep.name} #{dep.version}, {warm} on {holder['url']}",
                          highlight=False)
        elif state == "failed":
            failure.append(error or GraphmodeError("the recipe could not be loaded"))
            if "uvicorn" in holder:
                holder["uvicorn"].should_exit = True

    with progress(live=False) as on_stage:
        sock = bind(host, port)          # before the model loads: a taken port is said at once, not minutes later
        try:
            # the background warm-up's progress: plain lines (the server's log shares stderr), bucket N of M
            server = make_server(on_state, on_stage)
        except BaseException:
            sock.close()
            raise
        config = server.config
        bound_port = sock.getsockname()[1]
        holder["url"] = f"http://{host}:{bound_port}"
        holder["uvicorn"] = uv = uvicorn_server(create_app(server), log_level="warning" if level != "DEBUG" else "info")
        put = "needs the admin token" if config.admin_token else "is open: no admin token"
        if server.group is not None:
            put = "is refused: the ranks serve the recipe they compiled"
        console.print(f"graphmode serve: {server.recipe.name} on {holder['url']} (live now; warming up "
                      f"{warm_count(server.recipe)} plan(s) before ready; PUT /v1/recipe {put})", highlight=False)
        # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises the signal into the
        # handler it found: make SIGTERM end like Ctrl-C (exit 0), not kill the process
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            uv.run(sockets=[sock])
        except KeyboardInterrupt:      # uvicorn shut down gracefully, then re-raised the signal
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            sock.close()
        if not server.join_background(timeout=2.0):
            # a compile is still in native code: tearing the interpreter down around its thread can
            # abort the process (std::terminate), so it is abandoned and the process ends here
            err_console.print("graphmode serve: stopped (a background compile was abandoned)")
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(failure[0].exit_code if failure else 0)
        if failure:
            raise failure[0]
        err_console.print("graphmode serve: stopped")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _answering_signals(work: Any) -> None:
    """`work()` in a daemon thread, this (main) thread waiting in short steps: a call blocked in
    native code runs no Python signal handler, so Ctrl-C / SIGTERM meanwhile would wait for it (a
    Ray cluster ended by a signal to the whole process group held Ray's calls for a minute, then
    Ray ended the process with exit 1)."""
    from graphmode.serve.cluster import in_thread
    done, failed = in_thread(work, "graphmode-cluster-start")
    while not done.wait(0.25):
        pass
    if failed:
        raise failed[0]


def _serve_cluster(model: str, recipe: Optional[str], config: Any, cluster: Any) -> None:
    """`--replicas`: compile once here, then Ray Serve's replicas behind its proxy until Ctrl-C /
    SIGTERM; the Ray cluster this started (no --address) stops with it."""
    from graphmode.serve.cluster import ClusterServer, prepare, replica_config

    config = replica_config(config, cluster)
    with progress(live=False) as on_stage:
        served = prepare(model, recipe, config, on_stage=on_stage)
    what = "compiled once" if served.compiled_by_driver else "checked"
    server = ClusterServer(served, config, cluster)
    previous = signal.signal(signal.SIGTERM, _interrupt)     # from here on SIGTERM stops what started
    try:
        console.print(f"graphmode serve: {served.model} {what} in {served.seconds:.1f} s; starting "
                      f"{cluster.replicas} replica(s) on Ray Serve "
                      f"({'cluster ' + cluster.address if cluster.address else 'a local Ray cluster'})",
                      highlight=False)
        server.connect()
        _answering_signals(server.launch)
        lo, hi = cluster.bounds
        scale = f"autoscaling {lo}..{hi}" if cluster.autoscaling else f"{cluster.replicas} replica(s)"
        console.print(f"[bold green]ready[/] {scale} on {server.url} (GET /v1/replica says which answered)",
                      highlight=False)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    err_console.print("graphmode serve: stopped")


@app.command("loadtest")
def loadtest_cmd(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="a `graphmode serve` decoder on a loopback address"),
    num_prompts: int = typer.Option(100, "--num-prompts", help="requests to send (the run ends when all answered)"),
    input_len: int = typer.Option(32, "--input-len", help="mean prompt length (random token ids)"),
    output_len: int = typer.Option(32, "--output-len", help="mean tokens to generate (exact: ignore_eos)"),
    range_ratio: float = typer.Option(0.0, "--range-ratio", help="lengths uniform in len*(1-r) .. len*(1+r)"),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Poisson arrivals per second "
                                                                            "(inf: all at once)"),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="most requests in flight"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy"),
    seed: int = typer.Option(0, "--seed", help="lengths, token ids, arrivals and sampling"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="per request"),
    out: Optional[Path] = typer.Option(None, "--json", help="also write the report as JSON to this file"),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions (a decoder: streamed) or "
                                 "embeddings (an encoder: requests/s and latency; --output-len unused)"),
) -> None:
    """Load-test a serving decoder like `vllm bench serve`: TTFT, TPOT, ITL p50/p99, tokens/s (or an
    encoder's /v1/embeddings: requests/s, latency p50/p99)."""
    from graphmode.bench.serve_load import LoadConfig, run_load
    from graphmode.serve.codec import dumps

    with progress(measuring=True) as on_stage:
        report = run_load(LoadConfig(url=url, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                                     range_ratio=range_ratio, request_rate=request_rate,
                                     max_concurrency=max_concurrency, temperature=temperature, seed=seed,
                                     timeout_s=timeout_s, endpoint=endpoint), on_stage=on_stage)
    console.print(report.text(), highlight=False, markup=False)
    if out is not None:
        out.write_bytes(dumps(report.to_dict()))
    if report.failed:
        raise SystemExit(1)
