"""Drafting a recipe for a model without one (`recipe init`, `graphmode.compile(model)`): the
signature and config, buckets under the padding bound, the verdict choosing masks and exact
buckets, the knowledge base's nearest entries, proofs, and the comments on every value."""
from __future__ import annotations

import warnings

import pytest
import torch
from kb_helpers import spec

from graphmode.errors import CaptureError, ConstraintError
from graphmode.kb import KnowledgeBase
from graphmode.kb.draft import RecipeDrafted, draft_recipe, drafted
from graphmode.kb.draft_padding import MAX_EXACT
from graphmode.recipe import load_recipe, recipe_hash
from graphmode.recipe.buckets import dim_buckets


def test_signature_config_mask_buckets_and_comments(tmp_path):
    kb = tmp_path / "kb.sqlite"
    d = draft_recipe(spec("encoder_small"), max_padding=0.5, kb_path=kb)
    mask = d.data["inputs"][1]
    assert mask == {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0,
                    "role": "attention_mask"}
    assert d.data["dims"]["seq"] == {"min": 1, "max": 24, "max_padding": 0.5}          # config.max_position_embeddings
    assert "config.max_position_embeddings" in d.notes["dims.seq"]
    assert d.data["dims"]["batch"]["max"] == 32 and "default range" in d.notes["dims.batch"]
    assert d.data["outputs"] == {"output": ["batch", 16]}
    assert d.verdict.ok and d.verdict.lines() == ["padding batch: safe", "padding seq: safe"]
    assert d.report.verdict == "valid" and d.data["memory"]["budget_mb"] >= 1
    assert "headroom" in d.notes["memory.budget_mb"]
    text = d.yaml()
    back = load_recipe(text)
    assert recipe_hash(back) == recipe_hash(d.recipe) and back == d.recipe          # the text is the recipe
    comments = [line.split("  # ", 1)[1] for line in text.splitlines() if "  # " in line]
    for note in ("config.max_position_embeddings", "named like a mask", "headroom", "no knowledge-base entry"):
        assert any(note in c for c in comments), note
    with KnowledgeBase(kb) as db:
        (row,) = db.rows("SELECT * FROM recipes")
        assert row["origin"] == "init" and row["hash"] == recipe_hash(d.recipe)
        assert db.rows("SELECT family FROM models")[0]["family"] == "tinyenc"


def test_a_dim_unsafe_to_pad_gets_exact_buckets():
    d = draft_recipe(spec("mean_pool"))                 # no mask, a mean over seq: padding seq changes the answer
    assert d.data["dims"]["seq"] == {"min": 2, "max": 12}
    assert dim_buckets(d.recipe)["seq"] == list(range(2, 13))
    assert "unsafe" in d.notes["dims.seq"] and "mean" in d.notes["dims.seq"]
    assert d.data["dims"]["batch"]["max_padding"] == 0.25 and d.data["on_violation"] == "error"
    assert d.verdict.ok and d.verdict.padding.dims["seq"].status == "not padded" and not d.verdict.exact_dims


def test_too_many_values_for_exact_buckets_run_off_bucket_requests_eagerly():
    d = draft_recipe(spec("mean_pool_long"))
    assert 128 - 2 + 1 > MAX_EXACT
    assert d.data["on_violation"] == "eager" and "too many values" in d.notes["on_violation"]
    assert d.verdict.ok and d.verdict.exact_dims == ["seq"]


def test_precision_fusion_and_kernels_from_the_nearest_measured_recipe(tmp_path):
    from graphmode.compiler import capture
    from graphmode.kb.record import Subject, perf, record
    from graphmode.targets import get_target
    kb = tmp_path / "kb.sqlite"
    near = draft_recipe(spec("encoder_small"), max_padding=0.5).data
    near.update(name="small-tuned", codegen={"kernel_selection": "heuristic"},
                optimize={"preset": "default", "fusion": {"enabled": True, "max_ops": 8}},
                precision={"compute": "f32", "overrides": {"softmax": "f32"}})
    rec = load_recipe(near)
    g, _, src = capture(spec("encoder_small"), rec)
    assert record(kb, Subject(rec, get_target("host"), src, g, None), [perf("tune", p50_ms=1.0, p99_ms=2.0)]) is None
    d = draft_recipe(spec("encoder_large"), max_padding=0.5, kb_path=kb)      # same family, wider
    assert d.data["optimize"]["fusion"]["max_ops"] == 8 and d.data["codegen"] == {"kernel_selection": "heuristic"}
    assert d.data["precision"]["overrides"] == {"softmax": "f32"}
    for k in ("optimize", "precision", "codegen"):
        assert f"knowledge base recipe {recipe_hash(rec)} (small-tuned)" in d.notes[k]
    assert d.recommendations[0].recipe["name"] == "small-tuned"
    assert d.report.verdict == "valid"


def test_a_draft_never_takes_a_precision_that_changes_the_answer_from_the_knowledge_base(tmp_path):
    """An int4 Llama recorded in the knowledge base made `recipe init` draft int4 weights for a
    Mistral, whose greedy tokens then differed from transformers'. Fusion and kernels still come."""
    from graphmode.compiler import capture
    from graphmode.kb.record import Subject, perf, record
    from graphmode.targets import get_target
    kb = tmp_path / "kb.sqlite"
    near = draft_recipe(spec("encoder_small"), max_padding=0.5).data
    near.update(name="small-bf16", codegen={"kernel_selection": "heuristic"}, precision={"compute": "bf16"})
    rec = load_recipe(near)
    g, _, src = capture(spec("encoder_small"), rec)
    assert record(kb, Subject(rec, get_target("host"), src, g, None), [perf("tune", p50_ms=1.0, p99_ms=2.0)]) is None
    d = draft_recipe(spec("encoder_large"), max_padding=0.5, kb_path=kb)
    assert d.data["precision"] == {"compute": "f32"} and d.data["codegen"] == {"kernel_selection": "heuristic"}
    assert "compute bf16, which changes the answer" in d.notes["precision"]


def test_an_sla_the_cost_model_refutes_is_refused():
    with pytest.raises(ConstraintError) as e:
        draft_recipe(spec("mlp"), p99_ms=1e-6)
    assert e.value.exit_code == 1 and "sla" in e.value.where


def test_compile_without_a_recipe_drafts_one_and_says_so_once(kb_cache, monkeypatch):
    import graphmode
    import graphmode.kb.draft as draft_module
    from kb_models import MLP
    monkeypatch.setattr(draft_module, "_ANNOUNCED", set())   # another test in this process may have drafted it
    torch.manual_seed(1)
    m, x = MLP().eval(), torch.randn(4, 16)
    with pytest.warns(RecipeDrafted, match="no recipe given") as got:
        cm = graphmode.compile((m, (x,)), cache_dir=kb_cache)
    assert len([w for w in got if w.category is RecipeDrafted]) == 1
    assert cm.recipe.name == "mlp-draft" and "batch" in cm.recipe.dims
    y = torch.randn(3, 16)
    out = cm(y)                                                          # a Tensor, as eager returns
    assert isinstance(out, torch.Tensor) and torch.allclose(out, m(y), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeDrafted)
        assert drafted((m, (x,)), None)[1] == cm.recipe                   # the same draft again: said once
    with pytest.raises(CaptureError, match="no example inputs") as e:
        graphmode.compile(m)
    assert "(module, example_inputs" in e.value.fix and "example_inputs=(" in e.value.fix


class _FixedWidth(torch.nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], 4, 25).sum(-1)        # axis 1 must be 100: export cannot keep it dynamic


def test_a_dim_asked_dynamic_but_fixed_is_said_in_the_warning(kb_cache, monkeypatch):
    import graphmode
    import graphmode.kb.draft as draft_module
    monkeypatch.setattr(draft_module, "_ANNOUNCED", set())
    x = torch.randn(2, 100)
    with pytest.warns(RecipeDrafted, match="n fixed at the example's size"):
        cm = graphmode.compile((_FixedWidth(), {"x": x}, {"x": ["batch", "n"]}), cache_dir=kb_cache)
    assert "n" not in cm.recipe.dims and "batch" in cm.recipe.dims


def _tiny_llama(positions: int):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_causal_lm_draft_leaves_a_position_for_the_new_token():
    """The decode engine refuses a contract whose longest prompt fills every position; the
    draft's seq stops one short and its pages hold that prompt plus one token."""
    torch.manual_seed(0)
    d = draft_recipe(_tiny_llama(64))
    kv = d.recipe.memory.kv_cache
    assert d.recipe.dim_range("seq") == (1, 63) and kv is not None
    assert kv.max_pages_per_seq * kv.page_size >= 64 and d.report.verdict == "valid"
    # the note says what the pages hold (it said "up to 65 tokens" of pages holding 80)
    assert f"up to {kv.max_pages_per_seq * kv.page_size} tokens" in d.notes["memory.kv_cache"]


@pytest.mark.slow     # ~10 s: a T5 capture
def test_a_decoder_sequence_with_relative_positions_gets_the_default_sequence_range():
    """T5 has no position table: its decoder_seq was capped at graphmode's example size (8), and
    decoder_input_ids of 9 tokens were refused while eager runs them."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0)).eval()
        d = draft_recipe(m)
    assert d.recipe.dim_range("decoder_seq") == d.recipe.dim_range("seq") == (1, 512)


def test_a_roberta_draft_fits_its_offset_positions_and_pads_ids_with_its_pad_token():
    """RoBERTa counts positions from padding_idx + 1 over the ids that are not its pad token
    (1): a draft of seq up to max_position_embeddings with ids padded by 0 ran padded positions
    past the table (a raw IndexError at seq 40 of 66)."""
    from transformers import RobertaConfig, RobertaModel
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = RobertaModel(RobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=66)).eval()
        d = draft_recipe(m)
    assert d.recipe.dim_range("seq") == (1, 64)
    assert {i.name: i.pad_value for i in d.recipe.inputs}["input_ids"] == 1


def test_a_causal_lm_with_a_fixed_example_drafts_its_forward_without_a_kv_cache():
    """(model, example) with fixed shapes has no batch/seq dims for a decoder recipe: the draft
    compiles the forward pass at that shape and says how to get a decoder draft."""
    torch.manual_seed(0)
    d = draft_recipe((_tiny_llama(64), {"input_ids": torch.randint(0, 64, (1, 9))}))
    assert d.recipe.memory.kv_cache is None and d.report.verdict == "valid"
    assert "--dim seq" in d.notes["memory.kv_cache"]


def test_a_bounded_draft_whose_batch_is_unsafe_to_pad_stays_a_valid_recipe():
    """batch keeps an explicit bucket of 1 in a bounded draft, and the exact_plans a dim unsafe to pad
    gets past MAX_EXACT_PLANS go beside it (the schema refused them there once, and a draft of
    max_buckets alone lost the bucket of 1: a lone request ran eagerly)."""
    import torch

    class AcrossBatch(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)       # every row reads the padded ones
    d = draft_recipe((AcrossBatch(), (torch.randn(2, 6, 16),), {"x": ["batch", "seq", 16]}), record=False)
    assert d.data["on_violation"] == "eager" and d.data["dims"]["batch"]["exact_plans"] == 16
    assert d.data["dims"]["batch"]["buckets"][0] == 1 and load_recipe(d.data) == d.recipe


def test_a_dim_unsafe_to_pad_keeps_the_users_max_buckets():
    """`recipe init --dim seq=1:63 --dim batch=1:4 --max-buckets 3` of a MoE LM (its routing sorts
    along batch and seq) drafted every value a bucket: 252 plans, which a tensor-parallel group
    built before its first request. A given max_buckets (and the plan cap) holds: values off a
    bucket run eagerly and those that recur get plans of their own."""
    import torch

    class SortsTokens(torch.nn.Module):
        def forward(self, x):
            return x.flatten(0, 1).sort(0).values.reshape(x.shape)    # every token reads the padded ones
    m = (SortsTokens().eval(), (torch.randn(2, 6, 4),), {"x": ["batch", "seq", 4]})
    d = draft_recipe(m, ranges={"batch": (1, 4), "seq": (1, 63)}, max_buckets=3, max_padding=0.9, record=False)
    dims = d.data["dims"]
    assert d.data["on_violation"] == "eager" and dims["seq"]["exact_plans"] == 16, dims
    assert len(d.recipe.buckets()) <= 9 and "more values than its max_buckets 3" in d.notes["on_violation"]
    few = draft_recipe(m, ranges={"batch": (1, 4), "seq": (1, 3)}, max_buckets=4, max_padding=0.9, record=False)
    assert few.data["on_violation"] != "eager" and few.recipe.dim_buckets() == {"batch": [1, 2, 3, 4],
                                                                                "seq": [1, 2, 3]}


def test_a_bucket_count_alone_places_its_buckets_under_no_padding_bound():
    """`recipe init --max-buckets 2` alone was refused ('padding 0.25 needs max_buckets >= 8'): the
    default padding bound came with it. A count alone is the policy; padding is what it allows."""
    import torch
    m = (torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), {"input": ["batch", 4]})
    d = draft_recipe(m, ranges={"batch": (1, 32)}, max_buckets=2, record=False)
    assert d.data["dims"]["batch"] == {"min": 1, "max": 32, "max_buckets": 2}
    assert len(d.recipe.dim_buckets()["batch"]) == 2 and "at most 2 buckets" in d.notes["dims.batch"]
    both = draft_recipe(m, ranges={"batch": (1, 32)}, max_buckets=9, max_padding=0.25, record=False)
    assert both.data["dims"]["batch"]["max_padding"] == 0.25


def test_coarse_buckets_of_a_bounded_draft_plan_the_values_that_recur():
    """Three dims share the draft's 16 plans, so each gets two or three buckets: a T5 request of
    batch 2 x seq 64 x decoder_seq 31 ran padded to 32 x 512 x 72, 43x eager's time, on every
    call. Each dim whose buckets pad more than half gets exact_plans: a shape that keeps coming
    runs on plans of its own (from its third request)."""
    import torch

    class ThreeDims(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, y):
            return self.lin(x), self.lin(y)               # rows apart: padding is safe
    ex = (torch.randn(2, 5, 8), torch.randn(2, 7, 8))
    d = draft_recipe((ThreeDims(), ex, {"x": ["batch", "seq", 8], "y": ["batch", "decoder_seq", 8]}), record=False)
    dims = d.data["dims"]
    assert all(dims[k].get("exact_plans") == 16 for k in ("batch", "seq", "decoder_seq")), dims
    assert "that recur get plans of their own" in d.notes["dims.seq"] and load_recipe(d.data) == d.recipe


def test_the_draft_of_an_fp16_model_says_compute_f32_leaves_its_f16_ops_alone():
    """precision.compute casts f32 values only: an fp16 model under compute f32 runs in f16 as in eager."""
    d = draft_recipe(spec("mlp_half"))
    assert d.data["precision"] == {"compute": "f32"}
    assert "model's f16 weights and the ops on them run in f16 as in eager" in d.notes["precision"]
    assert "compute f32 changes no dtype" not in draft_recipe(spec("mlp")).notes["precision"]


def test_a_sequence_dim_put_on_an_axis_the_model_fixes_says_so_at_the_flag():
    """`recipe init --dim seq=1:8` of an MLP put seq on its feature axis (axis 1, where a sequence dim
    goes when no axes are named) and ended in torch.export's matmul error, named nowhere near --dim."""
    from graphmode.errors import RecipeError
    with pytest.raises(RecipeError) as e:
        draft_recipe(spec("mlp"), ranges={"seq": (1, 8)}, record=False)
    assert e.value.where == "--dim" and "axis 1 of x (size 16 in the example)" in e.value.message
    assert "--dim seq=LO:HI@INPUT:AXIS" in e.value.fix and "leave --dim seq out" in e.value.fix
