"""`graphmode rank`: one rank of a tensor-parallel group that `torchrun` starts (several
machines: one command per node). torchrun's environment names the rank and the rendezvous
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE); graphmode/parallel/torchrun.py
does the rest. Rank 0 reads the requests (JSONL, one server JSON body a line) and writes one
answer a line; the other ranks follow it."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import typer

from graphmode.cli.app import app, err_console
from graphmode.cli.options import CacheDir
from graphmode.errors import GraphmodeError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """rank, world, master_addr, master_port, local_world from torchrun's environment."""
    missing = [k for k in TORCHRUN_ENV if not environ.get(k)]
    if missing:
        raise GraphmodeError(f"{', '.join(missing)} not set: `graphmode rank` is started by torchrun",
                             where="environment", value=missing,
                             fix="torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                                 "-m graphmode rank ... (docs/tensor-parallel.md); on one machine graphmode "
                                 "starts the ranks itself (graphmode run --recipe)")
    try:
        return {"rank": int(environ["RANK"]), "world": int(environ["WORLD_SIZE"]),
                "master_addr": environ["MASTER_ADDR"], "master_port": int(environ["MASTER_PORT"]),
                "local_world": int(environ.get("LOCAL_WORLD_SIZE") or 1)}
    except ValueError:
        raise GraphmodeError("RANK, WORLD_SIZE, MASTER_PORT and LOCAL_WORLD_SIZE must be integers",
                             where="environment", value={k: environ.get(k) for k in TORCHRUN_ENV},
                             fix="start the ranks with torchrun") from None


def named_outputs(out: Any) -> dict[str, Any]:
    """The tensors of a model's outputs by name (a mapping's keys, else output_<i>)."""
    import torch
    import torch.utils._pytree as pytree
    if isinstance(out, Mapping):
        return {str(k): v for k, v in out.items() if isinstance(v, torch.Tensor)}
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return {f"output_{i}": t for i, t in enumerate(leaves)}


class RequestFile:
    """Rank 0's requests from a JSONL file ("-": stdin, read as lines come) and its answers, one
    JSON line each, in the order of the requests, with the request's line number. A line the
    codec refuses is answered with its error and not sent. The lines are read on a thread of
    their own (Broadcasts), ahead of the answers: each waits in `_lines` for its turn."""

    def __init__(self, path: Path, dtypes: Mapping[str, str], out: Any):
        self.path, self.dtypes, self.out = path, dtypes, out
        self.answered = self.refused = 0
        self._lines: deque[list] = deque()     # [line number, its answer (None while it runs), refused?], in order
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[tuple]:
        from graphmode.serve.codec import decode_json
        try:
            f = sys.stdin.buffer if str(self.path) == "-" else open(self.path, "rb")
        except OSError as e:
            raise GraphmodeError(f"cannot read the requests: {e.strerror or e}", where="--requests",
                                 value=str(self.path), fix="pass a JSONL file, one {\"inputs\": {...}} a line") from None
        with f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    inputs = decode_json(raw, self.dtypes)
                except GraphmodeError as e:
                    self._done([n, json.dumps({"line": n, "error": e.to_dict()}), True])
                    continue
                with self._lock:
                    self._lines.append([n, None, False])
                yield ("run", (), inputs)

    def answer(self, reply: tuple) -> None:
        from graphmode.serve.codec import encode_json
        with self._lock:
            entry = next(e for e in self._lines if e[1] is None)
        if reply[0] == "error":
            entry[1:] = [json.dumps({"line": entry[0], "error": reply[1].to_dict()}), True]
        else:
            entry[1] = encode_json({"outputs": named_outputs(reply[1]), "line": entry[0]}).decode()
        self._done(None)

    def _done(self, refused: list | None) -> None:
        """Write every answer whose earlier lines are answered (`refused`: a line not sent)."""
        with self._lock:
            if refused is not None:
                self._lines.append(refused)
            while self._lines and self._lines[0][1] is not None:
                _, text, refused_line = self._lines.popleft()
                self.out.write(text + "\n")
                self.refused += refused_line
                self.answered += not refused_line
            self.out.flush()


@app.command("rank")
def rank_cmd(
    model: str = typer.Option(..., "--model", help="the model every rank loads: minilm | gpt2 | path.onnx | "
                                                   "package.module:function | path/file.py:function | GROUP.gm (a "
                                                   "saved group: each rank loads its own file, nothing compiled)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="a recipe with parallel.tensor = torchrun's "
                                                                "WORLD_SIZE (a GROUP.gm carries its own)"),
    requests: Optional[Path] = typer.Option(None, "--requests", help="rank 0: JSONL, one {\"inputs\": {...}} a line "
                                                                     "(the server's JSON body), - for stdin; other ranks "
                                                                     "ignore it"),
    out: Optional[Path] = typer.Option(None, "--out", help="rank 0: where the answers go, one JSON line each "
                                                           "(default: stdout)"),
    serve_port: Optional[int] = typer.Option(None, "--serve-port", min=0, max=65535,
                                             help="rank 0: serve the group over HTTP on this port (graphmode serve's "
                                                  "endpoints, decoders' completions included) instead of --requests"),
    host: str = typer.Option("127.0.0.1", "--host", help="rank 0's address for --serve-port"),
    admin_token: Optional[str] = typer.Option(None, "--admin-token", envvar="GRAPHMODE_ADMIN_TOKEN",
                                              show_default=False, help="with --serve-port: as graphmode serve's"),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth",
                                          help="with --serve-port: listen beyond loopback without an admin token"),
    target: str = typer.Option("host", "--target"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=1024,
                                          help="per rank (default: this node's cores / LOCAL_WORLD_SIZE)"),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """One rank of a tensor-parallel group started by torchrun (docs/tensor-parallel.md, "Several
    machines"): joins the group at torchrun's rendezvous, compiles only its shard, runs rank 0's
    requests with the other ranks until the file ends, or until rank 0's server stops (--serve-port)."""
    from graphmode.compiler import rank_driver
    from graphmode.parallel.torchrun import run_rank
    from graphmode.recipe import load_recipe
    from graphmode.runtime.artifact import is_artifact
    from graphmode.runtime.rank_artifacts import group_driver, group_files

    env = torchrun_env(os.environ)
    if is_artifact(model):        # a saved group: this rank's own file, checked against the group file
        if recipe is not None:
            raise GraphmodeError("--recipe does not apply to a saved group: it carries its recipe", where="--recipe",
                                 value=recipe, fix="drop --recipe")
        spec, rec = group_files(model, env["rank"])
        driver = group_driver()
    elif recipe is None:
        raise GraphmodeError("no recipe given", where="--recipe", fix="pass --recipe FILE (a GROUP.gm carries its own)")
    else:
        spec, rec, driver = model, load_recipe(recipe), rank_driver()
    if rec.parallel is None or rec.parallel.tensor < 2:
        raise GraphmodeError("the recipe has no tensor-parallel split (parallel.tensor < 2): there is nothing for "
                             "several ranks to share", where="parallel.tensor", fix="graphmode run --recipe")
    if rec.memory.kv_cache is not None:         # every rank builds a decode engine; rank 0 schedules
        if serve_port is None:
            raise GraphmodeError("a decoder recipe (memory.kv_cache) is served: its ranks decode completions, not "
                                 "requests of a file", where="--requests", fix="pass --serve-port PORT to every rank "
                                 "and POST /v1/completions to rank 0")
        from graphmode.decode.tensor_parallel import decoder_driver
        driver = decoder_driver()
    if env["rank"] == 0 and (requests is None) == (serve_port is None):
        raise GraphmodeError("rank 0 takes its requests from a file or serves them over HTTP, one of the two",
                             where="--requests / --serve-port", value={"requests": requests, "serve_port": serve_port},
                             fix="pass --requests FILE (JSONL, one {\"inputs\": {...}} a line), or --serve-port PORT, "
                                 "to every rank")
    if env["rank"] == 0 and requests is not None and str(requests) != "-" and not requests.is_file():
        raise GraphmodeError("no such requests file", where="--requests", value=str(requests),
                             fix="pass a JSONL file, one {\"inputs\": {...}} a line, or - for stdin")
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, env["local_world"]))
    serve = None
    if env["rank"] == 0 and serve_port is not None:
        serve = http_server(model, rec, target, host, serve_port, cache_dir, threads, admin_token, insecure_no_auth)
    sink = open(out, "w") if env["rank"] == 0 and out is not None else sys.stdout
    try:
        feed = RequestFile(requests, {i.name: i.dtype for i in rec.inputs}, sink) \
            if env["rank"] == 0 and requests is not None else None
        info = run_rank(spec, rec, target, rank=env["rank"], world=env["world"], master_addr=env["master_addr"],
                        master_port=env["master_port"], driver=driver, requests=feed,
                        answer=feed.answer if feed else None, serve=serve, cache_dir=cache_dir, threads=threads)
    finally:
        if sink is not sys.stdout:
            sink.close()
    done = f", {feed.answered} answered, {feed.refused} refused" if feed else ""
    if "artifact" in info:
        done += (f", loaded from {Path(spec[env['rank']]).name} ({info['artifact_loads']} bucket(s), "
                 f"{info['kernel_compiles']} kernel(s) compiled)")
    err_console.print(f"rank {env['rank']}/{env['world']}: {info['weights_bytes'] / 2**20:.2f} MiB of weights{done}",
                      highlight=False)


def http_server(model: str, recipe: Any, target: str, host: str, port: int, cache_dir: Any, threads: int,
                admin_token: str | None, insecure_no_auth: bool) -> Any:
    """Rank 0's `serve(group)` for run_rank: graphmode serve's server over the group torchrun
    started (a decoder recipe's as a decode engine on the ranks), until Ctrl-C or SIGTERM. The
    address is checked now, before anything compiles."""
    from graphmode.cli.serve_cmd import run_http
    from graphmode.serve.app import check_exposure
    from graphmode.serve.server import ModelServer, ServeConfig

    config = ServeConfig(target=target, cache_dir=cache_dir, threads=threads, admin_token=admin_token,
                         insecure_no_auth=insecure_no_auth)
    check_exposure(host, config)

    def serve(group: Any) -> None:
        if recipe.memory.kv_cache is not None:
            from graphmode.decode.tensor_parallel import TensorParallelDecoder
            group = TensorParallelDecoder(group, threads=threads)
        run_http(lambda on_state, on_stage: ModelServer(model, recipe, config=config, on_state=on_state,
                                                        on_stage=on_stage, group=group), host, port, "INFO")
    return serve
