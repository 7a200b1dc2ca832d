"""A bounded, seeded robustness sweep over everything graphmode reads from a user or a disk.

`make fuzz` (`python -m graphmode.fuzz`) runs one fuzzer per kind of untrusted input and
prints a summary table; `tests/unit/fuzz/test_fuzz_sample.py` runs a CI-sized sample of the same
cases and asserts no failure. Every case ends in one of:

    accepted     the input was valid (or harmless) and ran, its output checked where there is one
    refused      a clear typed refusal: a GraphmodeError, an HTTP 4xx, a CLI exit without a traceback

or a failure: `traceback` (an exception that is not a GraphmodeError, or one in CLI output),
`hang` (no answer within the case's time limit), `signal` (the process died: SIGSEGV, SIGBUS,
SIGABRT, killed for memory), `http-5xx`, `invalid-accepted` (an input the case knows is
invalid ran), `valid-refused`, `wrong-output` (ran, but not what eager PyTorch computes).

Cases that could hang or kill the process run in a worker subprocess (worker.py) with a time
limit per case and a memory cap; a dead or stuck worker is recorded and replaced. The fuzzers:

    recipes       recipe.py       structural and text mutations of valid recipes
    onnx          onnx_files.py   byte and protobuf mutations of a small ONNX model
    artifacts     artifacts.py    damaged and edited `.gm` files (API and CLI)
    caches        caches.py       damaged plan, kernel and timing cache entries (API and CLI)
    kb            kb.py           damaged knowledge-base files and malformed `kb import` files
    http          http.py         malformed requests to a real server in every protocol
"""
FAMILIES = ("recipes", "onnx", "artifacts", "caches", "kb", "http")
