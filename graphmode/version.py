"""The package version, importable from any layer (the `graphmode` package itself is the facade)."""
__version__ = "0.1.0"
