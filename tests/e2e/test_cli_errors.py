"""Every CLI command over broken recipes, model specs, ONNX files and arguments: each one ends
with a graphmode error (exit 1 or 2) that names what is wrong — never a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from graphmode.cli.app import _register, app

from tiny_models import recipe

_register()
runner = CliRunner()
TINY = str(Path(__file__).with_name("tiny_models.py"))
MLP = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2]}})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("broken")
    f = {
        "good": d / "good.yaml", "malformed_yaml": d / "malformed.yaml", "empty": d / "empty.yaml",
        "wrong_type": d / "wrong_type.yaml", "unknown_key": d / "unknown_key.yaml", "binary": d / "binary.yaml",
        "list": d / "list.yaml", "huge": d / "huge.yaml", "broken_py": d / "broken_model.py",
        "raising_py": d / "raising_model.py", "bad_onnx": d / "bad.onnx", "dir": d / "adir",
        "fifo": d / "fifo.yaml", "zeros": d / "zeros.yaml",
    }
    import os
    os.mkfifo(f["fifo"])                         # opened, it blocked until something wrote to it
    f["zeros"].symlink_to("/dev/zero")           # read whole, it took every byte of memory
    f["good"].write_text(yaml.safe_dump(MLP))
    f["malformed_yaml"].write_text("version: 1\nname: [unclosed\n")
    f["empty"].write_text("")
    f["wrong_type"].write_text(yaml.safe_dump({**MLP, "version": "one"}))
    f["unknown_key"].write_text(yaml.safe_dump({**MLP, "speed": "fast"}))
    f["binary"].write_bytes(bytes(range(256)) * 4)
    f["list"].write_text("- 1\n- 2\n")
    f["huge"].write_text(yaml.safe_dump({**MLP, "memory": {"budget_mb": "${((9**64)**64)**64}"}}))
    f["broken_py"].write_text("def model(:\n")
    f["raising_py"].write_text("def model():\n    raise RuntimeError('boom')\n\ndef wrong():\n    return 42\n")
    f["bad_onnx"].write_bytes(b"\x08\x07not really onnx" * 10)
    f["dir"].mkdir()
    return {k: str(v) for k, v in f.items()}


def run(args: list[str]):
    res = runner.invoke(app, args)
    out = res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), f"{args}: {res.exception!r}\n{out}"
    assert "Traceback" not in out, f"{args}:\n{out}"
    return res, out


RECIPE_CASES = ["malformed_yaml", "empty", "wrong_type", "unknown_key", "binary", "list", "huge", "dir", "missing",
                "fifo", "zeros"]


@pytest.mark.parametrize("case", RECIPE_CASES)
@pytest.mark.parametrize("cmd", [["recipe", "validate"], ["recipe", "show"], ["compile", "--model", "MODEL",
                                                                            "--recipe"],
                                 ["run", "--model", "MODEL", "--recipe"], ["verify", "--model", "MODEL", "--recipe"],
                                 ["plan", "show", "--model", "MODEL", "--recipe"],
                                 ["cache", "explain", "--model", "MODEL", "--recipe"],
                                 ["serve", "--port", "0", "--model", "MODEL", "--recipe"], ["demo", "--recipe"]])
def test_broken_recipes(files, cmd, case):
    path = files.get(case, "/nonexistent/recipe.yaml")
    args = [a.replace("MODEL", f"{TINY}:mlp") for a in cmd] + [path]
    res, out = run(args)
    assert res.exit_code in (1, 2), (args, res.exit_code, out)
    if case not in ("huge",):
        assert res.exit_code == 2, (args, out)


MODEL_CASES = {
    "unknown": ("nosuchmodel", "nosuchmodel"),
    "syntax_error": ("{broken_py}:model", "broken_model.py"),
    "missing_function": ("{raising_py}:nothing", "nothing"),
    "raises": ("{raising_py}:model", "boom"),
    "wrong_return": ("{raising_py}:wrong", "int"),
    "bad_onnx": ("{bad_onnx}", "ONNX"),
    "directory": ("{dir}", "directory"),
    "missing_py": ("/nonexistent/m.py:model", "not found"),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
@pytest.mark.parametrize("cmd", [["compile"], ["run"], ["verify"], ["plan", "show"], ["cache", "explain"],
                                 ["recipe", "validate", "RECIPE", "--model"], ["serve", "--port", "0"], ["profile"],
                                 ["bench"]])      # serve binds its port before it loads the model: any free one
def test_broken_models(files, cmd, case):
    spec, needle = MODEL_CASES[case]
    spec = spec.format(**files)
    if cmd[0] == "recipe":
        args = ["recipe", "validate", files["good"], "--model", spec]
    elif cmd[0] in ("profile", "bench"):
        args = cmd + ["--model", spec, "--shape", "1x16"]
    else:
        args = cmd + ["--model", spec, "--recipe", files["good"]]
    res, out = run(args)
    assert res.exit_code == 2, (args, out)
    assert needle.lower() in out.lower(), (args, out)


@pytest.mark.parametrize("args,needle", [
    (["run", "--model", "MLP", "--recipe", "GOOD", "--shape", "0"], "positive"),
    (["run", "--model", "MLP", "--recipe", "GOOD", "--shape", "x"], "--shape"),
    (["run", "--model", "MLP", "--recipe", "GOOD", "--mode", "turbo"], "--mode"),
    (["run", "--model", "MLP", "--recipe", "GOOD", "--iters", "-3"], "iters"),
    (["plan", "show", "--model", "MLP", "--recipe", "GOOD", "--bucket", "99"], "outside"),
    (["compile", "--model", "MLP", "--recipe", "GOOD", "--target", "nosuchchip"], "nosuchchip"),
    (["compile", "--model", "MLP", "--recipe", "GOOD", "--dump-ir-after", "nosuchpass"], "nosuchpass"),
    (["cache", "prune", "--max-size", "lots"], "--max-size"),
    (["targets", "show", "nosuchchip"], "nosuchchip"),
    (["recipe", "diff", "GOOD", "/nonexistent.yaml"], "nonexistent"),
    (["serve", "--model", "MLP", "--recipe", "GOOD", "--port", "-5"], "port"),
    (["serve", "--model", "MLP", "--recipe", "GOOD", "--batch-window-ms", "-1"], "batch-window"),
    (["bench", "--model", "MLP", "--shape", "axb"], "shape"),
    (["run", "--model", "MLP", "--recipe", "GOOD", "--threads", "100000"], "--threads"),    # was a segfault
    (["serve", "--model", "MLP", "--recipe", "GOOD", "--threads", "-1"], "--threads"),
    (["cache", "ls", "--cache-dir", "GOOD"], "not a folder"),        # a file as the root: was an empty listing
])
def test_bad_arguments(files, args, needle):
    args = [a.replace("MLP", f"{TINY}:mlp").replace("GOOD", files["good"]) for a in args]
    res, out = run(args)
    assert res.exit_code == 2, (args, out)
    assert needle.lower() in out.lower(), (args, out)


def _nested_encoder():
    """nn.TransformerEncoder's nested-tensor fast path raises in eager on a mask that masks a row
    whole, which graphmode's random bool samples may hold."""
    import torch
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = enc

        def forward(self, x, mask):
            return self.e(x, src_key_padding_mask=mask)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True
    return M().eval(), {"x": torch.randn(2, 8, 16), "mask": mask}


@pytest.mark.parametrize("cmd", [pytest.param("run", marks=pytest.mark.slow), "verify"])   # one path, 11 s each
def test_eager_failing_on_the_sample_inputs_is_an_error_not_a_traceback(cmd, tmp_path):
    (tmp_path / "te.py").write_text("import sys\nsys.path.insert(0, %r)\nfrom test_cli_errors import _nested_encoder\n"
                                    % str(Path(__file__).parent))
    rec = recipe("te", [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]},
                        {"name": "mask", "dtype": "bool", "shape": ["batch", "seq"]}],
                 {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8], "min": 8}})   # the mask's reductions keep batch off padding
    (tmp_path / "te.yaml").write_text(yaml.safe_dump(rec))
    res, out = run([cmd, "--model", f"{tmp_path / 'te.py'}:_nested_encoder", "--recipe", str(tmp_path / "te.yaml"),
                    "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2 and "eager PyTorch fails at" in out and "sample inputs" in out, out


def _two_tables():
    """Two categorical columns of one input, each with its own table (10 and 3 levels), the second
    read through a product: the index analysis follows a column (`cat[:, 1]`, checked against its
    own table) but not a product, so samples drawn inside the larger table name rows past the
    smaller."""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Embedding(10, 4), torch.nn.Embedding(3, 4)

        def forward(self, cat):
            return self.a(cat[:, 0]) + self.b(cat[:, 1] * 1)
    return M().eval(), {"cat": torch.tensor([[9, 2], [1, 0]])}, {"cat": ["batch", 2]}


def test_run_says_when_an_op_refuses_samples_eager_refuses_too(tmp_path):
    """Trial AB: `run` on a model whose samples an embedding refused blamed the request ('send
    values the op accepts'); the user sent none. It says what verify says: eager fails on them."""
    (tmp_path / "tt.py").write_text("import sys\nsys.path.insert(0, %r)\nfrom test_cli_errors import _two_tables\n"
                                    % str(Path(__file__).parent))
    res, out = run(["run", "--model", f"{tmp_path / 'tt.py'}:_two_tables", "--shape", "batch=16",
                    "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2 and "eager PyTorch fails at" in out and "inputs[].range" in out, out
    assert "send values the op accepts" not in out, out


@pytest.mark.parametrize("where,needle", [("dir", "is a folder"), ("good", "is a file, not a folder")])
def test_an_unwritable_save_path_is_refused_before_compiling(files, where, needle):
    """`compile --save` built every bucket (minutes) and then failed on the path with a raw OSError."""
    path = files["dir"] if where == "dir" else files["good"] + "/x.gm"        # a file as the folder
    res, out = run(["compile", "--model", f"{TINY}:mlp", "--recipe", files["good"], "--save", path])
    assert res.exit_code == 2 and needle in out and "--save" in out, out      # malformed input (docs/cli.md)
    assert "plan for bucket" not in out, out


@pytest.mark.parametrize("args", [["recipe", "init", "--model", "MLP", "--out", "GOOD/x.yaml"],
                                  ["compile", "--model", "MLP", "--recipe", "GOOD", "--dump-ir-after", "all",
                                   "--dump-dir", "GOOD/dumps"]])
def test_an_output_path_under_a_file_is_refused_before_the_work(files, args):
    """recipe init --out and compile --dump-dir ended in a raw NotADirectoryError traceback."""
    args = [a.replace("MLP", f"{TINY}:mlp").replace("GOOD", files["good"]) for a in args]
    res, out = run(args)
    assert res.exit_code == 2 and "is a file, not a folder" in out and "Traceback" not in out, out


def test_a_refused_draft_says_its_fix_in_the_flags_recipe_init_takes(tmp_path):
    """recipe init --memory-mb 0.0001 was told to 'raise memory.budget_mb', a field the user never wrote."""
    res, out = run(["recipe", "init", "--model", f"{TINY}:mlp", "--memory-mb", "0.0001", "--kb", str(tmp_path / "kb"),
                    "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 1 and "budget" in out and "(here: --memory-mb)" in out, out
