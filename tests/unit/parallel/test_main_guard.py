"""A script that starts tensor-parallel ranks from its unguarded top level is refused before any
rank spawns (each rank imported the script again and died in multiprocessing's bootstrapping
check; the caller saw "rank 1 exited with code 1")."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """\
import sys
from graphmode.errors import GraphmodeError
from graphmode.parallel.main_guard import check_main_guard


def start():
    check_main_guard()          # what launch() calls before spawning


{body}
"""


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT.format(body=textwrap.dedent(body)))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_an_unguarded_top_level_call_is_refused_naming_the_line_and_the_guard(tmp_path):
    res = run(tmp_path, """\
        try:
            start()
        except GraphmodeError as e:
            print("REFUSED", e.where, "|", e.fix)
    """)
    assert res.returncode == 0, res.stderr
    assert "REFUSED" in res.stdout and "user_script.py:11" in res.stdout, res.stdout
    assert 'if __name__ == "__main__":' in res.stdout


def test_a_guarded_call_and_a_call_from_a_guarded_function_pass(tmp_path):
    res = run(tmp_path, """\
        def main():
            start()
            print("STARTED")


        if __name__ == "__main__":
            main()
    """)
    assert res.returncode == 0 and "STARTED" in res.stdout, res.stdout + res.stderr


def test_python_dash_m_of_a_package_passes(tmp_path):
    """`python -m package` (graphmode's own __main__ calls main() unguarded): spawn does not run a
    package's __main__ again, so its ranks start."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("from graphmode.parallel.main_guard import check_main_guard\n"
                                     "check_main_guard()\nprint('STARTED')\n")
    res = subprocess.run([sys.executable, "-m", "userpkg"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and "STARTED" in res.stdout, res.stdout + res.stderr


def test_graphmode_warnings_print_as_one_line_each_and_others_as_python_prints_them():
    """What the CLI and each tensor-parallel rank print for a warning (not Python's file and line)."""
    from graphmode.errors import warning_line
    from graphmode.runtime.compiled import OutsideDraft

    class GraphmodeNotice(UserWarning):
        pass
    assert warning_line("dropped the cache", GraphmodeNotice) == "notice: dropped the cache"
    assert warning_line("outside the draft", OutsideDraft) == "warning: outside the draft"
    assert warning_line("deprecated", DeprecationWarning) is None
