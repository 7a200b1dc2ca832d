"""Benchmark harness (`graphmode bench`) and per-instruction profiling (`graphmode profile`).

One module per concept for encoders (`graphmode bench`) and decoders (`graphmode bench
decode`), each kind's specifics a small part of it: harness.py runs engines side by side in
interleaved rounds (rounds.py: the rounds, statistics, ratios and meta both share); engines.py wraps eager, torch.compile, ONNX Runtime, OpenVINO and
graphmode (encoders) and transformers, llama.cpp and graphmode's decode engine (decoders);
models.py says what runs; floors.py what the hardware allows; contend.py the CPU burners of
`--contend` (quiet and contended phases of each round); report.py writes the tables,
JSON, Markdown and chart; profile.py times a compiled plan instruction by instruction and
calibrates the host cost model.
"""
