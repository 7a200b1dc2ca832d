"""Benchmark harness (`graphmode bench`) and per-instruction profiling (`graphmode profile`).

harness.py runs engines side by side; engines.py wraps eager, torch.compile, ONNX Runtime,
OpenVINO and graphmode; report.py writes the table, JSON, Markdown and chart; profile.py
times a compiled plan instruction by instruction and calibrates the host cost model.
"""
