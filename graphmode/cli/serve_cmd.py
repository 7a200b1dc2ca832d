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
from typing import Any, List, Optional

import typer

from graphmode.cli.app import app, console, err_console


@app.command("serve")
def serve_cmd(
    model: str = typer.Option(..., "--model", help="minilm | gpt2 | resnet18 | path.onnx | package.module:function"),
    recipe: str = typer.Option(..., "--recipe", help="the recipe (YAML) to serve"),
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
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="artifact cache (default: the user cache)"),
    threads: Optional[int] = typer.Option(None, "--threads"),
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
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error"),
) -> None:
    """Serve a model over HTTP: /v1/infer, /v1/recipe (hot reload), /healthz, /readyz, /metrics."""
    import logging

    import torch

    from graphmode.errors import GraphmodeError
    from graphmode.serve.app import bind, check_exposure, create_app, uvicorn_server
    from graphmode.serve.server import ModelServer, ServeConfig

    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise GraphmodeError(f"unknown log level {log_level!r}", where="--log-level",
                             fix="debug, info, warning or error")
    config = ServeConfig(target=target, cache_dir=cache_dir, threads=threads, batch_window_ms=batch_window_ms,
                         max_batch=max_batch, max_body_mb=max_body_mb, request_timeout_s=request_timeout_s,
                         sla_window_s=sla_window_s, sla_step_s=sla_step_s, sla_margin=sla_margin,
                         sla_windows=sla_windows, sla_min_samples=sla_min_samples,
                         renegotiate_interval_s=renegotiate_interval_s, renegotiate_burst=renegotiate_burst,
                         admin_token=admin_token or None, insecure_no_auth=insecure_no_auth,
                         header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                         recipe_check_cpu_s=recipe_check_s, max_plans=max_plans)
    check_exposure(host, config)           # before the model is built: a refused address fails fast
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    failure: list[GraphmodeError] = []
    holder: dict = {}

    def on_state(state: str, error: GraphmodeError | None) -> None:
        if state == "ready":
            dep = server.active
            console.print(f"[bold green]ready[/] recipe {dep.name} #{dep.version}, {len(dep.buckets)} bucket(s) warm "
                          f"on {holder['url']}", highlight=False)
        elif state == "failed":
            failure.append(error or GraphmodeError("the recipe could not be loaded"))
            if "uvicorn" in holder:
                holder["uvicorn"].should_exit = True

    server = ModelServer(model, recipe, variants=list(variant), config=config, on_state=on_state)
    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    holder["url"] = f"http://{host}:{bound_port}"
    holder["uvicorn"] = uv = uvicorn_server(create_app(server), log_level="warning" if level != "DEBUG" else "info")
    console.print(f"graphmode serve: {server.recipe.name} on {holder['url']} (live now; warming up "
                  f"{server.recipe.plans_count()} bucket(s) before ready; PUT /v1/recipe "
                  f"{'needs the admin token' if config.admin_token else 'is open: no admin token'})", highlight=False)
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
