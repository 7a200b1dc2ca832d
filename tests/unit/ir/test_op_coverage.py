"""OpInfo-style op coverage: every sample of every op in the database, on every path that
takes it, against eager PyTorch (the op's reference): the reference interpreter; the CPU
executor (native kernel, ATen step or reference op, as the lowering registry decides); the
generated kernel of the op as a one-op fused group; an ONNX round trip (the legacy
torch.onnx exporter, graphmode's ONNX importer, the interpreter); and the op's eager ATen
call (`OpSpec.aten_call`) as a `fallback` node. Every op also declares its padding rule.

What a path does not take is listed below as an expected gap and checked both ways: a new
gap fails, and so does a gap that closes (then take it off the list). Every CPU case is one
node of one graph, so one plan and one kernel library (one compiler run) serve them all.
Tolerances: rel L2 < 1e-5 in f32, exact for integers and bools.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from graphmode.backends.cpu.build import builder_for, compiler_available
from graphmode.backends.cpu.codegen import ELEMENTWISE_OPS, GEMM_OPS, GENERATED_OPS, ROW_REDUCTIONS
from graphmode.backends.cpu.executor import CpuExecutable
from graphmode.backends.cpu.index_maps import INDEX_MAP_OPS
from graphmode.backends.cpu.rowwise import ROW_KERNELS
from graphmode.coverage.samples import cpu_claims, one_op_group, runs_as, sample_inputs
from graphmode.coverage.table import coverage
from graphmode.errors import IRError
from graphmode.ir.graph import Graph
from graphmode.analysis.padding_rules import RULES
from graphmode.ir.fallback import run_fallback
from graphmode.ir.interpreter import interpret
from graphmode.ir.ops import OPS, PADDING_RULES, OpSpec, aten_call, ops_with, register
from graphmode.ir.types import TensorType
from graphmode.plan.execution import lower
from graphmode.plan.memory import plan_memory
from graphmode.runtime.build import attach_bodies
from graphmode.verify.numerics import rel_l2

CASES = [(op, i, s) for op in sorted(OPS) if OPS[op].samples for i, s in enumerate(OPS[op].samples())]
OPS_WITH_SAMPLES = sorted({op for op, _, _ in CASES})
ROWS = {r.op: r for r in coverage()}

# ---------------------------------------------------------------------------------- expected gaps

# ATen-reference ops (ir/ops/aten_ref.py) run as their ATen op: never generated, always a reference step;
# an ONNX round trip takes the ones some ONNX handler imports into (the coverage table's onnx column)
ATEN_REFERENCE = ops_with("aten_reference")
# ops no group generator writes: a fused group holding one runs with the reference ops
NOT_GENERATED = ATEN_REFERENCE | frozenset({
    "adaptive_avg_pool2d", "all_gather", "all_reduce", "arange", "argmax", "argmin", "avg_pool2d", "batch_norm", "concat", "conv2d",
    "conv_transpose2d", "cumsum", "einsum", "embedding", "expand", "full", "gather", "grid_sampler", "index", "index_select",
    "linear", "matmul", "max_pool2d", "pad", "paged_attention", "permute", "prod", "qlinear", "reduce_scatter", "reshape", "roll", "sdpa",
    "slice", "tril", "triu"})
# samples of generated ops that the generator refuses, and why
GENERATED_REFUSED = {("amax", 1): "not over the last dim", ("amin", 1): "not over the last dim",
                     ("mean", 1): "not over the last dim", ("sum", 1): "not over the last dim",
                     ("softmax", 1): "not over the last dim", ("layer_norm", 1): "not over the last dim",
                     **{(op, i): "zero divisor must raise" for op in ("remainder", "fmod") for i in (1, 2)},
                     ("cast", 0): "C's conversion is not torch's out of range"}     # f32 -> i64 (trial AH)
# ATen-reference ops whose every sample a native kernel or an ATen step claims (backends/cpu/layout_kernels.py,
# resample.py, index_maps.py, group_norm.py, aten_out.py)
NATIVE_ATEN_REFERENCE = frozenset({"group_norm", "native_group_norm", "repeat", "stack", "upsample_bilinear2d",
                                   "upsample_nearest2d", "topk", "sort", "scatter", "scatter_add", "scatter_reduce",
                                   "conv_transpose1d", "conv_transpose3d", *INDEX_MAP_OPS})
# ops that some sample's op instruction runs as the reference op (no native kernel or ATen step claims it;
# the collectives always do: their reference calls the rank's communicator)
REFERENCE_STEPS = (ATEN_REFERENCE - NATIVE_ATEN_REFERENCE) | frozenset({
    "all_gather", "all_reduce", "reduce_scatter", "einsum", "grid_sampler", "prod", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_and", "bitwise_left_shift", "bitwise_not",
    "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil", "cosh", "floor", "round", "sign", "sinh", "tan",
    "amax", "amin", "argmax", "argmin", "batch_norm", "cast", "clamp", "cos", "cumsum", "div", "eq",
    "expand", "fmod", "full", "ge", "gt", "identity", "layer_norm", "le", "log_softmax",
    "logical_not", "lt", "mean", "ne", "pad", "reciprocal", "remainder", "roll", "silu", "sin",
    "sum", "tril", "triu", "where"})
# ops whose samples have no tensor input: an ONNX export folds them into a constant
ONNX_NO_INPUTS = frozenset({"arange", "full"})
# samples whose ONNX round trip fails, and why (an op the importer lacks, or the legacy exporter refuses)
ONNX_FAILS = {**{(op, 0): f"aten::{op}' to ONNX" for op in ("acosh", "asinh", "atanh", "cosh", "sinh", "bitwise_xor",
                                                                 "cumprod", "max_unpool2d", "view_copy")},
              ("view_copy", 1): "aten::view_copy' to ONNX",
              ("bitwise_xor", 1): "aten::bitwise_xor' to ONNX", ("bitwise_not", 0): "bitwise Not for non-boolean",
              ("bitwise_or", 0): "bitwise OR for non-boolean", ("bitwise_or", 1): "bitwise OR for non-boolean",
              ("sort", 1): "Sort, Out parameter is not supported",
              # the exporter's If (an empty index) declares a rank-1 output where its branches make rank 2
              ("scatter_reduce", 0): "the ONNX model declares rank 1",
              ("scatter_reduce", 1): "does not support mean reduction"}
# samples torch's TorchScript exporter writes as another computation (ONNX Runtime differs from eager
# the same way): softplus loses its threshold, a float floor_divide becomes Div + Cast (truncation)
ONNX_EXPORTER_DIFFERS = {("softplus", 0): "threshold dropped", ("floor_divide", 0): "truncates"}
# ops whose round trip matches but comes back as other ops (the exporter decomposes them; a
# collective's samples are one rank's, where it is the identity)
ONNX_DECOMPOSED = frozenset({"adaptive_avg_pool2d", "all_gather", "all_reduce", "flip", "reduce_scatter",
                             "bitwise_left_shift", "bitwise_right_shift", "embedding", "floor_divide", "index",
                             "linear", "max_pool2d_with_indices", "ne", "paged_attention", "qlinear", "remainder", "roll",
                             "rsqrt", "sdpa", "silu"})
ONNX_OPSET = 20        # the legacy exporter's newest: Gelu comes out as one node, not an Erf chain
ONNX_ROUND_TRIP = frozenset(op for op in OPS_WITH_SAMPLES if op not in ATEN_REFERENCE or ROWS[op].onnx)
# ops with samples that name no eager ATen call (no single ATen op computes them, or they need a
# rank's communicator or a paged KV cache)
NO_ATEN_CALL = frozenset({"all_gather", "all_reduce", "reduce_scatter", "grid_sampler", "paged_attention", "prod",
                          "qlinear"})


def _same(found, expected, what: str) -> None:
    """`found` is exactly the expected gap list `expected`, or the message says what changed."""
    new, closed = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    assert not new and not closed, f"{what}: new gaps {new} (fix them or list them), closed gaps {closed} (unlist them)"


def _cases(op: str):
    return [(i, s) for o, i, s in CASES if o == op]


def _reference(op: str, ins, attrs) -> list[torch.Tensor]:
    with torch.inference_mode():
        return OPS[op].ref([t.clone() for t in ins], dict(attrs), {})


def _assert_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
        (where, got.dtype, tuple(got.shape), want.dtype, tuple(want.shape))
    if not want.is_floating_point():
        assert torch.equal(got, want), where
        return
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{where}: NaN positions differ"
    got, want = got[~nan], want[~nan]
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), f"{where}: infinities differ"
    err = rel_l2(got[~inf], want[~inf])
    assert err < (1e-5 if want.dtype == torch.float32 else 1e-10), f"{where}: rel L2 {err:.3g}"


# ---------------------------------------------------------------------------------- one graph of cases

@dataclass
class Case:
    op: str
    index: int
    attrs: dict
    ins: list[torch.Tensor]
    inputs: list[str]
    outputs: list[str]
    want: list[torch.Tensor]
    claims: dict = field(default_factory=dict)
    group_outputs: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.op} sample {self.index}"


def _graph(cases, *, groups: bool) -> tuple[Graph, dict[str, torch.Tensor], list[Case]]:
    """Every (op, index, sample) as one node over its own inputs; with `groups`, also as a
    one-op fused group wherever the generator claims it."""
    g = Graph("ops")
    feeds: dict[str, torch.Tensor] = {}
    out = []
    for op, i, s in cases:
        ins = sample_inputs(s, i)
        tag = f"{op}_{i}"
        inputs = [g.add_input(f"{tag}_x{j}", TensorType.of(t)) for j, t in enumerate(ins)]
        feeds.update(zip(inputs, ins))
        types = OPS[op].infer([TensorType.of(t) for t in ins], dict(s.attrs))
        outputs = g.add_node(op, inputs, types, dict(s.attrs), names=[f"{tag}_y{k}" for k in range(len(types))])
        g.outputs += outputs
        case = Case(op, i, dict(s.attrs), ins, inputs, outputs, _reference(op, ins, s.attrs))
        if groups:
            case.claims = cpu_claims(op, ins, s.attrs)
            if case.claims["generated"]:
                names = [f"{tag}_g{k}" for k in range(len(types))]
                for n, t in zip(names, types):
                    g.add_value(n, t)
                vt = dict(zip(inputs + names, [TensorType.of(t) for t in ins] + list(types)))
                g.nodes.append(one_op_group(op, inputs, names, s.attrs, vt))
                g.outputs += names
                case.group_outputs = names
        out.append(case)
    return g, feeds, out


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every case through one CPU executable: (cases by op, outputs, step kind per output, kernel report)."""
    if not compiler_available():
        pytest.skip("no C++ compiler: native and generated kernels cannot be built")
    g, feeds, cases = _graph(CASES, groups=True)
    plan = attach_bodies(lower(g, plan_memory(g, {})), g)
    exe = CpuExecutable(plan, g.constants, builder=builder_for(tmp_path_factory.mktemp("kernels"), 2), threads=2,
                        tactics=False)
    got = exe.run({k: v.clone() for k, v in feeds.items()})
    steps = iter(exe.step_names)
    kinds = {}
    for ins in plan.instructions:
        kind = "view" if ins.kind == "view" else next(steps).split(":")[0]
        kinds.update(dict.fromkeys(ins.outputs, kind))
    by_op: dict[str, list[Case]] = {}
    for c in cases:
        by_op.setdefault(c.op, []).append(c)
    return by_op, got, kinds, exe.kernel_report


# ---------------------------------------------------------------------------------- paths

@pytest.mark.parametrize("op", OPS_WITH_SAMPLES)
def test_interpreter(op):
    """Each sample as a one-op graph: its types come from the op's inference, the interpreter
    runs it and casts to those types, and the result is eager PyTorch's."""
    for i, s in _cases(op):
        g, feeds, (case,) = _graph([(op, i, s)], groups=False)
        got = interpret(g, {k: v.clone() for k, v in feeds.items()})
        for o, want in zip(case.outputs, case.want):
            _assert_close(got[o], want, f"interpreter: {case.where}")


@pytest.mark.parametrize("op", OPS_WITH_SAMPLES)
def test_cpu_executor(executed, op):
    """Each sample as an op instruction of one plan: it runs as the lowering registry says
    (native kernel, else ATen step, else the reference op) and matches eager PyTorch."""
    by_op, got, kinds, _report = executed
    for c in by_op[op]:
        step = "native" if runs_as(c.claims) == "native" else "aten"    # the reference op runs as an aten step too
        for o, want in zip(c.outputs, c.want):
            assert kinds[o] == step or OPS[op].view and kinds[o] == "view", (c.where, kinds[o], step)
            _assert_close(got[o], want, f"cpu: {c.where} ({kinds[o]})")


@pytest.mark.parametrize("op", OPS_WITH_SAMPLES)
def test_generated_kernel(executed, op):
    """Each sample the generator claims as a one-op fused group is built into the plan's
    library and runs as a kernel matching eager PyTorch; the samples it refuses are listed."""
    by_op, got, kinds, report = executed
    for c in by_op[op]:
        if not c.group_outputs:
            assert op in NOT_GENERATED or (op, c.index) in GENERATED_REFUSED, \
                f"{c.where}: generation refused ({c.claims['generated'].why}); list it as a gap or fix it"
            if (op, c.index) in GENERATED_REFUSED:
                assert GENERATED_REFUSED[op, c.index] in c.claims["generated"].why, c.claims["generated"].why
            continue
        assert op not in NOT_GENERATED and (op, c.index) not in GENERATED_REFUSED, \
            f"{c.where} is generated now: take it off the expected gaps"
        for o, want in zip(c.group_outputs, c.want):
            why = report["fallbacks"].get(f"%{o}")
            assert kinds[o] == "kernel" and why is None, (c.where, kinds[o], why)
            _assert_close(got[o], want, f"generated: {c.where}")


def test_generator_op_sets_sit_inside_their_traits():
    """The fusion pass groups ops by trait and the generators write ops by name: an op a
    generator writes but whose trait is missing would never reach it."""
    assert ELEMENTWISE_OPS <= ops_with("elementwise")
    assert set(ROW_KERNELS) <= ops_with("row_reduction")
    assert GEMM_OPS == ops_with("gemm") and ROW_REDUCTIONS == ops_with("row_reduction")


def test_expected_cpu_gaps_are_exact(executed):
    """The lists above are the gaps, no more and no fewer, and the coverage table says the same."""
    by_op = executed[0]
    _same({op for op, cs in by_op.items() if not any(c.claims["generated"] for c in cs)}, NOT_GENERATED,
          "NOT_GENERATED")
    _same({op for op in OPS_WITH_SAMPLES if "generated" not in ROWS[op].lowering}, NOT_GENERATED,
          "NOT_GENERATED (coverage table)")
    assert NOT_GENERATED.isdisjoint(GENERATED_OPS)
    _same({(c.op, c.index) for cs in by_op.values() for c in cs if not c.claims["generated"]
           and c.op not in NOT_GENERATED}, GENERATED_REFUSED, "GENERATED_REFUSED")
    _same({op for op, cs in by_op.items() if any(runs_as(c.claims) == "reference" for c in cs)}, REFERENCE_STEPS,
          "REFERENCE_STEPS")
    assert {op for op in OPS_WITH_SAMPLES if not {"native", "aten"} & set(ROWS[op].lowering)} <= REFERENCE_STEPS


# ---------------------------------------------------------------------------------- op facts

def test_every_op_has_a_padding_rule():
    """Every op names the padding analysis's rule for it (`opaque` when the analysis does not
    model its reads): a new op without one fails here; and every rule the op table names is
    one the analyzer implements."""
    undeclared = sorted(op for op, s in OPS.items() if s.padding is None)
    assert not undeclared, f"ops without a padding rule (declare one of {sorted(PADDING_RULES)}): {undeclared}"
    assert set(RULES) == set(PADDING_RULES), "the analyzer's rules and the op table's vocabulary differ"
    assert {s.padding for s in OPS.values()} == set(PADDING_RULES), "a padding rule no op follows"
    assert all(ROWS[op].padding == OPS[op].padding for op in OPS)
    with pytest.raises(IRError, match="unknown padding rule 'rowwise'"):
        register(OpSpec("not_an_op", "elementwise", (1, 1), OPS["neg"].infer, OPS["neg"].ref, padding="rowwise"))
    assert "not_an_op" not in OPS


def test_the_padding_value_facts_hold_for_each_ops_reference():
    """What the padding analysis reads off the op table instead of keeping op lists
    (`pad_identity`, `at_masked`, `value_floor`) is true of each op's eager reference: padding
    with its identity leaves a reduction unchanged, a masked input gives its `at_masked`, and
    no sample output lies below its floor."""
    declared = {op: s for op, s in OPS.items() if s.pad_identity or s.at_masked is not None
                or s.value_floor is not None}
    assert {"sum", "prod", "amax", "argmax", "softmax", "log_softmax", "exp", "relu", "gelu"} <= set(declared)
    g = torch.Generator().manual_seed(0)
    for op, s in declared.items():
        attrs = {"dims": [1]} if s.padding == "reduce" else {"dim": 1}
        x = torch.randn(3, 5, generator=g, dtype=torch.float64)
        if s.pad_identity is not None:
            fill = {"zero": 0.0, "masked": -1e4, "one": 1.0}[s.pad_identity]
            padded = torch.cat([x, torch.full((3, 2), fill, dtype=x.dtype)], dim=1)
            got, want = s.ref([padded], attrs, {})[0], s.ref([x], attrs, {})[0]
            torch.testing.assert_close(got[:, :5] if s.padding == "along" else got, want, msg=op)
        if s.at_masked is not None:
            masked = torch.tensor([[0.5, 1.0, -1e4, -3e4]], dtype=torch.float64)
            out = s.ref([masked], {} if s.kind == "elementwise" else attrs, {})[0][0, 2:]
            if s.at_masked == float("-inf"):
                assert (out <= -1e3).all(), op
            else:
                torch.testing.assert_close(out, torch.full_like(out, s.at_masked), atol=1e-6, rtol=0, msg=op)
        if s.value_floor is not None:
            for sample in s.samples():
                out = s.ref(sample.make(g), sample.attrs, {})[0]
                assert (out.double() >= s.value_floor).all(), op
    with pytest.raises(IRError, match="unknown pad_identity 'two'"):
        register(OpSpec("not_an_op", "reduction", (1, 1), OPS["sum"].infer, OPS["sum"].ref, padding="reduce",
                        pad_identity="two"))
    assert "not_an_op" not in OPS


@pytest.mark.parametrize("op", sorted(op for op in OPS_WITH_SAMPLES if OPS[op].aten_call is not None))
def test_aten_fallback_round_trips(op):
    """Each sample through the op's eager ATen call, as the `fallback` node an importer emits
    for it (interpreted), equals the interpreter on the op itself; the raw call already makes
    the op's dtypes and shapes (no cast hides a difference)."""
    for i, s in _cases(op):
        g, feeds, (case,) = _graph([(op, i, s)], groups=False)
        types = [g.type_of(o) for o in case.outputs]
        call = aten_call(op, s.attrs, [g.type_of(x) for x in case.inputs])
        if call is None:             # attributes no single ATen call computes (sdpa's nan_empty_rows)
            continue
        target, args, kwargs = call
        attrs = {"target": target, "args": args, "kwargs": kwargs}
        with torch.inference_mode():
            raw = run_fallback([t.clone() for t in case.ins], attrs, {})
        assert len(raw) == len(case.want), f"{case.where}: {target} makes {len(raw)} tensors"
        fb = Graph("fallback")
        inputs = [fb.add_input(x, g.type_of(x)) for x in case.inputs]
        fb.outputs = fb.add_node("fallback", inputs, types, attrs, names=[f"fb{k}" for k in range(len(types))])
        eager = interpret(fb, {k: v.clone() for k, v in feeds.items()})
        ir = interpret(g, {k: v.clone() for k, v in feeds.items()})
        for k, o in enumerate(case.outputs):
            _assert_close(raw[k], case.want[k], f"aten call {target}: {case.where}")
            _assert_close(eager[f"fb{k}"], ir[o], f"fallback {target}: {case.where}")


def test_ops_without_an_aten_call_are_listed():
    """The ops with samples but no ATen call are exactly NO_ATEN_CALL, and the table says so."""
    _same({op for op in OPS_WITH_SAMPLES if OPS[op].aten_call is None}, NO_ATEN_CALL, "NO_ATEN_CALL")
    assert all(ROWS[op].aten_fallback == (OPS[op].aten_call is not None) for op in OPS)


# ---------------------------------------------------------------------------------- ONNX round trip

class _OneOp(torch.nn.Module):
    def __init__(self, op: str, attrs: dict):
        super().__init__()
        self.op, self.attrs = op, attrs

    def forward(self, *xs):
        return OPS[self.op].ref(list(xs), self.attrs, {})[0]


@dataclass
class RoundTrip:
    case: Case
    error: str = ""
    got: torch.Tensor | None = None
    graph_ops: frozenset = frozenset()
    op_map: dict = field(default_factory=dict)
    onnx: bytes = b""


@pytest.fixture(scope="module")
def round_trips():
    """(op, index) -> each sample exported by torch.onnx (TorchScript exporter), imported by
    graphmode and interpreted; the samples of ONNX_NO_INPUTS ops are not exported."""
    from graphmode.capture.onnx import import_onnx
    from graphmode.errors import GraphmodeError
    out = {}
    for op, i, s in CASES:
        if op in ONNX_NO_INPUTS or op not in ONNX_ROUND_TRIP:
            continue
        (case,) = _graph([(op, i, s)], groups=False)[2]
        rt = out[op, i] = RoundTrip(case)
        names = [f"x{j}" for j in range(len(case.ins))]
        buf = io.BytesIO()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(_OneOp(op, case.attrs), tuple(t.clone() for t in case.ins), buf, dynamo=False,
                                  opset_version=ONNX_OPSET, input_names=names, output_names=["y"])
            rt.onnx = buf.getvalue()
            g, rep = import_onnx(rt.onnx, name=f"{op}_{i}")
        except (GraphmodeError, RuntimeError) as e:
            rt.error = f"{type(e).__name__}: {e}"
            continue
        rt.got = interpret(g, dict(zip(names, (t.clone() for t in case.ins))))[g.outputs[0]]
        rt.graph_ops, rt.op_map = frozenset(n.op for n in g.nodes), rep.op_map
    return out


@pytest.mark.parametrize("op", sorted(ONNX_ROUND_TRIP - ONNX_NO_INPUTS))
def test_onnx_round_trip(round_trips, op):
    """Exported, imported and interpreted, each sample matches eager PyTorch, except the
    listed failures (which must still fail, for the listed reason)."""
    for i, _s in _cases(op):
        rt = round_trips[op, i]
        if (op, i) in ONNX_FAILS:
            assert ONNX_FAILS[op, i] in rt.error, f"{rt.case.where}: {rt.error or 'round trip works now'}"
            continue
        assert not rt.error, f"{rt.case.where}: {rt.error}"
        if (op, i) in ONNX_EXPORTER_DIFFERS:     # the file computes something else: graphmode answers as ORT does
            import onnxruntime as ort
            sess = ort.InferenceSession(rt.onnx, providers=["CPUExecutionProvider"])
            run = sess.run(None, {f"x{j}": t.numpy() for j, t in enumerate(rt.case.ins)})[0]
            _assert_close(rt.got, torch.from_numpy(run), f"onnx vs ONNX Runtime: {rt.case.where}")
            assert rel_l2(torch.from_numpy(run).double(), rt.case.want[0].double()) > 1e-3, \
                f"{rt.case.where}: the exporter matches eager now: unlist it from ONNX_EXPORTER_DIFFERS"
            continue
        _assert_close(rt.got, rt.case.want[0], f"onnx: {rt.case.where}")


def test_expected_onnx_gaps_are_exact(round_trips):
    """The ONNX lists above are exact, and every ONNX op type a round trip imported is listed
    on the coverage table's row of each IR op it became (the table reads the converters'
    code: this checks that reading against real imports)."""
    _same({op for op, i, s in CASES if not sample_inputs(s, i) and op in ONNX_ROUND_TRIP}, ONNX_NO_INPUTS,
          "ONNX_NO_INPUTS")
    _same({k for k, rt in round_trips.items() if rt.error}, ONNX_FAILS, "ONNX_FAILS")
    _same({op for (op, _i), rt in round_trips.items() if not rt.error and op not in rt.graph_ops}, ONNX_DECOMPOSED,
          "ONNX_DECOMPOSED")
    missing = sorted((onnx_op, ir_op) for rt in round_trips.values() for onnx_op, made in rt.op_map.items()
                     for ir_op in made if onnx_op not in ROWS[ir_op].onnx)
    assert not missing, f"imported but not in the coverage table: {missing}"

