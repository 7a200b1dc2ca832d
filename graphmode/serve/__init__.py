"""HTTP inference server: dynamic batching, contract metrics, hot reload of validated recipes.

    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    server = ModelServer(bundle_or_spec, "recipe.yaml", config=ServeConfig(batch_window_ms=5))
    with ServerThread(server) as running:          # uvicorn on a free loopback port
        running.wait_ready()
        httpx.post(running.url + "/v1/infer", json={"inputs": {...}})

`graphmode serve --model SPEC --recipe PATH` is the command-line form; the endpoints and
formats are in graphmode/serve/README.md. Exports load lazily: the recipe sandbox's worker
(`python -m graphmode.serve.sandbox`) imports this package and must not pay for torch.
"""
_API = {"ServerThread": "graphmode.serve.app", "create_app": "graphmode.serve.app",
        "ModelServer": "graphmode.serve.server", "ServeConfig": "graphmode.serve.server",
        "Deployment": "graphmode.serve.deployment", "ReloadTicket": "graphmode.serve.deployment",
        "ServeError": "graphmode.serve.errors", "BadRequest": "graphmode.serve.errors",
        "Unauthorized": "graphmode.serve.errors", "NotReady": "graphmode.serve.errors",
        "ReloadBusy": "graphmode.serve.errors", "RequestTimeout": "graphmode.serve.errors"}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'graphmode.serve' has no attribute {name!r}")
