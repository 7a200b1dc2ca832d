"""Malformed requests to a real `graphmode serve` in every protocol: JSON and safetensors
`/v1/infer`, KServe v2, OpenAI `/v1/completions` (a decoder server), the other endpoints.

The servers run as subprocesses (the fuzz MLP; a tiny GPT-2 with a paged KV cache), and the
runner sends each case with a time limit: 2xx is accepted, 4xx refused, 5xx a failure, no
answer a hang, and a server that died is a `signal` failure (restarted for the next case).
Baseline requests must be answered 2xx; requests the protocol says are wrong must get a 4xx.
"""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from graphmode.fuzz.outcome import Result, first_line
from graphmode.fuzz.worker import kill_group

ODD = [None, True, 0, -1, 1.5, 2 ** 63, 10 ** 40, "x", "", [], {}, [[[[[]]]]], "NaN", "\x1b[31m", "a" * 100000]
MODEL = "fuzz-mlp"


def setup(work: Path) -> dict[str, Any]:
    import yaml

    from graphmode.fuzz.models import DECODER_RECIPE, DECODER_SPEC, RECIPE, SPEC
    (work / "encoder.yaml").write_text(yaml.safe_dump(RECIPE))
    (work / "decoder.yaml").write_text(yaml.safe_dump(DECODER_RECIPE))
    return {"work": str(work), "servers": {"encoder": [SPEC, str(work / "encoder.yaml")],
                                           "decoder": [DECODER_SPEC, str(work / "decoder.yaml")]}}


def _row(rng: random.Random) -> list[float]:
    return [round(rng.uniform(-2, 2), 3) for _ in range(16)]


def _safetensors(tensors: dict[str, Any]) -> bytes:
    import torch
    from safetensors.torch import save
    return save({k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in tensors.items()})


def _infer_cases(rng: random.Random) -> list[dict[str, Any]]:
    good = {"inputs": {"x": [_row(rng)]}}
    out = [{"name": "json-valid", "path": "/v1/infer", "json": good, "expect": "valid"},
           {"name": "json-valid-dict-form", "path": "/v1/infer",
            "json": {"inputs": {"x": {"data": _row(rng) * 2, "shape": [2, 16], "dtype": "f32"}}}, "expect": "valid"}]
    bad = {"no-inputs": {}, "inputs-list": {"inputs": [1]}, "inputs-str": {"inputs": "x"},
           "unknown-name": {"inputs": {"y": [_row(rng)]}}, "short-row": {"inputs": {"x": [_row(rng)[:15]]}},
           "ragged": {"inputs": {"x": [_row(rng), _row(rng)[:3]]}}, "rank-3": {"inputs": {"x": [[_row(rng)]]}},
           "strings": {"inputs": {"x": [["a"] * 16]}}, "nulls": {"inputs": {"x": [[None] * 16]}},
           "bools": {"inputs": {"x": [[True] * 16]}}, "batch-3": {"inputs": {"x": [_row(rng)] * 3}},
           "batch-0": {"inputs": {"x": []}}, "huge-number": {"inputs": {"x": [[1e308] * 16]}},
           "dict-shape-mismatch": {"inputs": {"x": {"data": [1.0] * 5, "shape": [2, 16]}}},
           "dict-huge-shape": {"inputs": {"x": {"data": [1.0], "shape": [10 ** 12, 16]}}},
           "dict-negative-shape": {"inputs": {"x": {"data": [1.0], "shape": [-1, 16]}}},
           "dict-wrong-dtype": {"inputs": {"x": {"data": _row(rng), "shape": [1, 16], "dtype": "i64"}}},
           "dict-odd-dtype": {"inputs": {"x": {"data": _row(rng), "shape": [1, 16], "dtype": "f128"}}}}
    out += [{"name": f"json-{k}", "path": "/v1/infer", "json": v, "expect": "invalid"} for k, v in bad.items()]
    raw = {"not-json": b"{", "nan-token": b'{"inputs": {"x": [[NaN' + b", 0" * 15 + b"]]}}", "empty": b"",
           "deep": b'{"inputs": ' + b"[" * 100000 + b"]" * 100000 + b"}", "binary": rng.randbytes(64),
           "huge-int": b'{"inputs": {"x": [[' + b"9" * 5000 + b"]]}}"}
    out += [{"name": f"raw-{k}", "path": "/v1/infer", "body": v.hex(), "ctype": "application/json",
             "expect": "invalid"} for k, v in raw.items()]
    out.append({"name": "raw-utf16", "path": "/v1/infer", "body": json.dumps(good).encode("utf-16").hex(),
                "ctype": "application/json", "expect": "either"})     # RFC 7159 allowed it; read or refused
    return out


def _binary_cases(rng: random.Random) -> list[dict[str, Any]]:
    import torch
    x = torch.randn(1, 16)
    good = _safetensors({"x": x})
    out = [{"name": "st-valid", "path": "/v1/infer", "body": good.hex(), "ctype": "application/octet-stream",
            "expect": "valid"}]
    bad = {"wrong-dtype": _safetensors({"x": x.double()}), "wrong-name": _safetensors({"y": x}),
           "wrong-shape": _safetensors({"x": torch.randn(1, 15)}), "batch-3": _safetensors({"x": torch.randn(3, 16)}),
           "nan": _safetensors({"x": torch.full((1, 16), float("nan"))}),
           "header-len-huge": (2 ** 62).to_bytes(8, "little") + b"{}", "header-not-json": (5).to_bytes(8, "little")
           + b"{{{{{", "truncated": good[: len(good) // 2], "garbage": rng.randbytes(100),
           "offsets-out": (len(b'{"x":{"dtype":"F32","shape":[1,16],"data_offsets":[0,99999]}}')).to_bytes(8, "little")
           + b'{"x":{"dtype":"F32","shape":[1,16],"data_offsets":[0,99999]}}'}
    out += [{"name": f"st-{k}", "path": "/v1/infer", "body": v.hex(), "ctype": "application/octet-stream",
             "expect": "invalid"} for k, v in bad.items()]
    for ct in ("text/plain", "multipart/form-data; boundary=x", "application/xml", "", "application/json; charset=latin-1"):
        out.append({"name": f"ctype-{ct or 'none'}", "path": "/v1/infer", "body": good.hex(), "ctype": ct,
                    "expect": "invalid"})
    for _ in range(15):                          # random bytes flipped in a valid buffer
        b = bytearray(good)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out.append({"name": "st-flip", "path": "/v1/infer", "body": bytes(b).hex(), "ctype": "application/octet-stream",
                    "expect": "either"})
    return out


def _kserve_cases(rng: random.Random) -> list[dict[str, Any]]:
    def body(**over: Any) -> dict[str, Any]:
        inp = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": _row(rng)}
        inp.update(over)
        return {"inputs": [inp]}
    path = f"/v2/models/{MODEL}/infer"
    out = [{"name": "v2-valid", "path": path, "json": body(), "expect": "valid"},
           {"name": "v2-outputs", "path": path, "json": dict(body(), outputs=[{"name": "linear_2"}]),
            "expect": "either"}]
    bad = {"datatype": body(datatype="BYTES"), "odd-datatype": body(datatype="FP128"), "shape": body(shape=[2, 16]),
           "name": body(name="y"), "data-nested-wrong": body(data=[[1.0] * 3]), "data-str": body(data="x"),
           "shape-neg": body(shape=[-1, 16]), "shape-huge": body(shape=[10 ** 12, 16]), "inputs-dict": {"inputs": {}},
           "no-inputs": {}, "unknown-output": dict(body(), outputs=[{"name": "nope"}])}
    out += [{"name": f"v2-{k}", "path": path, "json": v, "expect": "invalid"} for k, v in bad.items()]
    out.append({"name": "v2-unknown-model", "path": "/v2/models/nope/infer", "json": body(), "expect": "invalid"})
    out.append({"name": "v2-parameters-list", "path": path, "json": dict(body(), parameters=[1]), "expect": "invalid"})
    for _ in range(10):
        b = body()
        k = rng.choice(["name", "shape", "datatype", "data", "parameters"])
        b["inputs"][0][k] = rng.choice(ODD)
        out.append({"name": f"v2-odd-{k}", "path": path, "json": b, "expect": "either"})
    return out


def _other_cases(rng: random.Random) -> list[dict[str, Any]]:
    out = [{"name": f"get-{p}", "method": "GET", "path": p, "expect": "valid"}
           for p in ("/healthz", "/readyz", "/metrics", "/v1/recipe", "/v2", "/v2/health/live", "/v2/health/ready",
                     f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready")]
    out += [{"name": f"{m.lower()}-{p}", "method": m, "path": p, "expect": "invalid"}
            for m, p in (("DELETE", "/v1/infer"), ("PATCH", "/v1/recipe"), ("GET", "/v1/infer"), ("GET", "/nope"),
                         ("GET", "/v2/models/nope"), ("POST", "/healthz"), ("GET", "/" + "a" * 2000),
                         ("GET", "/v1/infer/../../etc/passwd"), ("GET", "/%00"))]
    out.append({"name": "put-recipe-unauthenticated", "method": "PUT", "path": "/v1/recipe", "body": b"version: 1".hex(),
                "ctype": "application/yaml", "expect": "either"})
    out.append({"name": "head-healthz", "method": "HEAD", "path": "/healthz", "expect": "valid"})
    out.append({"name": "huge-header", "path": "/v1/infer", "json": {"inputs": {}}, "headers": {"X-Big": "a" * (1 << 20)},
                "expect": "invalid"})
    return out


def _completion_cases(rng: random.Random) -> list[dict[str, Any]]:
    from graphmode.fuzz.models import VOCAB

    def c(**over: Any) -> dict[str, Any]:
        b = {"prompt": [rng.randrange(3, VOCAB) for _ in range(4)], "max_tokens": 3, "temperature": 0}
        b.update(over)
        return b
    out = [{"name": "cmpl-valid", "path": "/v1/completions", "json": c(), "expect": "valid", "server": "decoder"},
           {"name": "cmpl-valid-batch", "path": "/v1/completions", "json": c(prompt=[[5, 6, 7], [8, 9]]),
            "expect": "valid", "server": "decoder"},
           {"name": "cmpl-valid-sampled", "path": "/v1/completions", "json": c(temperature=0.8, top_p=0.9, seed=3),
            "expect": "valid", "server": "decoder"},
           {"name": "infer-decoder-valid", "path": "/v1/infer",
            "json": {"inputs": {"input_ids": [[5, 6, 7, 8]], "attention_mask": [[1, 1, 1, 1]]}}, "expect": "valid",
            "server": "decoder"}]
    bad = {"no-prompt": {"max_tokens": 3}, "prompt-dict": c(prompt={"a": 1}), "prompt-empty": c(prompt=[]),
           "prompt-floats": c(prompt=[1.5, 2.5]), "max-tokens-neg": c(max_tokens=-1),
           "max-tokens-huge": c(max_tokens=10 ** 9), "max-tokens-str": c(max_tokens="5"),
           "temperature-neg": c(temperature=-1), "temperature-str": c(temperature="hot"), "top-p-2": c(top_p=2),
           "too-many-prompts": c(prompt=[[5, 6]] * 100), "long-prompt": c(prompt=[5] * 1000),
           "stop-odd": c(stop=[[[1]]]), "n-2": c(n=2), "text-without-tokenizer": c(prompt="hello world")}
    out += [{"name": f"cmpl-{k}", "path": "/v1/completions", "json": v, "expect": "invalid", "server": "decoder"}
            for k, v in bad.items()]
    ranges = {"id-over-vocab": c(prompt=[VOCAB + 5, 4]), "id-negative": c(prompt=[-3, 4]), "id-2-63": c(prompt=[2 ** 63]),
             "one-token": c(prompt=[5])}
    out += [{"name": f"cmpl-{k}", "path": "/v1/completions", "json": v, "expect": "invalid", "server": "decoder"}
            for k, v in ranges.items()]
    for _ in range(12):
        k = rng.choice(["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "logprobs"])
        v = rng.choice(ODD)
        out.append({"name": f"cmpl-odd-{k}", "path": "/v1/completions", "json": c(**{k: v}), "expect": "either",
                    "server": "decoder"})
    return out


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    enc = _infer_cases(rng) + _binary_cases(rng) + _kserve_cases(rng) + _other_cases(rng)
    dec = _completion_cases(rng)
    pool = enc + dec
    while len(pool) < n:                           # random structural mutations of the valid JSON requests
        base = rng.choice([c for c in pool if c.get("json") is not None and c["expect"] == "valid"])
        body = json.loads(json.dumps(base["json"]))
        _mutate(body, rng)
        pool.append({"name": base["name"] + "-mutated", "path": base["path"], "json": body, "expect": "either",
                     "server": base.get("server", "encoder")})
    picked = pool if n >= len(pool) else rng.sample(pool, n)
    for i, c in enumerate(picked):
        c.setdefault("server", "encoder")
        c["id"] = f"{i:03d}-{c['server']}-{c['name']}"
    return sorted(picked, key=lambda c: c["server"] != "encoder")


def _mutate(v: Any, rng: random.Random) -> None:
    holders: list[tuple[Any, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, y in x.items():
                holders.append((x, k))
                walk(y)
        elif isinstance(x, list):
            for i, y in enumerate(x[:20]):
                holders.append((x, i))
                walk(y)
    walk(v)
    if holders:
        h, k = rng.choice(holders)
        h[k] = json.loads(json.dumps(rng.choice(ODD)))


class Server:
    """A `graphmode serve` subprocess on a free loopback port."""

    def __init__(self, spec: str, recipe: str, work: Path, log: Callable[[str], None]):
        self.spec, self.recipe, self.work, self.log = spec, recipe, work, log
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 600.0) -> None:
        import httpx
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with open(self.work / "server.log", "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "graphmode", "serve", "--model", self.spec, "--recipe",
                                          self.recipe, "--port", str(port), "--log-level", "warning",
                                          "--request-timeout-s", "30", "--cache-dir", str(self.work / "cache")],
                                         stdout=logf, stderr=logf, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphmode serve exited {self.proc.returncode} (see {self.work / 'server.log'})")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"graphmode serve was not ready within {timeout_s:g} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


def send(url: str, case: dict[str, Any], timeout_s: float) -> tuple[str, str]:
    import httpx
    headers = dict(case.get("headers") or {})
    if "json" in case:
        content = json.dumps(case["json"], allow_nan=True).encode()
        headers.setdefault("content-type", "application/json")
    elif "body" in case:
        content = bytes.fromhex(case["body"])
        if case.get("ctype"):
            headers["content-type"] = case["ctype"]
    else:
        content = None
    try:
        r = httpx.request(case.get("method", "POST"), url + case["path"], content=content, headers=headers,
                          timeout=timeout_s)
    except httpx.TimeoutException:
        return "hang", f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as e:
        return "refused-connection", f"{type(e).__name__}: {first_line(str(e))}"
    if r.status_code >= 500:
        return "http-5xx", f"{r.status_code} {first_line(r.text)}"
    if r.status_code >= 400:
        return "refused", f"{r.status_code} {first_line(r.text, 120)}"
    return "accepted", str(r.status_code)


def run_cases(cases: list[dict[str, Any]], ctx: dict[str, Any], timeout_s: float,
              log: Callable[[str], None]) -> list[Result]:
    from graphmode.fuzz.outcome import judged
    results: list[Result] = []
    work = Path(ctx["work"])
    for kind in ("encoder", "decoder"):
        mine = [c for c in cases if c["server"] == kind]
        if not mine:
            continue
        server = Server(*ctx["servers"][kind], work, log)
        t0 = time.perf_counter()
        server.start()
        log(f"http: {kind} server ready in {time.perf_counter() - t0:.1f} s")
        try:
            for c in mine:
                t = time.perf_counter()
                outcome, detail = send(server.url, c, min(timeout_s, 60.0))
                if outcome in ("refused-connection", "hang") and not server.alive():
                    rc = server.proc.returncode
                    outcome, detail = "signal", f"the server died ({'signal ' + str(-rc) if rc < 0 else f'exit {rc}'})"
                    server.start()
                elif outcome == "refused-connection":
                    outcome = "refused"        # the server closed the connection: a refusal, said badly
                outcome, detail = judged(c["expect"], outcome, detail)
                r = Result("http", c["id"], outcome, detail, time.perf_counter() - t)
                results.append(r)
                if r.failed:
                    log(f"  http {c['id']}: {outcome}: {detail}")
        finally:
            server.stop()
    return results
