"""`graphmode serve --replicas` without a cluster: the plain server needs no Ray, a missing
extra is named before anything compiles, and the flags and the recipe map onto Ray Serve's
deployment options (replica count or autoscaling bounds, CPUs, the memory budget)."""
from __future__ import annotations

import importlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphmode.cli.app import _register, app
from graphmode.errors import GraphmodeError
from graphmode.recipe import load_recipe
from graphmode.serve.cluster import POLICY, ClusterConfig, deployment_options, require_ray
from graphmode.serve.server import ServeConfig

_register()
RECIPE = {"version": 1, "name": "enc", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2, 8]}}, "memory": {"budget_mb": 512}}


@pytest.fixture
def without_ray(monkeypatch):
    """As if the serve-cluster extra were not installed: importing ray fails."""
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)


def test_the_plain_server_imports_without_ray():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import graphmode.serve.app, graphmode.serve.server, graphmode.serve.cluster, graphmode.cli.serve_cmd\n"
            "assert 'ray.serve' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_extra_is_named(without_ray):
    with pytest.raises(GraphmodeError, match=r"graphmode\[serve-cluster\]") as e:
        require_ray()
    assert e.value.where == "--replicas"
    res = CliRunner().invoke(app, ["serve", "--model", "nothing-is-compiled", "--recipe", "r.yaml",
                                   "--replicas", "2"])
    assert res.exit_code == 2, res.output
    assert "serve-cluster" in res.output and "Ray Serve" in res.output


def test_fixed_replicas_map_to_num_replicas_with_the_recipe_budget():
    opts = deployment_options(load_recipe(RECIPE), ClusterConfig(replicas=3, replica_cpus=2), ServeConfig())
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2, "memory": 512 * 2**20}
    assert opts["user_config"] == {"replica_ready_timeout_s": 600.0}
    assert opts["max_surge_percent"] == 33          # a reload rolls with one replica beyond the 3 (ceil(33% of 3))


def test_autoscaling_bounds_and_graphmodes_sla_policy():
    rec = load_recipe(RECIPE)
    opts = deployment_options(rec, ClusterConfig(replicas=2, min_replicas=1, max_replicas=4), ServeConfig())
    assert "num_replicas" not in opts
    # graphmode's policy decides (its own windows: Ray's delays off); the routing target is one
    # full batch (the recipe's largest) in flight per replica
    assert opts["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4,
                                          "target_ongoing_requests": 8.0, "policy": {"policy_function": POLICY},
                                          "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
    module, _, name = POLICY.partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    opts = deployment_options(rec, ClusterConfig(max_replicas=3, target_ongoing_requests=2), ServeConfig())
    assert opts["autoscaling_config"]["min_replicas"] == 1 and opts["autoscaling_config"]["max_replicas"] == 3
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 2


@pytest.mark.parametrize("kwargs, where", [({"replicas": 0}, "--replicas"),
                                           ({"min_replicas": 3, "max_replicas": 2, "replicas": 2}, "--min-replicas"),
                                           ({"replicas": 5, "max_replicas": 4}, "--replicas"),
                                           ({"replica_cpus": 0}, "--replica-cpus"),
                                           ({"max_replicas": 2, "scale_window_s": 0}, "--scale-window-s"),
                                           ({"max_replicas": 2, "scale_up_windows": 0}, "--scale-up-windows")])
def test_bad_cluster_options_are_refused_naming_the_flag(kwargs, where):
    with pytest.raises(GraphmodeError) as e:
        ClusterConfig(**kwargs)
    assert e.value.where == where


def test_the_replica_error_is_read_out_of_rays_report():
    from graphmode.serve.cluster import _replica_error
    report = ("Failed to update the deployments.\nTraceback (most recent call last):\n  File \"replica.py\", line 1\n"
              "ray.exceptions.RayTaskError(GraphmodeError): ray::ServeReplica.initialize_and_get_metadata()\n"
              "graphmode.errors.GraphmodeError: a.gm: replica x1: built for riscv64, this host is x86_64\n"
              "  fix: compile again on this host (graphmode compile ... --save)\n")
    assert _replica_error(report) == ("a.gm: replica x1: built for riscv64, this host is x86_64",
                                      "compile again on this host (graphmode compile ... --save)")
    assert _replica_error("the node died") == ("the node died", None)


def test_the_recipe_is_needed_unless_the_model_is_an_artifact():
    res = CliRunner().invoke(app, ["serve", "--model", "minilm"])
    assert res.exit_code == 2 and "--recipe is needed" in res.output, res.output


def test_variants_are_refused_with_replicas():
    pytest.importorskip("ray.serve", reason="needs the serve-cluster extra: pip install 'graphmode[serve-cluster]'")
    res = CliRunner().invoke(app, ["serve", "--model", "minilm", "--recipe", "r.yaml", "--variant", "v.yaml",
                                   "--replicas", "2"])
    assert res.exit_code == 2 and "--variant is not supported with replicas" in res.output, res.output
    assert "different recipes" in res.output and "--max-replicas" in res.output and "PUT /v1/recipe" in res.output


def test_an_address_where_no_cluster_answers_is_refused_at_once():
    from graphmode.serve.cluster import check_address
    with socket.socket() as s:                 # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GraphmodeError, match="cannot join the Ray cluster") as e:
        check_address(f"127.0.0.1:{port}")
    assert e.value.where == "--address" and "ray start --head" in e.value.fix
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_address(f"127.0.0.1:{s.getsockname()[1]}")
    check_address("auto")
    check_address(None)


def test_an_eager_recipe_has_nothing_to_compile_and_its_model_file_is_made_absolute(monkeypatch):
    from graphmode.serve.cluster import prepare
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    served = prepare("tests/e2e/tiny_models.py:mlp", dict(RECIPE, exe_mode="eager"), ServeConfig())
    assert served.model == f"{root / 'tests/e2e/tiny_models.py'}:mlp" and not served.compiled_by_driver
    assert served.recipe.exe_mode == "eager"


PARALLEL = {"tensor": 2, "device_group": ["rank0", "rank1"],
            "links": {"loopback": {"bandwidth_gbps": 10, "latency_us": 5}}}


def test_a_tensor_parallel_recipe_is_refused_before_the_driver_compiles():
    from graphmode.errors import RecipeError
    from graphmode.serve.cluster import prepare
    with pytest.raises(RecipeError, match="tensor-parallel") as e:
        prepare("tests/e2e/tiny_models.py:mlp", dict(RECIPE, parallel=PARALLEL), ServeConfig())
    assert e.value.where == "parallel.tensor"


def _fake_ray_node(monkeypatch, dead):
    """ray._private.worker._global_node as Ray keeps it: the processes of the cluster it started."""
    import types
    worker = types.SimpleNamespace(_global_node=types.SimpleNamespace(dead_processes=dead))
    private = types.SimpleNamespace(worker=worker)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(_private=private))
    monkeypatch.setitem(sys.modules, "ray._private", private)
    monkeypatch.setitem(sys.modules, "ray._private.worker", worker)


def test_a_local_ray_cluster_ended_by_the_group_s_signal_is_seen_as_gone(monkeypatch):
    """A signal to the process group reaches the Ray cluster the server started: its processes
    exit (the dashboard first, while the GCS stops answering), and the stop then skips Serve's
    calls, which waited a minute on the dead GCS and ended the process with exit 1."""
    from graphmode.serve.cluster import _local_cluster_gone
    calls = iter([[], [], [("dashboard", object())]])
    _fake_ray_node(monkeypatch, lambda: next(calls))
    assert _local_cluster_gone(within_s=30)
    _fake_ray_node(monkeypatch, lambda: [])
    assert not _local_cluster_gone(within_s=0.1)
    monkeypatch.setitem(sys.modules, "ray._private.worker", None)      # another Ray's internals: stop as usual
    assert not _local_cluster_gone(within_s=0.1)


def test_ray_init_keeps_the_process_s_sigterm_handler():
    """ray.init installs a SIGTERM handler that aborts the process (exit 134): the server's own
    handler (SIGTERM ends like Ctrl-C) is put back after it."""
    import signal

    from graphmode.serve.cluster import _SigtermKept
    mine = lambda signum, frame: None       # noqa: E731
    before = signal.signal(signal.SIGTERM, mine)
    try:
        keep = _SigtermKept()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)          # what ray.init does, as far as Python sees
        keep.restore()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
