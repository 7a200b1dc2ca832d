"""Damaged and edited `.gm` artifacts, loaded through `graphmode.load` and run.

One artifact of the fuzz MLP is saved once; each case writes a damaged copy: a byte flipped
inside a member (must be refused), a byte flipped anywhere or the file cut short, manifest
fields edited with every hash kept consistent (mode, threads, sizes, counts, names), members
replaced consistently (garbage, another shape of JSON, another library), members added
(compressed, unlisted, unsafe names), or a FIFO, device, folder or empty file in its place.
Accepted means loaded and run with the eager answer; anything else must be an ArtifactError. A
kernel library or timing entry replaced consistently may also be accepted: the builder finds
the library is not the plan's (its build key) and compiles it again, as for a cache.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from graphmode.fuzz.worker import special_file
from graphmode.runtime.artifact import manifest_digest

MANIFEST_EDITS: list[tuple[str, Any]] = [
    ("mode", "turbo"), ("mode", "eager"), ("mode", None), ("threads", 10 ** 9), ("threads", -1), ("threads", 0),
    ("threads", "4"), ("threads", 2 ** 64), ("threads", 1.5), ("buckets", []), ("buckets", ["batch=999"]),
    ("buckets", ["x"] * 5000), ("isa", "avx9000"), ("isa", 7), ("format", 1), ("format", 99), ("format", "2"),
    ("device", "cuda"), ("device", "../../x"), ("host", {"cpu": "x", "arch": "x86_64", "simd": ["a"] * 100}),
    ("host", []), ("kernels", ["../../etc/passwd"]), ("kernels", []), ("files", {}), ("files", []),
    ("outputs", "linear_2"), ("out_spec", 5), ("exact_dims", {}), ("recipe_hash", "0" * 16), ("graph_hash", 5),
    ("graphmode", "9.9.9"), ("torch", None), ("extra_field", 1), ("created", ["x"]), ("target", "../../etc"),
    ("model", "x" * 10000)]
REPLACEMENTS = [b"", b"garbage", b"[]", b"{}", b"null", b'{"a": 1e999}', b"[" * 10000, bytes(random.Random(0).randrange(256) for _ in range(64))]


def setup(work: Path) -> dict[str, Any]:
    import graphmode
    from graphmode.fuzz.models import RECIPE, SPEC
    from graphmode.recipe import load_recipe
    cm = graphmode.compile(SPEC, load_recipe(RECIPE), cache_dir=work / "build-cache")
    cm.save(work / "mlp.gm")
    with zipfile.ZipFile(work / "mlp.gm") as z:
        members = {i.filename: [i.header_offset + 30 + len(i.filename.encode()) + len(i.extra), i.compress_size]
                   for i in z.infolist()}
    return {"gm": str(work / "mlp.gm"), "members": members, "size": (work / "mlp.gm").stat().st_size,
            "work": str(work)}


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    members = sorted(ctx["members"])
    size = ctx["size"]
    pool: list[dict[str, Any]] = []
    for m in members:        # every member once, then random spots
        pool.append({"kind": "flip", "member": m, "at": 0.5, "expect": "invalid"})
    pool += [{"kind": "special", "what": w, "expect": "invalid"}
             for w in ("fifo", "dev-zero", "folder", "empty", "missing", "link-loop")]
    pool += [{"kind": "manifest", "field": f, "value": v, "expect": "invalid"} for f, v in MANIFEST_EDITS]
    pool += [{"kind": "add", "name": nm, "deflated": d, "listed": lst, "expect": "invalid"}
             for nm, d, lst in (("tactics/big.json", True, True), ("tactics/big.json", True, False),
                                ("../evil.json", False, False), ("/abs.json", False, True),
                                ("plans/extra.json", False, False), ("kernels/x.so", False, True))]
    rest = []
    for _ in range(max(0, n - len(pool)) + 40):
        k = rng.choice(["flip", "flip-raw", "truncate", "replace", "swap-library"])
        if k == "flip":
            rest.append({"kind": "flip", "member": rng.choice(members), "at": rng.random(), "expect": "invalid"})
        elif k == "flip-raw":
            rest.append({"kind": "flip-raw", "at": rng.randrange(size), "bit": rng.randrange(8), "expect": "either"})
        elif k == "truncate":
            rest.append({"kind": "truncate", "at": rng.randrange(size), "expect": "invalid"})
        elif k == "replace":      # a kernel library or timing entry is a cache of the plan: rebuilt, or refused
            m = rng.choice([m for m in members if m != "manifest.json"])
            rest.append({"kind": "replace", "member": m, "data": rng.randrange(len(REPLACEMENTS)),
                         "expect": "either" if m.startswith(("kernels/", "tactics/")) else "invalid"})
        else:
            rest.append({"kind": "swap-library", "expect": "either"})
    out = pool + rest
    if n < len(out):           # the fixed cases first (at most half), the rest drawn
        head = pool[: n // 2]
        out = head + rng.sample(out[len(head):], n - len(head))
    for i, c in enumerate(out):
        c["id"] = f"{i:03d}-{c['kind']}-" + str(c.get("member") or c.get("field") or c.get("what") or c.get("name")
                                                or c.get("at", ""))[:40]
    return out


def _rewrite(src: Path, dst: Path, replace: dict[str, bytes], manifest_edit: dict[str, Any] | None = None,
             add: list[tuple[str, bytes, bool, bool]] = ()) -> None:
    """`src` rewritten to `dst` with members replaced (their hashes updated in the manifest:
    a consistent edit, its digest too), manifest fields set, members added (deflated?, listed?)."""
    with zipfile.ZipFile(src) as zin:
        manifest = json.loads(zin.read("manifest.json"))
        for name, data in list(replace.items()) + [(a[0], a[1]) for a in add if a[3]]:
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest.update(manifest_edit or {})
        manifest["digest"] = manifest_digest(manifest)
        with zipfile.ZipFile(dst, "w") as zout:
            for info in zin.infolist():
                data = json.dumps(manifest).encode() if info.filename == "manifest.json" else \
                    replace.get(info.filename, zin.read(info.filename))
                zout.writestr(info, data)
            for name, data, deflated, _ in add:
                zout.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED)


def damaged(case: dict[str, Any], ctx: dict[str, Any], tmp: Path) -> Path:
    src, dst = Path(ctx["gm"]), tmp / "case.gm"
    k = case["kind"]
    if k in ("flip", "flip-raw", "truncate"):
        data = bytearray(src.read_bytes())
        if k == "flip":
            start, length = ctx["members"][case["member"]]
            at = start + min(length - 1, int(case["at"] * length)) if length else start
            data[at] ^= 0x10
        elif k == "flip-raw":
            data[case["at"]] ^= 1 << case["bit"]
        else:
            del data[case["at"]:]
        dst.write_bytes(bytes(data))
    elif k == "special":
        special_file(dst, case["what"])
    elif k == "manifest":
        _rewrite(src, dst, {}, {case["field"]: case["value"]})
    elif k == "replace":
        _rewrite(src, dst, {case["member"]: REPLACEMENTS[case["data"]]})
    elif k == "swap-library":            # another library of the same plan set, consistently listed
        with zipfile.ZipFile(src) as z:
            libs = sorted(n for n in z.namelist() if n.endswith(".so"))
            _rewrite(src, dst, {libs[0]: z.read(libs[-1])} if len(libs) > 1 else {})
    elif k == "add":
        big = b"\0" * (64 << 20) if case["name"].endswith("big.json") else b"{}"
        _rewrite(src, dst, {}, add=[(case["name"], big, case["deflated"], case["listed"])])
    return dst


def execute(case: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    import graphmode
    from graphmode.fuzz.models import check_output, sample
    with tempfile.TemporaryDirectory(dir=ctx["work"], prefix="case-") as tmp:
        path = damaged(case, ctx, Path(tmp))
        cm = graphmode.load(path, cache_dir=Path(tmp) / "cache")
        return check_output(cm(sample(2)))


def cleanup(work: Path) -> None:
    shutil.rmtree(work / "build-cache", ignore_errors=True)
