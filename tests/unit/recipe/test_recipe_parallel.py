"""The recipe's `parallel` section: schema, semantics (device group, links, splits), the per-device
memory proof and the SLA proof with communication, refusing with (shape, collective, bytes, link);
and `graphmode recipe show` printing per-device memory and per-step communication."""
import json

import pytest
from typer.testing import CliRunner

import graphmode.cli.recipe_cmd  # noqa: F401  (registers the `recipe` sub-command)
from graphmode.cli.app import app
from graphmode.errors import RecipeErrors
from graphmode.recipe import load_recipe, validate
from graphmode.targets import get_target

LOOPBACK = {"bandwidth_gbps": "${target.groups.interconnects.loopback.bandwidth_gbps}",
            "latency_us": "${target.groups.interconnects.loopback.latency_us}"}


def gpt2_recipe(**parallel) -> dict:
    par = {"tensor": 2, "device_group": ["rank0", "rank1"], "links": {"loopback": LOOPBACK}}
    par.update(parallel)
    return {"version": 1, "name": "gpt2-tp", "targets": ["cpu_avx2"],
            "model": {"kind": "decoder", "layers": 12, "hidden": 768, "heads": 12, "intermediate": 3072,
                      "vocab": 50256, "params_m": 124},
            "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
            "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [16, 64, 128], "min": 1}},
            "sla": {"p50_ms": 400}, "parallel": par}


def test_parallel_section_loads_and_leaves_other_stamps_alone():
    r = load_recipe(gpt2_recipe(strategy={"attention": "head", "embedding": "replicate"}))
    assert r.parallel.tensor == 2 and r.parallel.ranks() == ["rank0", "rank1"]
    assert r.parallel.strategy == {"attention": "head", "mlp": "head", "embedding": "replicate", "conv": "head"}
    assert r.parallel.backend == "gloo" and r.parallel.comm.dtype == "f32"
    plain = gpt2_recipe()
    del plain["parallel"]
    assert "parallel" not in json.loads(__import__("graphmode.recipe.hashing", fromlist=["x"]).canonical_json(
        load_recipe(plain)))


@pytest.mark.parametrize("bad, where", [
    ({"strategy": {"conv": "batch", "mlp": "head"}}, "parallel.strategy"),
    ({"strategy": "by_row"}, "parallel.strategy"),
    ({"strategy": {"lstm": "head"}}, "parallel.strategy"),
    ({"tensor": 0}, "parallel.tensor"),
    ({"device_group": ["a", "a"]}, "parallel.device_group"),
    ({"links": {"pcie": {"bandwidth_gbps": 0}}}, "parallel.links.pcie.bandwidth_gbps"),
    ({"comm": {"dtype": "fp8"}}, "parallel.comm.dtype"),
    ({"backend": "mpi"}, "parallel.backend"),
])
def test_malformed_parallel_fields_name_the_field(bad, where):
    with pytest.raises(RecipeErrors) as e:
        load_recipe(gpt2_recipe(**bad))
    assert any(x.where.startswith(where) for x in e.value.errors), e.value.render()


def test_links_resolve_from_the_target():
    rep = validate(load_recipe(gpt2_recipe()), get_target("cpu_avx2"))
    link = rep.recipe.parallel.links["loopback"]
    assert (link.bandwidth_gbps, link.latency_us) == (2, 50)          # cpu_avx2.yaml interconnects.loopback
    rep = validate(load_recipe(gpt2_recipe(links={"nv": {
        "bandwidth_gbps": "${target.groups.interconnects.nvlink.bandwidth_gbps}"}})), get_target("cpu_avx2"))
    assert rep.verdict == "malformed" and "nvlink" in rep.errors[0].message


def test_a_group_with_fewer_ranks_than_tensor_is_refused():
    rep = validate(load_recipe(gpt2_recipe(device_group=["rank0"])), get_target("cpu_avx2"))
    assert rep.verdict == "malformed"
    e = rep.errors[0]
    assert e.where == "parallel.device_group" and "1 device(s) for tensor 2" in e.message and "at least 2" in e.fix


def test_a_short_group_without_links_names_both_at_once():
    """It said only "missing links"; the group's size came after fixing that."""
    r = gpt2_recipe(tensor=4)
    del r["parallel"]["links"]
    rep = validate(load_recipe(r), get_target("cpu_avx2"))
    by = {e.where: e for e in rep.errors}
    assert set(by) == {"parallel.device_group", "parallel.links"}, [e.render() for e in rep.errors]
    assert "loopback" in by["parallel.links"].fix


@pytest.mark.parametrize("tensor", [0, 65, "two"])
def test_a_tensor_degree_out_of_range_says_the_range_and_a_fix(tensor):
    with pytest.raises(RecipeErrors) as e:
        load_recipe(gpt2_recipe(tensor=tensor))
    err = e.value.errors[0]
    assert err.where == "parallel.tensor" and "Input should" not in err.message and "tensor: 2" in err.fix


@pytest.mark.parametrize("over, where, words", [
    ({"links": {"a": {"bandwidth_gbps": 5, "devices": ["rank0", "x"]}}}, "parallel.links.a.devices",
     "x not in parallel.device_group"),
    ({"links": {"a": {"bandwidth_gbps": 5, "devices": ["rank0"]}}}, "parallel.links", "no link joins"),
    ({"tensor": 5, "device_group": ["a", "b", "c", "d", "e"]}, "parallel.tensor", "model.heads = 12"),
    ({"backend": "nccl"}, "parallel.backend", "nccl runs on GPUs"),
])
def test_semantic_problems_of_the_group(over, where, words):
    rep = validate(load_recipe(gpt2_recipe(**over)), get_target("cpu_avx2"))
    assert rep.verdict == "malformed", rep.to_dict()
    assert any(e.where == where and words in e.message for e in rep.errors), [e.render() for e in rep.errors]


def test_batch_strategy_needs_buckets_that_split_evenly():
    r = gpt2_recipe(strategy="batch")
    rep = validate(load_recipe(r), get_target("cpu_avx2"))
    assert rep.verdict == "malformed"
    e = rep.errors[0]
    assert e.where == "dims.batch" and "batch=1 does not split over 2 ranks" in e.message and "step: 2" in e.fix
    r["dims"]["batch"] = {"buckets": [2, 4]}
    assert validate(load_recipe(r), get_target("cpu_avx2")).verdict == "valid"


def test_an_odd_vocabulary_is_accepted_and_its_padded_shard_counted():
    """GPT-2's real 50257 over 2 ranks: not refused (the shard pass pads it); a rank is counted
    with 25129 rows of the table (the last rank's last one padding) and half the attention and
    MLP weights; the LM head's all_gather moves the padded logits."""
    import sympy

    from graphmode.recipe.parallel_cost import estimate_collectives
    r = gpt2_recipe()
    r["model"]["vocab"] = 50257
    one = {**r}
    del one["parallel"]
    tp1, tp2 = (validate(load_recipe(x), get_target("cpu_avx2")) for x in (one, r))
    assert tp2.verdict == "valid"
    h, cb = 768, 4
    saved = (50257 - 25129) * h * cb + (4 * h * h + 2 * h * 3072) * 12 * cb // 2
    assert tp1.model.memory_terms["weights"] - tp2.model.memory_terms["weights"] == saved
    sym = {d: sympy.Symbol(d) for d in ("batch", "seq")}
    (gather,) = [c for c in estimate_collectives(load_recipe(r), sym) if c.op == "all_gather"]
    assert gather.row == 50258 and gather.elems == 50258 * sym["batch"] * sym["seq"]


def test_memory_is_proved_per_device():
    one = gpt2_recipe()
    del one["parallel"]
    whole = validate(load_recipe(one), get_target("cpu_avx2"))
    split = validate(load_recipe(gpt2_recipe()), get_target("cpu_avx2"))
    assert whole.verdict == split.verdict == "valid"
    w1, w2 = whole.model.memory_terms["weights"], split.model.memory_terms["weights"]
    assert w2 < w1 * 0.75                         # attention + MLP weights halved, the vocab kept whole
    mem = next(p for p in split.proofs if p.name == "memory")
    assert "per device (2 ranks)" in mem.message
    budget = whole.proofs[2].detail["worst_bytes"] / 2**20 * 0.8      # TP=1 does not fit it, TP=2 does
    one["memory"] = {"budget_mb": round(budget)}
    assert validate(load_recipe(one), get_target("cpu_avx2")).verdict == "refused"
    r = gpt2_recipe()
    r["memory"] = {"budget_mb": round(budget)}
    assert validate(load_recipe(r), get_target("cpu_avx2")).verdict == "valid"


def test_a_slow_link_is_refused_with_the_collective_bytes_and_link():
    r = gpt2_recipe(links={"pcie_switch": {"bandwidth_gbps": 0.5, "latency_us": 50}})
    r["sla"] = {"p50_ms": 200}
    rep = validate(load_recipe(r), get_target("cpu_avx2"))
    assert rep.verdict == "refused"
    p = next(p for p in rep.proofs if p.status == "refuted")
    assert p.counterexample and set(p.counterexample) == {"batch", "seq"}
    assert p.detail["link"] == "pcie_switch" and p.detail["collective"] == "all_gather"   # the LM head's logits
    assert p.detail["collective_bytes"] > 0 and p.detail["comm_ms"] > 0
    assert "over link pcie_switch (0.5 GB/s, 50 us)" in p.message and "communication" in p.message
    with pytest.raises(Exception) as e:
        rep.raise_for_errors()
    assert "pcie_switch" in e.value.fix
    r["parallel"]["links"] = {"nvlink_like": {"bandwidth_gbps": 100, "latency_us": 2}}   # the same plan fits
    assert validate(load_recipe(r), get_target("cpu_avx2")).verdict == "valid"


def test_comm_dtype_shrinks_the_bytes():
    f32 = validate(load_recipe(gpt2_recipe()), get_target("cpu_avx2")).model
    bf16 = validate(load_recipe(gpt2_recipe(comm={"dtype": "bf16"})), get_target("cpu_avx2")).model
    at = {"batch": 4, "seq": 128}
    from graphmode.recipe.smt import evaluate
    assert evaluate(bf16.comm[0].nbytes, at) * 2 == evaluate(f32.comm[0].nbytes, at)


def test_recipe_show_prints_per_device_memory_and_per_step_communication(tmp_path):
    import yaml
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(gpt2_recipe()))
    res = CliRunner().invoke(app, ["recipe", "show", str(path)])
    assert res.exit_code == 0, res.output
    assert "memory per device" in res.output and "batch=4, seq=128" in res.output
    assert "communication per step" in res.output and "all_reduce" in res.output and "loopback" in res.output
    res = CliRunner().invoke(app, ["recipe", "show", str(path), "--json"])
    par = json.loads(res.output)["parallel"]
    assert par["tensor"] == 2 and par["link"]["name"] == "loopback" and par["comm_bytes_per_step"] > 0
    assert par["comm"][0]["count"] == 12 and par["memory_mb"]["weights"] > 0
