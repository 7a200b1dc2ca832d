"""Decoding over the paged KV cache: greedy tokens identical to transformers' generate (GPT-2
and a grouped-query Llama, batched prompts of different lengths), seeded sampling that
repeats, streaming, a pool that runs out (requests wait or are recomputed, never an OOM),
the pool the memory proof counts, and clear refusals."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphmode
from graphmode.capture.families import _DECODER, _hf
from graphmode.capture.spec import bundle_from_module
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.hostmem import MIN_SPILL_BYTES
from graphmode.recipe.facts import kv_cache_bytes


def _lm(kind: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "gpt2":
            return _hf("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                       n_positions=64, bos_token_id=1, eos_token_id=2, initializer_range=0.3), 4
        return _hf("LlamaForCausalLM", "LlamaConfig", **_DECODER, tie_word_embeddings=False,
                   initializer_range=0.3), 2


def recipe(kv_heads: int, **kv) -> dict:
    return {"version": 1, "name": "decoder", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
            "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                       {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"],
                        "role": "attention_mask"}],
            "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 16, 32], "min": 2}},
            "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 12, "layers": 2, "kv_heads": kv_heads,
                                    "head_dim": 8, **kv}}}


def _compile(kind: str, cache, **kv):
    lm, kvh = _lm(kind)
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lm, graphmode.compile(b, recipe(kvh, **kv), cache_dir=cache)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("decode-cache")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request, cache):
    return _compile(request.param, cache)


PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 21, 22]])
MASK = (PROMPTS != 0).long()


def test_greedy_is_token_identical_to_transformers(model):
    lm, cm = model
    ours = cm.generate(PROMPTS, MASK, max_new_tokens=12)
    ref = lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())
    alone = [cm.generate(PROMPTS[i:i + 1], MASK[i:i + 1], max_new_tokens=12)[0] for i in range(3)]
    assert all(torch.equal(ours[i], alone[i]) for i in range(3))


def test_sampling_with_a_seed_repeats_and_streaming_matches(model):
    _, cm = model
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    a = cm.generate(PROMPTS, MASK, seed=7, **kw)
    assert torch.equal(a, cm.generate(PROMPTS, MASK, seed=7, **kw))
    assert not torch.equal(a, cm.generate(PROMPTS, MASK, seed=8, **kw))
    # top_k=0 filters nothing, as in transformers' generate (it was refused as invalid)
    assert torch.equal(cm.generate(PROMPTS, MASK, seed=7, **{**kw, "top_k": 0}),
                       cm.generate(PROMPTS, MASK, seed=7, **{**kw, "top_k": None}))
    greedy = cm.generate(PROMPTS, MASK, max_new_tokens=6)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    steps = 0
    for step in cm.stream(PROMPTS, MASK, max_new_tokens=6):
        steps += 1
        for i, toks in step.items():
            got[i] += toks
    assert steps >= 5 and all(got[i] == greedy[i, 6:6 + len(got[i])].tolist() for i in range(3))


@pytest.mark.slow     # ~6 s; preemption itself is test_pool_that_runs_out_makes_requests_wait_not_fail
def test_a_preempted_sequence_longer_than_every_seq_bucket_is_recomputed_in_chunks(cache):
    """Two sequences growing to 30 tokens in a pool of 8 pages (32 tokens), seq buckets up to 16:
    the one preempted comes back with 17 tokens, more than any prefill plan holds. Its recompute
    failed the whole step ('seq 17 is above the largest bucket 16': a 500 for every request in
    flight, a tensor-parallel server down); it now prefills in chunks of 16."""
    lm, kvh = _lm("llama")
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    rec = recipe(kvh, pages=8)
    rec["dims"]["seq"]["buckets"] = [8, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex}), rec, cache_dir=cache)
    prompts = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(5))
    ours = cm.generate(prompts, torch.ones_like(prompts), max_new_tokens=26, eos_token_id=None)
    eng = cm._decoder
    assert eng.stats["preemptions"] >= 1 and eng.cache.free_pages == eng.layout.pages, eng.stats
    ref = lm.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=26, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())


def test_pool_that_runs_out_makes_requests_wait_not_fail(cache):
    """A pool of 9 pages (36 tokens: the longest admissible prompt, 32, and one new token) for
    three sequences of up to 24 tokens each: they cannot all run at once; the scheduler queues
    or recomputes, every answer equals running alone."""
    lm, cm = _compile("gpt2", cache, pages=9)
    eng = cm._decoder if getattr(cm, "_decoder", None) else None
    ours = cm.generate(PROMPTS, MASK, max_new_tokens=18)
    eng = cm._decoder
    assert eng.cache.bytes == kv_cache_bytes(cm.recipe) == 9 * eng.layout.page_bytes
    alone = [cm.generate(PROMPTS[i:i + 1], MASK[i:i + 1], max_new_tokens=18)[0] for i in range(3)]
    assert all(torch.equal(ours[i], alone[i]) for i in range(3))
    assert eng.stats["preemptions"] >= 1, eng.stats                      # someone gave its pages back
    assert eng.cache.free_pages == eng.layout.pages                       # every page came back
    # a sequence reaches 36 tokens here, not its 12 pages' 48: a chat's default answer fills what the pool holds
    from graphmode.serve.completions import usable_tokens
    assert usable_tokens(eng) == 36 and eng.room(8) == 28
    with pytest.raises(ContractViolation, match="the pool's 9 hold") as e:
        cm.generate(PROMPTS[:1, :8], MASK[:1, :8], max_new_tokens=40)
    assert f"at most {36 - int(MASK[0, :8].sum())} new tokens" in e.value.fix


def test_pool_is_the_size_the_proof_counts(model):
    _, cm = model
    cm.generate(PROMPTS[:1], MASK[:1], max_new_tokens=1)
    eng = cm._decoder
    # 4 sequences (the largest batch) x 12 pages each, K and V, 2 layers
    assert eng.cache.bytes == kv_cache_bytes(cm.recipe) == 4 * 12 * eng.layout.page_bytes


def test_engine_spills_the_weights_its_passes_made_never_the_pools(cache):
    """GPT-2's Conv1D weights are transposed by the passes (324 MB of the real model's): the
    engine spills them, as compile does, once its kernels hold packed copies. The pools (here
    over the 64 KiB spill threshold) are written at every step: they stay the cache's own."""
    lm, cm = _compile("gpt2", cache, pages=160)
    ours = cm.generate(PROMPTS, MASK, max_new_tokens=6)
    ref = lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref)
    eng = cm._decoder
    g, spill = eng._cm.graph, eng._cm.constant_spill
    pools = {k for k in g.constants if g.values[k].role == "state"}
    assert min(g.constants[k].numel() * 4 for k in pools) >= MIN_SPILL_BYTES
    assert spill is not None and not pools & set(spill.names)     # (this tiny model's weights are below it)
    assert {g.constants[k].data_ptr() for k in pools} == {t.data_ptr() for t in (*eng.cache.k, *eng.cache.v)}


@pytest.mark.parametrize("kw,err,needle", [
    ({"max_new_tokens": 100}, ContractViolation, "max_new_tokens"),
    ({"max_new_tokens": 0}, GraphmodeError, "max_new_tokens"),
    ({"do_sample": True, "temperature": 0.0}, GraphmodeError, "temperature"),
    ({"do_sample": True, "top_p": 1.5}, GraphmodeError, "top_p"),
    ({"max_new_tokens": 3, "min_new_tokens": 5}, GraphmodeError, "min_new_tokens"),     # the argument given
    ({"eos_token_id": 999}, GraphmodeError, r"eos_token_id must be in \[0, 100\)"),    # it could never stop
    ({"eos_token_id": [2, -5]}, GraphmodeError, "eos_token_id"),
])
def test_bad_requests_are_refused(model, kw, err, needle):
    _, cm = model
    with pytest.raises(err, match=needle):
        cm.generate(PROMPTS, MASK, **kw)


def test_transformers_repetition_penalty_and_min_new_tokens_decode_as_transformers(model):
    """generate took no repetition_penalty or min_new_tokens (a bare TypeError), though the
    engine runs both for the server; other transformers arguments are refused naming them."""
    lm, cm = model
    eos = lm.generation_config.eos_token_id
    kw = {"max_new_tokens": 10, "repetition_penalty": 1.5, "min_new_tokens": 6}
    ours = cm.generate(PROMPTS, MASK, eos_token_id=eos, **kw)
    ref = lm.generate(PROMPTS, attention_mask=MASK, do_sample=False, pad_token_id=0, eos_token_id=eos, **kw)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())
    with pytest.raises(GraphmodeError, match=r"generate\(\) does not take num_beams") as e:
        cm.generate(PROMPTS, MASK, num_beams=2)
    assert "beam search is not implemented" in e.value.fix
    with pytest.raises(GraphmodeError, match=r"generate\(\) does not take stop_strings") as e:   # trial AC
        cm.generate(PROMPTS, MASK, stop_strings=["x"])
    assert "SamplingParams(stop=" in e.value.fix and "--stop-ids" in e.value.fix
    steps = list(cm.stream(PROMPTS[:1], MASK[:1], max_new_tokens=3, pad_token_id=0))   # documented: taken
    assert sum(len(v) for s in steps for v in s.values()) == 3


def test_greedy_ignores_temperature_as_transformers_does(model):
    """do_sample=False with temperature 0 (or any value) decodes greedily, as transformers' generate does;
    it was refused with a fix that said to use do_sample=False."""
    lm, cm = model
    for t in (0.0, -1.0):
        ours = cm.generate(PROMPTS, MASK, max_new_tokens=4, do_sample=False, temperature=t)
        assert torch.equal(ours, cm.generate(PROMPTS, MASK, max_new_tokens=4))


def test_a_prompt_refused_names_its_row_and_a_fix(model):
    _, cm = model
    with pytest.raises(ContractViolation, match="token ids must be in") as e:
        cm.generate(torch.tensor([[5, 6, 7], [5, 600, 7]]), max_new_tokens=2)
    assert e.value.where == "input_ids row 1" and e.value.value == [600] and "vocabulary" in e.value.fix
    with pytest.raises(ContractViolation, match="empty prompt") as e:
        cm.generate(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[1, 1], [0, 0]]), max_new_tokens=2)
    assert e.value.where == "input_ids row 1" and "unmasked" in e.value.fix


def test_a_prompt_longer_than_the_contract_is_refused(model):
    _, cm = model
    with pytest.raises(ContractViolation, match="dims.seq|prompt"):
        cm.generate(torch.randint(3, 100, (1, 40)), max_new_tokens=2)


def test_a_prompt_shorter_than_the_contract_is_refused(model):
    """dims.seq min is 2: a 1-token prompt is outside the contract (#30: it was accepted)."""
    _, cm = model
    with pytest.raises(ContractViolation, match="needs at least 2") as e:
        cm.generate(torch.tensor([[5]]), max_new_tokens=2)
    assert e.value.where == "dims.seq" and e.value.value == 1
    cm.generate(torch.tensor([[5, 6]]), max_new_tokens=2)


def test_a_contract_whose_longest_prompt_leaves_no_position_is_refused(cache):
    """The tiny GPT-2 has 64 positions: prompts of up to 64 tokens (pages for 68) leave no room
    for a new token, so the decode engine refuses the recipe before it builds anything."""
    lm, kvh = _lm("gpt2")
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    r = recipe(kvh, max_pages_per_seq=17)
    r["dims"]["seq"] = {"buckets": [8, 64], "min": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(b, r, cache_dir=cache)
    with pytest.raises(RecipeError, match="64 positions: no room for a new token") as e:
        cm.generate(PROMPTS, MASK, max_new_tokens=2)
    assert e.value.where == "dims.seq.max" and e.value.fix == "seq at most 63"


def _logits_by_prompt(eng, prompts, params, *, join_later=()):
    """Run `prompts` through the engine together (those in `join_later` added after two steps);
    {prompt: (tokens, [logits per step])}."""
    from graphmode.decode.sampling import SamplingParams  # noqa: F401 - params is one
    logs: dict[int, list[torch.Tensor]] = {}
    eng.on_logits = lambda s, row: logs.setdefault(s.id, []).append(row.clone())
    try:
        seqs = {tuple(p): eng.add(p, params) for p in prompts if tuple(p) not in join_later}
        steps = 0
        while not all(s.done for s in seqs.values()) or len(seqs) < len(prompts):
            eng.step()
            steps += 1
            if steps == 2:
                seqs.update({tuple(p): eng.add(p, params) for p in prompts if tuple(p) in join_later})
    finally:
        eng.on_logits = None
    return {p: (s.generated, logs[s.id]) for p, s in seqs.items()}


def test_batch_invariant_logits_are_bit_identical_alone_and_batched(cache):
    """determinism: batch_invariant: a sequence's logits at every step are the same bits alone,
    batched with others of other lengths, and joined mid-way; requests that do not fit the
    pool wait (their pages are held from admission), they are never preempted. Decode steps
    really are batched: the plan runs with more than one sequence in a step."""
    from graphmode.decode.api import engine_of
    from graphmode.decode.sampling import SamplingParams
    lm, kvh = _lm("gpt2")
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    r = dict(recipe(kvh, pages=10), determinism="batch_invariant")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(b, r, cache_dir=cache)
    eng = engine_of(cm)
    decode_rows: list[int] = []
    run = eng.runner._run

    def counted(env, inputs):
        if env["seq"] == 1:
            decode_rows.append(int((inputs["lens"] > 0).sum()))
        return run(env, inputs)
    eng.runner._run = counted
    params = SamplingParams(max_new_tokens=10)
    p1, p2, p3 = [5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [21, 22]
    alone = {tuple(p): _logits_by_prompt(eng, [p], params)[tuple(p)] for p in (p1, p2, p3)}
    together = _logits_by_prompt(eng, [p2, p1, p3], params)
    joined = _logits_by_prompt(eng, [p2, p1, p3], params, join_later={tuple(p1), tuple(p3)})
    for p in (p1, p2, p3):
        toks, logits = alone[tuple(p)]
        for run in (together, joined):
            got_toks, got_logits = run[tuple(p)]
            assert got_toks == toks and len(got_logits) == len(logits)
            assert all(torch.equal(a, g) for a, g in zip(logits, got_logits)), p      # bit for bit
    assert eng.stats["preemptions"] == 0 and eng.cache.free_pages == eng.layout.pages
    assert max(decode_rows) >= 2 and eng.runner.variant_buckets == {}
    # greedy tokens are still transformers' tokens
    ref = lm.generate(torch.tensor([p1]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert alone[tuple(p1)][0] == ref[:len(alone[tuple(p1)][0])]


def test_batch_invariant_needs_a_kv_cache():
    from graphmode.recipe import load_recipe
    from graphmode.recipe.semantics import check_semantics
    r = dict(recipe(2), determinism="batch_invariant")
    del r["memory"]
    res = check_semantics(load_recipe(r))
    assert any(e.where == "determinism" and "memory.kv_cache" in e.fix for e in res.errors)


def test_decode_probe_times_the_engine_step_and_gives_its_pages_back(model):
    """What `graphmode profile --decode` runs: the engine's decode plan at a batch bucket and a
    context, its steps timed one by one (paged attention as a native kernel), the pages it
    held returned; a batch that is no bucket, or a context the pages cannot hold, is refused."""
    from graphmode.bench.profile import profile_executable
    from graphmode.decode.api import engine_of
    from graphmode.targets import get_target
    _, cm = model
    eng = engine_of(cm)
    free = eng.cache.free_pages
    with eng.decode_probe(2, 9) as (exe, inputs):
        assert eng.cache.free_pages == free - 2 * 3          # 10 tokens in pages of 4, per sequence
        prof = profile_executable(exe, inputs, get_target("host"), runs=3, model="tiny-decode")
    assert eng.cache.free_pages == free
    names = [s.name for s in prof.steps]
    assert names.count("native:paged_attention") == 2 and prof.bucket == {"batch": 2, "seq": 1}
    assert prof.run_s > 0 and all(s.time_s >= 0 for s in prof.steps)
    with pytest.raises(ContractViolation, match="batch bucket"):
        with eng.decode_probe(3, 9):
            pass
    with pytest.raises(ContractViolation, match="context"):
        with eng.decode_probe(1, 48):
            pass
    assert eng.cache.free_pages == free


@pytest.mark.parametrize("kv", ["bf16", pytest.param("f16", marks=pytest.mark.slow)])   # f16: the kernel tests cover it
def test_half_kv_caches_decode_with_the_native_kernel(cache, kv):
    """memory.kv_cache.dtype bf16 / f16: half the pool bytes (proved = allocated), the paged
    attention runs as the native kernel (not the reference loop: f16 ran there, 2.7x slower,
    until 2026-12-07), and greedy decoding agrees with transformers' f32 generate on each row's
    first token and most of the rest."""
    from graphmode.decode.api import engine_of
    lm, cm = _compile("gpt2", cache, dtype=kv)
    eng = engine_of(cm)
    want_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[kv]
    assert eng.cache.k[0].dtype == want_dtype and eng.cache.bytes == kv_cache_bytes(cm.recipe)
    with eng.decode_probe(1, 6) as (exe, _):
        assert exe.step_names.count("native:paged_attention") == 2
    got = cm.generate(PROMPTS, MASK, max_new_tokens=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=8, do_sample=False, pad_token_id=0)
    new_got, new_want = got[:, PROMPTS.shape[1]:], want[:, PROMPTS.shape[1]:]
    assert torch.equal(new_got[:, 0], new_want[:, 0])
    assert (new_got == new_want).double().mean() >= 0.75


def test_an_f16_kv_cache_that_overflows_is_refused_not_decoded_as_token_0(cache):
    """The same model with its values scaled up 1e6 (and its output projection down: the same
    function) stores values past f16's 65504 in an f16 pool: the logits went NaN and greedy
    answered token 0 at every step, exit 0 (trial T). Now the step is refused, naming the dtype
    and the fix; a bf16 pool (f32's range) decodes it as transformers does."""
    from graphmode.errors import ContractViolation
    lm, kvh = _lm("gpt2")
    with torch.no_grad():
        for block in lm.transformer.h:
            block.attn.c_attn.weight[:, 64:].mul_(1e6)       # GPT-2's V columns of c_attn (n_embd 32)
            block.attn.c_attn.bias[64:].mul_(1e6)
            block.attn.c_proj.weight.div_(1e6)
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = lm.generate(PROMPTS[1:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        half = graphmode.compile(b, recipe(kvh, dtype="f16"), cache_dir=cache)
        with pytest.raises(ContractViolation, match="f16 KV cache overflows") as e:
            half.generate(PROMPTS[1:2], max_new_tokens=4)
        assert e.value.where == "memory.kv_cache.dtype" and "bf16" in e.value.fix
        wide = graphmode.compile(b, recipe(kvh, dtype="bf16"), cache_dir=cache)
        assert torch.equal(wide.generate(PROMPTS[1:2], max_new_tokens=4)[:, 6], want[:, 6])


def test_verify_checks_the_decode_steps_at_the_kv_dtype_and_proposes_a_wider_one(tmp_path, cache):
    """`graphmode verify` of a decoder recipe checked its whole-sequence graph only: an f16 pool that
    overflows passed, and a narrow pool's drift was never measured (trial T). Its decode steps are
    now checked against eager, teacher-forced, at the recipe's KV dtype."""
    import json
    from pathlib import Path

    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    spec = str(Path(__file__).with_name("tiny_decoders.py"))

    def verify(model: str, dtype: str) -> tuple[int, dict]:
        path = tmp_path / f"{model}-{dtype}.yaml"
        path.write_text(yaml.safe_dump(recipe(4, dtype=dtype)))
        res = CliRunner().invoke(app, ["verify", "--model", f"{spec}:{model}", "--recipe", str(path), "--json", "--fix",
                                       "--max-buckets", "1", "--cache-dir", str(cache)])
        return res.exit_code, json.loads(res.stdout[res.stdout.index("{"):])
    code, d = verify("gpt2_f16_overflow", "f16")
    assert code == 1 and d["failure"]["stage"] == "decode", d        # the whole-sequence graph (f32) matches
    assert all(c["ok"] for c in d["cases"][:-1]) and d["failure"]["fix"] == {"memory": {"kv_cache": {"dtype": "bf16"}}}
    assert d["cases"][-1]["path"] == "decode" and d["cases"][-1]["bucket"] == {"kv": "f16"}


def test_the_decode_check_compares_every_step_with_eager_teacher_forced(model):
    from graphmode.decode.check import check_decode
    _, cm = model
    d = check_decode(cm, cm.recipe)
    assert d.ok and d.kv_dtype == "f32" and d.rel_l2 < 1e-5 == d.tolerance and d.top1 is None
    assert len(d.prompts) == 2 and d.steps == 2 * 8          # two prompts, every new token's logits


def test_the_engine_is_lowered_by_the_pipeline_driver(model):
    """The decode graph comes from compiler.lower_model: to_paged ran first, the verdict and
    the proof (the KV pool counted once, as the cache, not as weights) are kept."""
    from graphmode.decode.api import engine_of
    _, cm = model
    low = engine_of(cm).lowered
    assert low.verdict.ok and low.proof.ok and low.proof.model.facts_source == "compiler"
    assert [p.name for p in low.optimize_report.passes.passes][0] == "to_paged"
    ops = {n.op for n in low.graph.nodes}
    assert "paged_attention" in ops and "sdpa" not in ops
    g = low.graph
    nbytes = {k: t.numel() * t.element_size() for k, t in g.constants.items()}
    state = {k for k in g.constants if g.values[k].role == "state"}
    terms = low.proof.model.memory_terms
    assert sum(nbytes[k] for k in state) == terms["kv_cache"] == kv_cache_bytes(cm.recipe)
    assert terms["weights"] == sum(n for k, n in nbytes.items() if k not in state)


def test_a_model_without_a_kv_cache_does_not_decode(tmp_path):
    """generate / stream belong to models compiled under a decoder recipe (graphmode.compile
    attaches the decode API to those): any other is refused naming memory.kv_cache."""
    from graphmode.errors import RecipeError
    lm, kvh = _lm("gpt2")
    r = dict(recipe(kvh), exe_mode="eager")
    del r["memory"]
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex}), r, cache_dir=tmp_path)
    assert cm.decoding is None
    for call in (cm.generate, cm.stream):
        with pytest.raises(RecipeError, match="paged KV cache") as e:
            call(PROMPTS, MASK)
        assert e.value.where == "memory.kv_cache"


def test_an_explicit_eos_token_id_none_stops_at_no_token(model):
    """transformers' generate(eos_token_id=None) stops at no token; graphmode took None for
    "the model's", so a token-for-token comparison set up so stopped early (finish "eos")."""
    from types import SimpleNamespace

    from graphmode.decode.api import sampling_params
    lm, cm = model
    eng = SimpleNamespace(cfg={"eos": 5})
    assert sampling_params(eng, 4, False, 1.0, None, None, None, None).eos == frozenset()
    assert sampling_params(eng, 4, False, 1.0, None, None, [], None).eos == frozenset()
    ref = lm.generate(PROMPTS, attention_mask=MASK, do_sample=False, max_new_tokens=6, pad_token_id=0)
    first = int(ref[1, PROMPTS.shape[1]])          # row 1's first greedy token, taken as end-of-sequence
    stopped = cm.generate(PROMPTS[1:2], MASK[1:2], max_new_tokens=6, eos_token_id=first)
    assert stopped.shape[1] == PROMPTS.shape[1] + 1
    for eos in (None, []):
        ours = cm.generate(PROMPTS, MASK, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
        theirs = lm.generate(PROMPTS, attention_mask=MASK, do_sample=False, max_new_tokens=6, pad_token_id=0,
                             eos_token_id=eos)
        assert torch.equal(ours, theirs) and ours.shape[1] == PROMPTS.shape[1] + 6, (eos, ours.tolist())


def test_end_and_pad_tokens_come_from_the_generation_config_first():
    """transformers' generate pads finished rows with generation_config.pad_token_id (set there
    only, the model config has none); the engine read the model config and padded with EOS."""
    from graphmode.decode.lm import lm_config
    lm, _ = _lm("gpt2")
    lm.generation_config.pad_token_id, lm.generation_config.eos_token_id = 7, 3
    cfg = lm_config(lm)
    assert lm.config.pad_token_id is None and (cfg["pad"], cfg["eos"]) == (7, 3)


def test_a_one_token_prompt_prefills_on_the_decode_steps_plan(cache):
    """A recipe whose seq starts at 1 (the shipped decoder recipes: a BOS alone starts an
    unconditional sample) prefills a one-token prompt on the decode step's plan: tokens equal
    transformers', beside longer prompts in the same step."""
    lm, kvh = _lm("llama")
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    r = recipe(kvh)
    r["dims"]["seq"] = {"buckets": [1, 8, 16, 32], "min": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex}), r, cache_dir=cache)
    for prompt in (torch.tensor([[1]]), torch.tensor([[0, 0, 5], [0, 0, 1]])):
        mask = (prompt != 0).long()
        ref = lm.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(cm.generate(prompt, mask, max_new_tokens=6), ref)
