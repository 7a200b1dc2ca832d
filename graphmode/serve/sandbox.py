"""The recipe sandbox: a recipe sent over HTTP is parsed, resolved and validated in a worker
process with a CPU, memory and wall-clock limit, never in the server process.

Why a process: a recipe's `${...}` expressions and bucket ranges are evaluated in pure
Python, and one big-integer operation (`9**64**64...`) holds the GIL for minutes in a
single bytecode, so a thread would still freeze the event loop, /healthz and SIGTERM with
it. The worker (`python -m graphmode.serve.sandbox`) imports the recipe stack (no torch),
proves a small recipe to load everything lazy, says `ready`, then answers one JSON line
per recipe. Before each check it limits itself: RLIMIT_CPU (the kernel kills it past the
check's CPU budget) and RLIMIT_DATA (an allocation past the memory budget fails). Past the
wall-clock deadline the server kills it. A worker that was killed, or has answered
`MAX_CHECKS` recipes, is replaced by a fresh one, started at once so the next check pays
no import time. A refusal comes back as the JSON error body, answered as is (422).

On success the worker returns the *resolved* recipe (plain numbers, no expressions) with
its YAML line numbers, so the server rebuilds the Recipe without evaluating anything the
client wrote, and finds only finite, printable numbers in it.
"""
from __future__ import annotations

import base64
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from graphmode.errors import GraphmodeError, RecipeError, RecipeErrors
from graphmode.serve.errors import RecipeRefused, ReloadBusy, error_dict

MAX_INT_BITS = 14_000          # ~4,200 digits: below Python's int <-> str limit (4,300 digits)
# exit status of a worker the kernel stopped at its CPU limit (SIGXCPU's default action ends it)
_CPU_KILLED = {-signal.SIGXCPU} if hasattr(signal, "SIGXCPU") else set()


def checked(recipe: Any, target: Any, what: str, max_plans: int) -> Any:
    """Layers 1-3 of `validate` (without the model's facts) and the plan-count bound; raises
    RecipeErrors / RecipeError. Returns the resolved recipe. Shared by the worker and the
    server (which also checks the recipe against its model)."""
    from graphmode.recipe import validate
    report = validate(recipe, target)
    if report.errors:
        for e in report.errors:
            e.where = f"{what}: {e.where}" if e.where else what
        raise RecipeErrors(report.errors)
    if report.plans > max_plans:
        raise RecipeError(f"the recipe asks for {report.plans} plans (buckets), more than this server's "
                          f"--max-plans {max_plans}", where=f"{what}: dims", line=recipe.line_of("dims"),
                          value=report.plans, fix="declare fewer buckets per dim (buckets: [...] or max_buckets), "
                                                  "or start the server with a larger --max-plans")
    return report.recipe


def unencodable(v: Any, path: str = "") -> tuple[str, Any] | None:
    """The first value strict JSON cannot carry (a non-finite float, an int too long to
    print), as (field path, value); None when there is none."""
    if isinstance(v, float) and not math.isfinite(v):
        return path, v
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
        return path, f"<an integer of {v.bit_length()} bits>"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        bad = unencodable(x, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if bad is not None:
            return bad
    return None


# ---- the worker (its own process) -----------------------------------------------------------

def _load(body: bytes, kind: str) -> Any:
    from graphmode.recipe import load_recipe
    if kind != "json":
        return load_recipe(body)                   # bytes: YAML text, never a path
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:      # JSONDecodeError, UnicodeDecodeError, 4300-digit ints
        raise RecipeError(f"malformed JSON recipe: {str(e)[:200]}", where="body",
                          fix="send a JSON object (or YAML with Content-Type: application/yaml)") from None
    if isinstance(doc, dict) and isinstance(doc.get("recipe"), dict):
        doc = doc["recipe"]                        # GET /v1/recipe's answer, sent back as is
    if not isinstance(doc, dict):
        raise RecipeError(f"a JSON recipe must be an object, not {type(doc).__name__}", where="body",
                          fix='send {"version": 1, "name": ..., "inputs": [...], ...}')
    return load_recipe(doc)


def _check(req: dict[str, Any]) -> dict[str, Any]:
    from graphmode.targets.schema import Target
    loaded = _load(base64.b64decode(req["body"]), req["kind"])
    recipe = checked(loaded, Target.model_validate(req["target"]), "recipe", req["max_plans"])
    dump = recipe.model_dump(mode="json", exclude_none=True)
    bad = unencodable(dump)
    if bad is not None:
        path, value = bad
        raise RecipeError("a number in the recipe is not finite or too long to serve", where=f"recipe: {path}",
                          line=loaded.line_of(path), value=value if isinstance(value, str) else repr(value),
                          fix="write finite numbers within the documented ranges")
    return {"recipe": dump, "lines": dict(loaded._lines)}


def _limit(cpu_s: float, memory_mb: float) -> None:
    """Cap this process for the next check: `cpu_s` more CPU seconds (SIGXCPU, whose default
    action ends it) and `memory_mb` more data memory (allocations fail with MemoryError).
    Only soft limits: the next check raises them again."""
    try:
        import resource
    except ImportError:                      # not POSIX: the parent's wall-clock deadline still holds
        return
    use = resource.getrusage(resource.RUSAGE_SELF)
    _soft(resource, resource.RLIMIT_CORE, 0)              # a worker stopped at its limit leaves no core file
    _soft(resource, resource.RLIMIT_CPU, math.ceil(use.ru_utime + use.ru_stime + cpu_s))
    try:
        with open("/proc/self/statm") as f:
            data_pages = int(f.read().split()[5])
    except (OSError, ValueError, IndexError):
        return                               # no /proc: the CPU limit and the deadline still hold
    _soft(resource, resource.RLIMIT_DATA, data_pages * os.sysconf("SC_PAGE_SIZE") + int(memory_mb * 2**20))


def _soft(resource: Any, which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def _answer(req: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, **_check(req)}
    except GraphmodeError as e:
        try:
            return {"ok": False, "error": error_dict(e)}
        except ValueError:                   # a value too long to print
            return {"ok": False, "error": {"error": type(e).__name__, "message": e.message, "where": e.where}}
    except MemoryError:
        return {"ok": False, "error": {"error": "RecipeError", "where": "recipe",
                                       "message": f"checking the recipe needs more than {req['memory_mb']:g} MB",
                                       "fix": "write smaller expressions and bucket ranges"}}
    except RecursionError:
        return {"ok": False, "error": {"error": "RecipeError", "where": "recipe",
                                       "message": "the recipe is nested too deeply"}}
    except Exception as e:  # noqa: BLE001 - any failure on untrusted input is that input's refusal
        return {"ok": False, "error": {"error": "RecipeError", "where": "recipe",
                                       "message": f"the recipe could not be checked: {type(e).__name__}: "
                                                  f"{str(e)[:300]}"}}


WARM_UP = {"version": 1, "name": "warm-up", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
           "dims": {"batch": {"buckets": [1, 2]}}}


def worker_main() -> None:
    """Read the settings line, warm up (imports, a first proof), say `ready`, then answer
    one line per request line until stdin closes."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                            # a stray print must not corrupt the answer lines
    settings = json.loads(sys.stdin.buffer.readline() or b"null")
    if not settings:
        return
    from graphmode.recipe import load_recipe
    from graphmode.targets.schema import Target
    target = Target.model_validate(settings["target"])
    checked(load_recipe(WARM_UP), target, "warm-up", 1 << 20)   # every lazy import and cache, before any limit
    out.write("ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        req = {**settings, **json.loads(line)}
        _limit(req["cpu_s"], req["memory_mb"])
        answer = _answer(req)
        try:
            text = json.dumps(answer, default=str)
        except ValueError:                   # an error value too long to print
            text = json.dumps({"ok": False, "error": {"error": "RecipeError", "where": "recipe",
                                                      "message": "the recipe holds a value too long to print"}})
        out.write(text + "\n")
        out.flush()


# ---- the server's side ----------------------------------------------------------------------

class _Worker:
    """One started worker process and what it has written so far."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import graphmode
        root = os.path.dirname(os.path.dirname(os.path.abspath(graphmode.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-m", "graphmode.serve.sandbox"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self.buf = b""
        self.ready = False
        self.timed_out = False
        self.checks = 0
        self.send(settings)

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except OSError:                      # it died: the next readline() sees EOF
            return False

    def readline(self, deadline: float) -> bytes | None:
        """The next line; b"" when the worker died first, None past the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b""
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def stop(self) -> None:
        """Kill the process; safe from another thread while one reads (it then sees EOF)."""
        if self.proc.poll() is None:
            self.proc.kill()

    def kill(self) -> None:
        """Kill the process and close the pipes (only the thread that reads it calls this)."""
        self.stop()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.proc.wait()


class RecipeSandbox:
    """Checks untrusted recipe text in a worker process, one check at a time."""

    MAX_CHECKS = 100                         # recipes one worker answers before a fresh one takes over

    def __init__(self, target: Any, *, cpu_s: float = 10.0, memory_mb: float = 1024.0, max_plans: int = 1024,
                 start_timeout_s: float = 300.0):
        self.settings = {"target": target.model_dump(mode="json"), "max_plans": max_plans, "cpu_s": cpu_s,
                         "memory_mb": memory_mb}
        self.cpu_s = cpu_s
        self.wall_s = 3 * cpu_s + 10.0       # a slow or overloaded host still gets its CPU seconds
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._closed = False

    def prewarm(self) -> None:
        """Start the worker now, so the first check does not wait for its imports."""
        if self._lock.acquire(blocking=False):
            try:
                if self._worker is None and not self._closed:
                    self._fresh()
            finally:
                self._lock.release()

    def check(self, body: bytes, kind: str) -> Any:
        """The resolved Recipe of `body` (`kind`: "json" or "yaml"); raises RecipeRefused."""
        from graphmode.recipe.loader import build_recipe
        if not self._lock.acquire(timeout=self.start_timeout_s + self.wall_s):
            raise ReloadBusy("another recipe is still being checked", where="recipe", fix="retry in a few seconds")
        try:
            answer = self._run(body, kind)
        finally:
            self._lock.release()
        if not answer.get("ok"):
            raise RecipeRefused(answer.get("error") or {"error": "RecipeError", "message": "recipe refused"})
        try:
            return build_recipe(answer["recipe"], answer["lines"], source=None)
        except RecipeError as e:             # the resolved form must load as the recipe did
            raise RecipeRefused(error_dict(e)) from None

    def _run(self, body: bytes, kind: str) -> dict[str, Any]:
        if self._closed:
            return _refusal("the server is shutting down")
        w = self._worker if self._worker is not None and self._worker.proc.poll() is None else self._fresh()
        if w is None:
            return _refusal("the server is shutting down")
        answer = self._ask(w, {"body": base64.b64encode(bytes(body)).decode(), "kind": kind})
        w.checks += 1
        if answer is None or w.checks >= self.MAX_CHECKS:
            self._fresh()                    # killed, garbled or used up: the next check gets a new one
        return answer or _refusal(self._why(w))

    def _ask(self, w: _Worker, req: dict[str, Any]) -> dict[str, Any] | None:
        if not w.ready:
            w.ready = w.readline(time.monotonic() + self.start_timeout_s) == b"ready"
            if not w.ready:
                w.stop()
                return None
        line = w.send(req) and w.readline(time.monotonic() + self.wall_s)
        if not line:
            w.stop()                         # past the deadline (None) or dead (b"")
            w.timed_out = line is None
            return None
        try:
            return json.loads(line)
        except ValueError:
            w.stop()
            return None

    def _why(self, w: _Worker) -> str:
        w.kill()
        rc = w.proc.returncode
        if self._closed:
            return "the server is shutting down"
        if w.timed_out:
            return f"checking the recipe took more than {self.wall_s:g} s"
        if not w.ready:
            return "the recipe checker did not start"
        if rc in _CPU_KILLED:
            return f"checking the recipe took more than {self.cpu_s:g} CPU seconds"
        return f"the recipe checker stopped (exit status {rc})"

    def _fresh(self) -> _Worker | None:
        old, self._worker = self._worker, (None if self._closed else _Worker(self.settings))
        if old is not None:
            old.kill()
        return self._worker

    def close(self) -> None:
        """Kill the worker (a check in progress answers at once)."""
        self._closed = True
        if self._worker is not None:
            self._worker.stop()


def _refusal(message: str, fix: str | None = None) -> dict[str, Any]:
    return {"ok": False, "error": {"error": "RecipeError", "message": message, "where": "recipe",
                                   "fix": fix or "write smaller expressions and bucket ranges (every value "
                                                 "is evaluated when the recipe is checked)"}}


if __name__ == "__main__":
    worker_main()
