"""The `graphmode` command. Each sub-command lives in its own module and registers itself
on `app` (or adds a sub-typer); this module only assembles them and maps errors to exit codes.

Exit codes: 0 ok, 1 refused (constraint counter-example, numerics mismatch), 2 malformed
input (field-level error). A traceback reaching the user is a bug.
"""
from __future__ import annotations

import importlib
import json

import typer
from rich.console import Console, ConsoleDimensions
from typer.core import TyperGroup

from graphmode.errors import GraphmodeError


class _Commands(TyperGroup):
    """Maps a GraphmodeError from any sub-command to its message and exit code, so the command
    behaves the same under `main()`, `python -m graphmode` and a test's CliRunner."""

    def parse_args(self, ctx, args):
        self._json = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GraphmodeError as e:
            fail(e, getattr(self, "_json", False))
        except KeyboardInterrupt:       # click ends it with 130 and no word (profile, compile: a silent exit)
            err_console.print("interrupted (Ctrl-C): the command stopped before it finished", markup=False,
                              highlight=False)
            raise typer.Exit(130) from None


app = typer.Typer(name="graphmode", no_args_is_help=True, add_completion=False, cls=_Commands,
                  pretty_exceptions_enable=False,
                  help="Graph-mode compiler and runtime for inference, driven by a verified recipe.")


class CliConsole(Console):
    """A rich console as wide as a terminal it writes to, and unbounded when it writes to a pipe
    or a file (CI logs, `| tee`, `| grep`): rich's 80-column default would shrink tables and cut
    the op names and source lines a fix needs, and break long lines. Piped, a table keeps its
    natural width and a line stays one line; checked at every print, so a CliRunner's captured
    stdout counts as piped."""

    PIPED_WIDTH = 10_000

    def __init__(self, *args, **kwargs) -> None:
        # rich turns an inherited COLUMNS (CI runners export COLUMNS=80) into a fixed width; that
        # describes a terminal, not the pipe we may be writing to, so only an explicit width counts.
        self._explicit_width = kwargs.get("width") is not None
        kwargs.setdefault("emoji", False)     # user text stays text: a spec `dec.py:llama` is not a llama emoji
        super().__init__(*args, **kwargs)

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if not self._explicit_width and not self.is_terminal:
            return ConsoleDimensions(self.PIPED_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


console = CliConsole()


@app.callback()
def _root(no_progress: bool = typer.Option(False, "--no-progress", help="show no progress on stderr (by "
                                           "default: a progress display on a terminal, plain lines when piped)")
          ) -> None:
    """Graph-mode compiler and runtime for inference, driven by a verified recipe."""
    from graphmode.cli.progress import set_enabled
    set_enabled(not no_progress)
err_console = CliConsole(stderr=True)

# Sub-command modules, in help order. A module missing here is simply not offered yet.
COMMAND_MODULES = ["recipe_cmd", "targets_cmd", "compile_cmd", "plan_cmd", "run_cmd", "verify_cmd",
                   "cache_cmd", "bench_cmd", "profile_cmd", "serve_cmd", "demo_cmd",
                   "generate_cmd", "rank_cmd", "ops_cmd", "recipe_init_cmd", "tune_cmd", "kb_cmd", "conformance_cmd"]


def _register() -> None:
    for mod in COMMAND_MODULES:
        try:
            importlib.import_module(f"graphmode.cli.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"graphmode.cli.{mod}":
                raise


def fail(err: GraphmodeError, as_json: bool = False) -> None:
    """Print a GraphmodeError for a human (or as JSON) and exit with its code."""
    if as_json:
        print(json.dumps(err.to_dict(), indent=2))
    else:
        err_console.print(f"[bold red]error:[/] {type(err).__name__}", highlight=False)
        err_console.print(err.render(), markup=False, highlight=False, soft_wrap=True)   # never break a path
    raise SystemExit(err.exit_code)


def _notices_as_lines(warnings) -> None:
    """graphmode's own notices (GraphmodeNotice: what it did for the user, and how to silence
    it) and warnings (a host probe it could not cache, ...) print as one `notice:` / `warning:`
    line on stderr, without Python's file and source line, which name graphmode's code."""
    shown = warnings.showwarning

    from graphmode.errors import warning_line

    def show(message, category, filename, lineno, file=None, line=None):
        said = warning_line(message, category)
        if said is not None:
            err_console.print(said, markup=False, highlight=False, soft_wrap=True)
        else:
            shown(message, category, filename, lineno, file, line)
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> None:
    import os
    import warnings

    from graphmode.openmp import apply_defaults
    apply_defaults(os.environ)      # OpenMP's spin: read once, when torch loads libgomp (graphmode/openmp.py)
    # torch.export's own deprecation noise is not the user's concern
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    _notices_as_lines(warnings)
    _register()
    try:
        app(args=argv)  # standalone: usage errors print and exit 2 inside typer; _Commands maps ours
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise SystemExit(130)


@app.command("version")
def version_cmd() -> None:
    """Print graphmode, torch and python versions."""
    import platform

    import torch

    import graphmode
    console.print(f"graphmode {graphmode.__version__}  torch {torch.__version__}  python {platform.python_version()}")
