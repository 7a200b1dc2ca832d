"""HTTP inference server: dynamic batching, contract metrics, hot reload of validated recipes.

    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    server = ModelServer(bundle_or_spec, "recipe.yaml", config=ServeConfig(batch_window_ms=5))
    with ServerThread(server) as running:          # uvicorn on a free loopback port
        running.wait_ready()
        httpx.post(running.url + "/v1/infer", json={"inputs": {...}})

`graphmode serve --model SPEC --recipe PATH` is the command-line form; the endpoints and
formats are in graphmode/serve/README.md.
"""
from graphmode.serve.app import ServerThread, create_app
from graphmode.serve.errors import BadRequest, NotReady, ReloadBusy, RequestTimeout, ServeError
from graphmode.serve.server import Deployment, ModelServer, ReloadTicket, ServeConfig

__all__ = ["ModelServer", "ServeConfig", "ServerThread", "create_app", "Deployment", "ReloadTicket", "ServeError",
           "BadRequest", "NotReady", "ReloadBusy", "RequestTimeout"]
