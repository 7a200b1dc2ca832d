"""graphmode: a graph-mode compiler and runtime for deep-learning inference.

recipe -> capture -> IR -> passes -> plan -> backend -> runtime; see README.md.
"""
__version__ = "0.1.0"
