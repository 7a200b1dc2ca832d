"""The `graphmode` command bounds OpenMP's idle spin before torch loads libgomp, and never
overrides a wait policy or spin count the user chose."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from graphmode.openmp import SPIN_COUNT, apply_defaults, defaults, in_effect


def test_defaults_leave_a_users_choice_alone():
    assert defaults({}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert defaults({"OMP_WAIT_POLICY": "active"}) == {} and defaults({"GOMP_SPINCOUNT": "300000"}) == {}
    env = {"PATH": "/bin"}
    assert apply_defaults(env) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)} and env["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    assert in_effect(env) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_the_command_sets_it_before_torch_is_imported():
    code = ("import importlib, os, sys\napp = importlib.import_module('graphmode.cli.app')\n"
            "app._register = lambda: print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
            "app.app = lambda args=None: None\napp.main([])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(SPIN_COUNT), "False"], out.stderr
