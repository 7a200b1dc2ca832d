"""ATen-reference ops: ATen operators that graphmode keeps in the graph as themselves.

Each is an `OpSpec` named after the ATen op it follows, whose reference (`ref`: the
interpreter, the CPU backend's reference step, constant folding) is that ATen op, called
with the arguments the model passed. Its attributes are the call's arguments, encoded as
an eager island's are (`graphmode/ir/fallback.py`): `overload` ("default", "Tensor", ...),
`args` and `kwargs`, with `{"$in": i}` for input tensor i and `{"$dtype": "f32"}` for dtypes.
Unlike an island, the op has IR types, a padding rule and a place in graph mode.

Two families, told apart by how their output types are derived:

- pointwise (kind `elementwise`): ops whose every output element depends only on the
  same-index elements of the broadcast tensor inputs. Shape: the broadcast of the inputs'
  (symbolic dims allowed); dtype: the op's own result on one-element meta tensors of the
  input dtypes and ranks. The padding analysis follows them as any elementwise op (padded
  positions hold unknown values, which stay in padding).
- static (other kinds): output types are the op's own meta-tensor result on the input
  shapes (graphmode/ir/ops/aten_meta.py). Over symbolic dims, only where that is exact: a
  write keeps self's shape, a resampling goes to a fixed size or by an exact scale, or every
  output size is a constant or one of the inputs' dims at three sizes of each symbol (sort,
  topk, median along a dim); otherwise inference refuses and the capture keeps the op an
  eager island. The padding analysis reads them as it reads an island calling the same ATen
  op (rule `aten`): pointwise by its tags, along its `dim` argument by its schema, else a
  padded dim reaching one is reported unsafe.

Every op here carries the `aten_reference` trait: at capture, the types inference derives
are checked against the types torch.export recorded for the node, and an op whose types
differ stays an eager island (never a guess).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.errors import IRError
from graphmode.ir.ops.aten_meta import call, meta, meta_types, overload, static_types
from graphmode.ir.ops.spec import OpSpec, Sample, broadcast_shapes, register
from graphmode.ir.types import TORCH_TO_DTYPE, TensorType

TRAIT = "aten_reference"


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor that is its whole storage: a backend's inputs are views into its arena,
    and some ATen kernels read or assert on the storage itself (slice_scatter)."""
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _ref(op: str, static: bool):
    def ref(ins, attrs, env):
        return [t.contiguous() for t in call(op, [_own(t) for t in ins] if static else ins, attrs)]
    return ref


def _pointwise_infer(op: str):
    def infer(ins: list[TensorType], attrs):
        shape = broadcast_shapes(*(t.shape for t in ins)) if ins else ()
        types = meta_types(op, [meta(t, (1,) * t.rank) for t in ins], attrs)
        return [t.with_shape(shape) for t in types]
    return infer


def _static_infer(op: str):
    def infer(ins: list[TensorType], attrs):
        return static_types(op, ins, attrs)
    return infer


# ---------------------------------------------------------------------------------- samples

class T:
    """A sample's input tensor: shape and how its values are drawn."""

    def __init__(self, *shape: int, dist: str = "randn", dtype: torch.dtype = torch.float32, high: int = 4):
        self.shape, self.dist, self.dtype, self.high = shape, dist, dtype, high

    def make(self, g: torch.Generator) -> torch.Tensor:
        if self.dtype == torch.bool:
            return torch.rand(*self.shape, generator=g) > 0.5
        if not self.dtype.is_floating_point:
            if self.dist == "arange":           # distinct indices (a write at a repeated index races)
                return (torch.arange(math.prod(self.shape)) % self.high).reshape(self.shape).to(self.dtype)
            if self.dist == "ones":
                return torch.ones(self.shape, dtype=self.dtype)
            return torch.randint(0, self.high, self.shape, generator=g, dtype=self.dtype)
        x = torch.rand(*self.shape, generator=g)
        return {"randn": lambda: torch.randn(*self.shape, generator=g), "pos": lambda: x * 3 + 0.1,
                "unit": lambda: x * 1.8 - 0.9, "above1": lambda: x * 3 + 1.05, "unit01": lambda: x * 0.9 + 0.05,
                "spd": lambda: _spd(self.shape, g),
                "sorted": lambda: torch.sort(torch.randn(*self.shape, generator=g)).values}[self.dist]().to(self.dtype)


def _spd(shape, g):
    a = torch.randn(*shape, generator=g)
    return a @ a.transpose(-1, -2) + shape[-1] * torch.eye(shape[-1])


def sample(overload_name: str, *args: Any, note: str = "", **kwargs: Any) -> Sample:
    """A Sample calling the overload with `args`/`kwargs`, where each `T` becomes an input."""
    tensors: list[T] = []

    def enc(v):
        if isinstance(v, T):
            tensors.append(v)
            return {"$in": len(tensors) - 1}
        if isinstance(v, torch.dtype):
            return {"$dtype": TORCH_TO_DTYPE[v]}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v
    attrs = {"overload": overload_name, "args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()}}
    return Sample(lambda g: [t.make(g) for t in tensors], attrs, note)


ATTRS = ("overload", "args", "kwargs")
# One op, one name: a core op (imported before this module) has no entry here; its ATen overloads reach it
# through capture/aten/; an overload another op already captures stays with that op.
# ATen ops that are the same op under another name (same overloads and schemas): captured as it
ALIASES = {"erfc": ("special_erfc",), "erfinv": ("special_erfinv",), "expm1": ("special_expm1",),
           "exp2": ("special_exp2",), "log1p": ("special_log1p",), "logit": ("special_logit",), "i0": ("special_i0",),
           "digamma": ("special_digamma", "special_psi"), "lgamma": ("special_gammaln",), "sinc": ("special_sinc",),
           "polygamma": ("special_polygamma",), "logsumexp": ("special_logsumexp",),
           "mvlgamma": ("special_multigammaln",)}


def _register(name: str, kind: str, overloads: Sequence[str], samples: Callable[[], list[Sample]], doc: str,
              infer_fn, arity: tuple[int, int]) -> None:
    from graphmode.ir.ops.spec import OPS, aten_table
    if name in OPS:
        raise IRError(f"ATen-reference op {name!r} would be a second op of that name",
                      fix="capture the ATen op as the core op (a converter in capture/aten/) and drop the entry")
    taken = aten_table()
    aten = [a for n in (name,) + ALIASES.get(name, ()) for o in overloads if (a := f"aten.{n}.{o}") not in taken]
    register(OpSpec(name, kind, arity, infer_fn(name), _ref(name, infer_fn is _static_infer), attrs=ATTRS, doc=doc,
                    traits=frozenset({TRAIT}), aten=tuple(aten), samples=samples,
                    padding=_PADDING.get(kind, "aten") if not name.startswith(_EDGE_PADS) else "window",
                    aten_call=_own_call(name)))


# padding rules by kind: elementwise ops keep padding where it is; pools, resampling and
# convolutions (`window`) keep each sample (axis 0) on its own, as reflect and edge padding do
_PADDING = {"elementwise": "pointwise", "window": "window"}
_EDGE_PADS = ("reflection_pad", "replication_pad")


def _own_call(name: str):
    """An ATen-reference op's eager equivalent is its own call, with its own arguments."""
    return lambda a, types: (f"aten.{name}.{a.get('overload', 'default')}", list(a.get("args", [])),
                             dict(a.get("kwargs", {})))


def _checked(name: str, overloads: Sequence[str]) -> None:
    for n in (name,) + ALIASES.get(name, ()):
        for o in overloads:
            overload(n, o)        # an entry naming an overload this torch lacks fails at import


# ---------------------------------------------------------------------------------- pointwise

# name: (overloads, sample maker: dist of every tensor input or a list of Samples, doc)
_X = "randn"
POINTWISE: dict[str, tuple] = {
    "trunc": (("default",), _X, "round toward zero"),
    "frac": (("default",), _X, "x - trunc(x)"),
    "sgn": (("default",), _X, "sign (for real inputs)"),
    "signbit": (("default",), _X, "x has its sign bit set (bool)"),
    "log10": (("default",), "pos", "base-10 log"),
    "log2": (("default",), "pos", "base-2 log"),
    "log1p": (("default",), "pos", "log(1 + x)"),
    "expm1": (("default",), _X, "e^x - 1"),
    "exp2": (("default",), _X, "2^x"),
    "erfc": (("default",), _X, "1 - erf(x)"),
    "erfinv": (("default",), "unit", "inverse error function"),
    "digamma": (("default",), "pos", "digamma (psi)"),
    "lgamma": (("default",), "pos", "log |gamma(x)|"),
    "i0": (("default",), _X, "modified Bessel function of the first kind, order 0"),
    "sinc": (("default",), _X, "sin(pi x) / (pi x)"),
    "deg2rad": (("default",), _X, "degrees to radians"),
    "rad2deg": (("default",), _X, "radians to degrees"),
    "square": (("default",), _X, "x * x"),
    "nan_to_num": (("default",), _X, "NaN, +inf, -inf replaced by finite values"),
    "isfinite": (("default",), _X, "not inf and not NaN (bool)"),
    "isinf": (("default",), _X, "+-inf (bool)"),
    "isnan": (("default",), _X, "NaN (bool)"),
    "isreal": (("default",), _X, "imaginary part is 0 (bool; true for real inputs)"),
    "isneginf": (("default",), _X, "-inf (bool)"),
    "isposinf": (("default",), _X, "+inf (bool)"),
    "logit": (("default",), "unit01", "log(p / (1 - p)) (optional eps clamp)"),
    "mish": (("default",), _X, "x * tanh(softplus(x))"),
    "selu": (("default",), _X, "scaled ELU"),
    "celu": (("default",), _X, "continuously differentiable ELU"),
    "elu": (("default",), _X, "ELU (alpha, scale, input_scale)"),
    "leaky_relu": (("default",), _X, "x if x > 0 else negative_slope * x"),
    "softplus": (("default",), _X, "log(1 + e^(beta x)) / beta (linear past threshold)"),
    "hardshrink": (("default",), _X, "x if |x| > lambd else 0"),
    "softshrink": (("default",), _X, "x - sign(x) lambd if |x| > lambd else 0"),
    "threshold": (("default",), _X, "x if x > threshold else value"),
    "log_sigmoid": (("default",), _X, "log(sigmoid(x))"),
    "angle": (("default",), _X, "argument (0 or pi for real inputs)"),
    "conj_physical": (("default",), _X, "complex conjugate (the identity on real inputs)"),
    "special_entr": (("default",), "pos", "-x ln x"),
    "special_erfcx": (("default",), _X, "scaled complementary error function"),
    "special_i0e": (("default",), _X, "exponentially scaled i0"),
    "special_i1": (("default",), _X, "modified Bessel function of the first kind, order 1"),
    "special_i1e": (("default",), _X, "exponentially scaled i1"),
    "special_log_ndtr": (("default",), _X, "log of the standard normal CDF"),
    "special_ndtr": (("default",), _X, "standard normal CDF"),
    "special_ndtri": (("default",), "unit01", "inverse of the standard normal CDF"),
    "special_bessel_j0": (("default",), _X, "Bessel function of the first kind, order 0"),
    "special_bessel_j1": (("default",), _X, "Bessel function of the first kind, order 1"),
    "special_bessel_y0": (("default",), "pos", "Bessel function of the second kind, order 0"),
    "special_bessel_y1": (("default",), "pos", "Bessel function of the second kind, order 1"),
    "special_modified_bessel_i0": (("default",), _X, "modified Bessel function of the first kind, order 0"),
    "special_modified_bessel_i1": (("default",), _X, "modified Bessel function of the first kind, order 1"),
    "special_modified_bessel_k0": (("default",), "pos", "modified Bessel function of the second kind, order 0"),
    "special_modified_bessel_k1": (("default",), "pos", "modified Bessel function of the second kind, order 1"),
    "special_scaled_modified_bessel_k0": (("default",), "pos", "scaled modified Bessel K0"),
    "special_scaled_modified_bessel_k1": (("default",), "pos", "scaled modified Bessel K1"),
    "special_spherical_bessel_j0": (("default",), _X, "spherical Bessel function of the first kind, order 0"),
    "special_airy_ai": (("default",), _X, "Airy function Ai"),
    # two or three tensor inputs (broadcast)
    "atan2": (("default",), _X, "atan(a / b) in the right quadrant"),
    "copysign": (("Tensor", "Scalar"), _X, "|a| with the sign of b"),
    "fmax": (("default",), _X, "max ignoring NaN"),
    "fmin": (("default",), _X, "min ignoring NaN"),
    "heaviside": (("default",), _X, "step: 0, values (at 0) or 1"),
    "hypot": (("default",), _X, "sqrt(a^2 + b^2)"),
    "logaddexp": (("default",), _X, "log(e^a + e^b)"),
    "logaddexp2": (("default",), _X, "log2(2^a + 2^b)"),
    "nextafter": (("default",), _X, "next float after a toward b"),
    "xlogy": (("Tensor", "Scalar_Other", "Scalar_Self"), "pos", "a * log(b) (0 where a == 0)"),
    "special_xlog1py": (("default", "other_scalar", "self_scalar"), "pos", "a * log1p(b)"),
    "special_zeta": (("default", "other_scalar", "self_scalar"), "above1", "Hurwitz zeta"),
    "logical_xor": (("default",), _X, "a xor b (bool)"),
    "floor_divide": (("default",), _X, "floor(a / b)"),
    "igamma": (("default",), "pos", "regularized lower incomplete gamma"),
    "igammac": (("default",), "pos", "regularized upper incomplete gamma"),
    "ldexp": (("Tensor",), _X, "a * 2^b"),
    "lerp": (("Scalar", "Tensor"), _X, "a + weight * (b - a)"),
    "addcmul": (("default",), _X, "a + value * b * c"),
    "addcdiv": (("default",), _X, "a + value * b / c"),
    "mvlgamma": (("default",), "above1", "multivariate log gamma of order p"),
    "polygamma": (("default",), "pos", "n-th derivative of digamma"),
}
for _p in ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
           "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
           "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
           "laguerre_polynomial_l", "legendre_polynomial_p"):
    POINTWISE[f"special_{_p}"] = (("default", "x_scalar", "n_scalar"), "poly", _p.replace("_", " ") + " P_n(x)")

_TWO = {"atan2", "copysign", "fmax", "fmin", "heaviside", "hypot", "logaddexp", "logaddexp2", "nextafter", "xlogy",
        "special_xlog1py", "special_zeta", "logical_xor", "floor_divide", "igamma", "igammac"}


def _pointwise_samples(name: str, dist: str) -> Callable[[], list[Sample]]:
    a, b = T(2, 3, 4, dist=dist if dist != "poly" else "unit"), T(3, 1, dist=dist if dist != "poly" else "unit")
    special = {
        "nan_to_num": lambda: [sample("default", a), sample("default", a, nan=0.5, posinf=2.0, neginf=-2.0)],
        "logit": lambda: [sample("default", a), sample("default", T(4, 5, dist="unit"), eps=0.2)],
        "celu": lambda: [sample("default", a, 0.5)],
        "elu": lambda: [sample("default", a), sample("default", a, 0.5, 1.5, 2.0)],
        "leaky_relu": lambda: [sample("default", a, 0.2)],
        "softplus": lambda: [sample("default", a, 2.0, 1.0)],
        "hardshrink": lambda: [sample("default", a, 0.4)],
        "softshrink": lambda: [sample("default", a, 0.4)],
        "threshold": lambda: [sample("default", a, 0.1, -1.0)],
        "copysign": lambda: [sample("Tensor", a, b), sample("Scalar", a, -1.0)],
        "xlogy": lambda: [sample("Tensor", a, b), sample("Scalar_Other", a, 2.5), sample("Scalar_Self", 2.5, b)],
        "special_xlog1py": lambda: [sample("default", a, b), sample("other_scalar", a, 2.5)],
        "special_zeta": lambda: [sample("default", a, b), sample("self_scalar", 2.5, b)],
        "logical_xor": lambda: [sample("default", T(2, 3, dtype=torch.bool), T(3, dtype=torch.bool))],
        "floor_divide": lambda: [sample("default", T(3, 4), T(3, 4, dist="pos")),
                                 sample("default", T(4, dtype=torch.int64, high=20), T(1, dtype=torch.int64, high=3))],
        "ldexp": lambda: [sample("Tensor", a, T(3, 1, dtype=torch.int64))],
        "lerp": lambda: [sample("Scalar", a, b, 0.3), sample("Tensor", a, b, T(4))],
        "addcmul": lambda: [sample("default", a, b, T(4), value=0.5)],
        "addcdiv": lambda: [sample("default", a, b, T(4, dist="pos"), value=0.5)],
        "mvlgamma": lambda: [sample("default", T(3, 4, dist="above1"), 2)],
        "polygamma": lambda: [sample("default", 1, T(3, 4, dist="pos"))],
        "heaviside": lambda: [sample("default", T(3, 4), T(4))],
    }
    if name in special:
        return special[name]
    if dist == "poly":
        return lambda: [sample("default", a, T(3, 1, dtype=torch.int64)), sample("n_scalar", a, 3)]
    if name in _TWO:
        return lambda: [sample("default", a, b)]
    return lambda: [sample("default", a)]


for _name, (_ovl, _dist, _doc) in POINTWISE.items():
    _checked(_name, _ovl)
    _register(_name, "elementwise", _ovl, _pointwise_samples(_name, _dist), f"{_doc} (ATen {_name})",
              _pointwise_infer, (0, 3))


# ---------------------------------------------------------------------------------- static

def _i(*shape: int, high: int = 3) -> T:
    return T(*shape, dtype=torch.int64, high=high)


_x = T(3, 5)
_x3 = T(2, 3, 4)
_img = T(1, 2, 4, 5)
_vol = T(1, 2, 3, 4, 3)
_seq = T(2, 3, 6)
_offsets = T(2, dtype=torch.int64, dist="arange", high=5)      # bags start at 0 and 1
# name: (kind, overloads, samples, doc)
STATIC: dict[str, tuple] = {
    # reductions and scans
    "var": ("reduction", ("correction", "default", "dim"), lambda: [sample("correction", _x3, [1], correction=1, keepdim=True)],
            "variance over dims (correction)"),
    "std": ("reduction", ("correction", "default", "dim"), lambda: [sample("correction", _x3, [0, 2], correction=0)],
            "standard deviation over dims (correction)"),
    "var_mean": ("reduction", ("correction", "default", "dim"), lambda: [sample("correction", _x3, [1], correction=1)],
                 "(variance, mean) over dims"),
    "std_mean": ("reduction", ("correction", "default", "dim"), lambda: [sample("correction", _x3, [2], correction=1)],
                 "(standard deviation, mean) over dims"),
    "logsumexp": ("reduction", ("default",), lambda: [sample("default", _x3, [1], False)], "log(sum(exp(x))) over dims"),
    "nansum": ("reduction", ("default",), lambda: [sample("default", _x3, [1])], "sum treating NaN as 0"),
    "cumprod": ("reduction", ("default",), lambda: [sample("default", _x, 1)], "inclusive prefix product along dim"),
    "cummax": ("reduction", ("default",), lambda: [sample("default", _x, 1)], "(prefix max, its index) along dim"),
    "cummin": ("reduction", ("default",), lambda: [sample("default", _x, 0)], "(prefix min, its index) along dim"),
    "logcumsumexp": ("reduction", ("default",), lambda: [sample("default", _x, 1)], "log of the prefix sum of exp"),
    "max": ("reduction", ("dim", "default"), lambda: [sample("dim", _x, 1), sample("default", _x)],
            "max (over all, or (values, indices) along dim)"),
    "min": ("reduction", ("dim", "default"), lambda: [sample("dim", _x, 0, True), sample("default", _x)],
            "min (over all, or (values, indices) along dim)"),
    "aminmax": ("reduction", ("default",), lambda: [sample("default", _x, dim=1)], "(min, max), optionally along dim"),
    "median": ("reduction", ("default", "dim"), lambda: [sample("default", _x), sample("dim", _x, 1)],
               "median (lower of the two middles), optionally (values, indices) along dim"),
    "nanmedian": ("reduction", ("default", "dim"), lambda: [sample("default", _x), sample("dim", _x, 0)],
                  "median ignoring NaN"),
    "mode": ("reduction", ("default",), lambda: [sample("default", _i(3, 6), 1)], "(most frequent value, index) along dim"),
    "kthvalue": ("reduction", ("default",), lambda: [sample("default", _x, 2, 1)], "(k-th smallest, index) along dim"),
    "topk": ("reduction", ("default",), lambda: [sample("default", _x, 2, 1), sample("default", _x, 2, 0, False)],
             "(k largest or smallest, indices) along dim"),
    "sort": ("reduction", ("default", "stable"), lambda: [sample("default", _x, 1), sample("stable", _x, stable=True,
                                                                                          dim=0, descending=True)],
             "(sorted values, indices) along dim"),
    "all": ("reduction", ("default", "dim", "dims"), lambda: [sample("dim", T(3, 4, dtype=torch.bool), 1)],
            "logical and over dims"),
    "any": ("reduction", ("default", "dim", "dims"), lambda: [sample("dims", T(3, 4, dtype=torch.bool), [0])],
            "logical or over dims"),
    "count_nonzero": ("reduction", ("default", "dim_IntList"), lambda: [sample("dim_IntList", _i(3, 4), [1])],
                      "number of nonzero elements over dims"),
    "linalg_norm": ("reduction", ("default", "ord_str"), lambda: [sample("default", _x3, 2.0, [1]),
                                                                  sample("ord_str", _x, "fro")],
                    "vector or matrix norm (ord, dims)"),
    "pdist": ("reduction", ("default",), lambda: [sample("default", T(4, 3), 2.0)],
              "p-norm distances between the rows, upper triangle"),
    "linalg_vector_norm": ("reduction", ("default",), lambda: [sample("default", _x3, 2.0, [1]),
                                                                sample("default", _x3, float("inf"))],
                           "vector p-norm over dims"),
    "linalg_matrix_norm": ("reduction", ("default", "str_ord"), lambda: [sample("str_ord", _x3, "fro"),
                                                                          sample("default", _x3, 1.0)],
                           "matrix norm over the last two dims"),
    "dist": ("reduction", ("default",), lambda: [sample("default", _x, T(5), 3.0)], "p-norm of a - b"),
    "isin": ("data", ("Tensor_Tensor", "Tensor_Scalar"), lambda: [sample("Tensor_Tensor", _i(3, 4, high=6), _i(3))],
             "elements of a found in b (bool)"),
    "isclose": ("elementwise_static", ("default",), lambda: [sample("default", _x, T(5), 0.1, 0.5)],
                "|a - b| <= atol + rtol |b| (bool)"),
    # shape and data movement
    "flip": ("shape", ("default",), lambda: [sample("default", _x3, [0, 2])], "reverse the order along dims"),
    "rot90": ("shape", ("default",), lambda: [sample("default", _x3, 3, [1, 2])], "rotate by 90 degrees k times"),
    "diag": ("shape", ("default",), lambda: [sample("default", T(4), 1), sample("default", _x, -1)],
             "diagonal matrix from a vector, or a matrix's diagonal"),
    "diagonal": ("shape", ("default",), lambda: [sample("default", _x3, 1, 0, 2)], "a diagonal, as a copy"),
    "diagonal_copy": ("shape", ("default",), lambda: [sample("default", _x3, 0, 1, 2)], "a diagonal"),
    "diag_embed": ("shape", ("default",), lambda: [sample("default", _x, 1)], "batched diagonal matrices"),
    "diagonal_scatter": ("data", ("default",), lambda: [sample("default", T(4, 4), T(4))], "x with a diagonal replaced"),
    "select_scatter": ("data", ("default",), lambda: [sample("default", _x, T(5), 0, 1)], "x with x[dim][index] replaced"),
    "slice_scatter": ("data", ("default",), lambda: [sample("default", _x, T(3, 2), 1, 1, 5, 2)],
                      "x with a strided slice replaced"),
    "index_add": ("data", ("default",), lambda: [sample("default", _x, 1, _i(4, high=5), T(3, 4), alpha=2.0)],
                  "x with source added at indices along dim"),
    "index_copy": ("data", ("default",), lambda: [sample("default", _x, 0, T(2, dtype=torch.int64, dist="arange", high=3),
                                                            T(2, 5))],
                   "x with rows copied in at indices along dim"),
    "index_fill": ("data", ("int_Scalar", "int_Tensor"), lambda: [sample("int_Scalar", _x, 1, _i(2, high=5), -1.0)],
                   "x with value at indices along dim"),
    "scatter": ("data", ("src", "value", "value_reduce", "reduce"),
                lambda: [sample("src", _x, 1, _i(3, 2, high=5), T(3, 2)), sample("value", _x, 0, _i(1, 5), 2.0)],
                "x with values written at index along dim (last write wins)"),
    "scatter_add": ("data", ("default",), lambda: [sample("default", _x, 1, _i(3, 4, high=5), T(3, 4))],
                    "x with values added at index along dim"),
    "scatter_reduce": ("data", ("two",), lambda: [sample("two", _x, 1, _i(3, 4, high=5), T(3, 4), "amax"),
                                                   sample("two", _x, 0, _i(2, 5), T(2, 5), "mean", include_self=False)],
                       "x with values reduced in at index along dim"),
    "index_reduce": ("data", ("default",), lambda: [sample("default", _x, 0, _i(4, high=3), T(4, 5), "prod")],
                     "x with rows reduced in at indices along dim"),
    "masked_scatter": ("data", ("default",), lambda: [sample("default", _x, T(3, 5, dtype=torch.bool), T(15))],
                       "x with the source's leading values written where mask is true"),
    "index_put": ("data", ("default",), lambda: [sample("default", _x, [_i(2, high=3)], T(2, 5)),
                                                 sample("default", _x, [None, _i(3, high=5)], T(3), True)],
                  "x with values written (or added: accumulate) at advanced indices: x[i] = v"),
    "embedding_bag": ("data", ("default", "padding_idx"),
                      lambda: [sample("default", T(6, 4), _i(5, high=6), _offsets, False, 1),
                               sample("padding_idx", T(6, 4), _i(5, high=6), _offsets, False, 0, False, T(5), False, 0)],
                      "(sum, mean or max of each bag's rows, offset2bag, bag_size, max_indices)"),
    "put": ("data", ("default",), lambda: [sample("default", _x, _i(4, high=15), T(4), True)],
            "x with values written (or added) at indices of its flattened form"),
    "take": ("data", ("default",), lambda: [sample("default", _x, _i(2, 3, high=15))], "x.flatten()[index]"),
    "take_along_dim": ("data", ("default",), lambda: [sample("default", _x, _i(3, 2, high=5), 1)],
                       "gather along dim, broadcasting"),
    "repeat": ("shape", ("default",), lambda: [sample("default", _x, [2, 1, 2])], "tile x"),
    "block_diag": ("shape", ("default",), lambda: [sample("default", [T(2, 3), T(1, 2)])], "block-diagonal matrix"),
    "narrow_copy": ("shape", ("default",), lambda: [sample("default", _x, 1, 1, 3)], "a narrowed copy along dim"),
    "permute_copy": ("shape", ("default",), lambda: [sample("default", _x3, [2, 0, 1])], "a permuted copy"),
    "view_copy": ("shape", ("default", "dtype"), lambda: [sample("default", _x3, [4, 6]),
                                                         sample("dtype", _x3, torch.int32)],
                  "a reshaped copy, or the bytes read as another dtype of the same width"),
    "expand_copy": ("shape", ("default",), lambda: [sample("default", T(3, 1), [2, 3, 4])], "an expanded copy"),
    "alias_copy": ("shape", ("default",), lambda: [sample("default", _x)], "a copy"),
    "squeeze_copy": ("shape", ("default", "dim", "dims"), lambda: [sample("dim", T(3, 1, 5), 1),
                                                                   sample("dims", T(1, 3, 1), [0, 2])],
                     "a copy without size-1 dims"),
    "unsqueeze_copy": ("shape", ("default",), lambda: [sample("default", _x, 1)], "a copy with a size-1 dim added"),
    "t_copy": ("shape", ("default",), lambda: [sample("default", _x)], "a transposed copy (up to 2-d)"),
    "transpose_copy": ("shape", ("int",), lambda: [sample("int", _x3, 0, 2)], "a copy with two dims swapped"),
    "unbind_copy": ("shape", ("int",), lambda: [sample("int", _x, 1)], "copies of the slices along dim"),
    "unfold_copy": ("shape", ("default",), lambda: [sample("default", _x, 1, 2, 1)], "a copy of sliding windows"),
    "segment_reduce": ("reduction", ("default",), lambda: [sample("default", T(3, 2), "sum",
                                                                  lengths=T(3, dtype=torch.int64, dist="ones"))],
                       "reduction over consecutive segments of given lengths or offsets"),
    "_unsafe_masked_index": ("data", ("default",), lambda: [sample("default", _x, T(2, 3, 1, dtype=torch.bool),
                                                                   [_i(2, 3, high=3)], 0.0)],
                             "x[indices] where mask, else fill"),
    "unsafe_split": ("shape", ("Tensor",), lambda: [sample("Tensor", _x, 2, 1)], "pieces of split_size along dim"),
    "split_with_sizes_copy": ("shape", ("default",), lambda: [sample("default", _x, [1, 4], 1)],
                              "pieces of the given sizes along dim"),
    "unfold": ("shape", ("default",), lambda: [sample("default", _x, 1, 2, 1)], "sliding windows along dim"),
    "meshgrid": ("shape", ("default", "indexing"), lambda: [sample("indexing", [T(3), T(4)], indexing="xy")],
                 "coordinate grids"),
    "broadcast_tensors": ("shape", ("default",), lambda: [sample("default", [T(3, 1), T(4)])],
                          "the inputs broadcast to one shape"),
    "sum_to_size": ("reduction", ("default",), lambda: [sample("default", _x3, [3, 1])], "sum down to a shape"),
    "atleast_1d": ("shape", ("Sequence",), lambda: [sample("Sequence", [T(3), T(2, 2)])], "each input at least 1-d"),
    "atleast_2d": ("shape", ("Sequence",), lambda: [sample("Sequence", [T(3), T(2, 2)])], "each input at least 2-d"),
    "atleast_3d": ("shape", ("Sequence",), lambda: [sample("Sequence", [T(3), T(2, 2)])], "each input at least 3-d"),
    "column_stack": ("shape", ("default",), lambda: [sample("default", [T(3), T(3, 2)])], "stack as columns"),
    "stack": ("shape", ("default",), lambda: [sample("default", [_x, _x], 1)], "stack along a new dim"),
    "hstack": ("shape", ("default",), lambda: [sample("default", [_x, T(3, 2)])], "concatenate along dim 1 (0 for 1-d)"),
    "vstack": ("shape", ("default",), lambda: [sample("default", [T(5), _x])], "concatenate rows (1-d as one row)"),
    "dstack": ("shape", ("default",), lambda: [sample("default", [_x, _x])], "concatenate along dim 2"),
    "nonzero_static": ("data", ("default",), lambda: [sample("default", T(3, 4, dtype=torch.bool), size=8)],
                       "indices of the nonzero elements, padded or cut to `size` rows"),
    "outer": ("gemm_static", ("default",), lambda: [sample("default", T(3), T(4))], "outer product"),
    "reflection_pad1d": ("shape", ("default",), lambda: [sample("default", _seq, [2, 1])], "reflect padding (1-d)"),
    "reflection_pad2d": ("shape", ("default",), lambda: [sample("default", _img, [1, 2, 2, 0])],
                         "reflect padding (2-d)"),
    "reflection_pad3d": ("shape", ("default",), lambda: [sample("default", _vol, [1, 0, 1, 1, 0, 2])],
                         "reflect padding (3-d)"),
    "replication_pad1d": ("shape", ("default",), lambda: [sample("default", _seq, [2, 1])],
                          "edge padding (1-d)"),
    "replication_pad2d": ("shape", ("default",), lambda: [sample("default", _img, [1, 2, 2, 0])],
                          "edge padding (2-d)"),
    "replication_pad3d": ("shape", ("default",), lambda: [sample("default", _vol, [1, 0, 1, 1, 0, 2])],
                          "edge padding (3-d)"),
    "_pad_circular": ("shape", ("default",), lambda: [sample("default", _img, [1, 1, 2, 1])],
                      "circular padding (the last len(pad)/2 dims)"),
    "fliplr": ("shape", ("default",), lambda: [sample("default", _x)], "reverse dim 1"),
    "flipud": ("shape", ("default",), lambda: [sample("default", _x)], "reverse dim 0"),
    "diagflat": ("shape", ("default",), lambda: [sample("default", _x, 1)], "diagonal matrix from the flattened input"),
    "max_pool2d_with_indices": ("pool_static", ("default",), lambda: [sample("default", _img, [2, 2])],
                                "2-d max pool and argmax indices (max_pool2d when the indices are unused)"),
    "linalg_inv_ex": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "(inverse, info)"),
    "searchsorted": ("data", ("Tensor", "Scalar"), lambda: [sample("Tensor", T(6, dist="sorted"), _x),
                                                            sample("Scalar", T(6, dist="sorted"), 0.3)],
                     "insertion indices into a sorted sequence"),
    "bucketize": ("data", ("Tensor",), lambda: [sample("Tensor", _x, T(4), right=True)], "bucket indices"),
    "histc": ("reduction", ("default",), lambda: [sample("default", _x, 4, -1.0, 1.0)], "histogram with equal bins"),
    # contractions
    "cross": ("gemm_static", ("default",), lambda: [sample("default", T(4, 3), T(4, 3), 1)], "cross product along dim"),
    "linalg_cross": ("gemm_static", ("default",), lambda: [sample("default", T(4, 3), T(1, 3))], "cross product"),
    "cdist": ("gemm_static", ("default",), lambda: [sample("default", T(3, 4), T(5, 4), 2.0)], "pairwise p-distances"),
    "dot": ("gemm_static", ("default",), lambda: [sample("default", T(5), T(5))], "dot product of vectors"),
    "vdot": ("gemm_static", ("default",), lambda: [sample("default", T(5), T(5))], "dot product (conjugating a)"),
    "mv": ("gemm_static", ("default",), lambda: [sample("default", _x, T(5))], "matrix-vector product"),
    "addmv": ("gemm_static", ("default",), lambda: [sample("default", T(3), _x, T(5), beta=0.5, alpha=2.0)],
              "beta c + alpha (A @ v)"),
    "addbmm": ("gemm_static", ("default",), lambda: [sample("default", T(3, 2), T(4, 3, 5), T(4, 5, 2), alpha=0.5)],
               "beta c + alpha sum_b (A_b @ B_b)"),
    "baddbmm": ("gemm_static", ("default",), lambda: [sample("default", T(4, 3, 2), T(4, 3, 5), T(4, 5, 2), beta=2.0)],
                "beta c + alpha (A @ B), batched"),
    "addr": ("gemm_static", ("default",), lambda: [sample("default", _x, T(3), T(5), alpha=2.0)],
             "beta c + alpha outer(a, b)"),
    "bilinear": ("gemm_static", ("default",), lambda: [sample("default", T(2, 3), T(2, 4), T(5, 3, 4), T(5))],
                 "x1^T A x2 + b"),
    "kron": ("gemm_static", ("default",), lambda: [sample("default", T(2, 3), T(2, 2))], "Kronecker product"),
    "trace": ("reduction", ("default",), lambda: [sample("default", _x)], "sum of the diagonal"),
    # linear algebra (LAPACK): the same call as eager
    "matrix_exp": ("linalg", ("default",), lambda: [sample("default", T(2, 3, 3))], "matrix exponential"),
    "linalg_inv": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "matrix inverse"),
    "inverse": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "matrix inverse"),
    "linalg_det": ("linalg", ("default",), lambda: [sample("default", T(2, 3, 3, dist="spd"))], "determinant"),
    "det": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "determinant"),
    "logdet": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "log determinant"),
    "linalg_slogdet": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                       "(sign, log |det|)"),
    "slogdet": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "(sign, log |det|)"),
    "cholesky": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "Cholesky factor"),
    "linalg_cholesky": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "Cholesky factor"),
    "linalg_cholesky_ex": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                           "(Cholesky factor, info)"),
    "cholesky_inverse": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                         "inverse from a Cholesky factor"),
    "cholesky_solve": ("linalg", ("default",), lambda: [sample("default", T(3, 2), T(3, 3, dist="spd"))],
                       "solve with a Cholesky factor"),
    "linalg_solve": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"), T(3, 2))],
                     "solve A X = B"),
    "linalg_solve_ex": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"), T(3, 2))],
                        "(X, info) solving A X = B"),
    "triangular_solve": ("linalg", ("default",), lambda: [sample("default", T(3, 2), T(3, 3, dist="spd"))],
                         "(X, A) solving a triangular system"),
    "linalg_solve_triangular": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"), T(3, 2),
                                                                        upper=True)], "solve a triangular system"),
    "linalg_eigh": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                    "(eigenvalues, eigenvectors) of a symmetric matrix"),
    "linalg_eigvalsh": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                        "eigenvalues of a symmetric matrix"),
    "linalg_qr": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "(Q, R)"),
    "qr": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "(Q, R)"),
    "ormqr": ("linalg", ("default",), lambda: [sample("default", T(4, 3), T(3), T(4, 2))], "multiply by geqrf's Q"),
    "linalg_householder_product": ("linalg", ("default",), lambda: [sample("default", T(4, 3), T(3))],
                                   "Q from Householder reflectors"),
    "linalg_svd": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "(U, S, Vh)"),
    "svd": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "(U, S, V)"),
    "linalg_svdvals": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "singular values"),
    "linalg_pinv": ("linalg", ("atol_rtol_float",), lambda: [sample("atol_rtol_float", T(4, 3))], "pseudo-inverse"),
    "pinverse": ("linalg", ("default",), lambda: [sample("default", T(4, 3))], "pseudo-inverse"),
    "matrix_power": ("linalg", ("default",), lambda: [sample("default", T(3, 3), 3)], "A^n"),
    "linalg_matrix_power": ("linalg", ("default",), lambda: [sample("default", T(3, 3), 2)], "A^n"),
    "lu_unpack": ("linalg", ("default",), lambda: [sample("default", T(3, 3), T(3, dtype=torch.int32, dist="ones"))], "(P, L, U) from an LU factorisation"),
    "_lu_with_info": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "(LU, pivots, info)"),
    "linalg_lu_factor_ex": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))],
                            "(LU, pivots, info)"),
    "linalg_lu": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"))], "(P, L, U)"),
    "lu_solve": ("linalg", ("default",), lambda: [sample("default", T(3, 2), T(3, 3, dist="spd"),
                                                         T(3, dtype=torch.int32, dist="ones"))],
                 "solve from an LU factorisation"),
    "linalg_lu_solve": ("linalg", ("default",), lambda: [sample("default", T(3, 3, dist="spd"),
                                                                T(3, dtype=torch.int32, dist="ones"), T(3, 2))],
                        "solve from an LU factorisation"),
    # windows, resampling, normalisation
    "upsample_nearest1d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _seq, [9], None)],
                           "nearest resampling (1-d)"),
    "upsample_nearest2d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, None, [2.0, 1.5]),
                                                                       sample("default", _img, [7, 3], 1.9, None)],
                           "nearest resampling (2-d)"),
    "upsample_nearest3d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _vol, [4, 5, 6], None)],
                           "nearest resampling (3-d)"),
    "_upsample_nearest_exact1d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _seq, [9], None)],
                                  "nearest-exact resampling (1-d)"),
    "_upsample_nearest_exact2d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, [7, 3], None)],
                                  "nearest-exact resampling (2-d)"),
    "_upsample_nearest_exact3d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _vol, [4, 5, 6], None)],
                                  "nearest-exact resampling (3-d)"),
    "upsample_linear1d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _seq, [9], False, None)],
                          "linear resampling (1-d)"),
    "upsample_bilinear2d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, [7, 8], True, None),
                                                                        sample("vec", _img, None, False, [1.5, 2.0]),
                                                                        sample("default", _img, [3, 9], True)],
                            "bilinear resampling"),
    "upsample_bicubic2d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, [7, 8], False, None)],
                           "bicubic resampling"),
    "upsample_trilinear3d": ("pool_static", ("vec", "default"), lambda: [sample("vec", _vol, [4, 5, 6], False, None)],
                             "trilinear resampling"),
    "_upsample_bilinear2d_aa": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, [3, 3], False, None)],
                                "antialiased bilinear resampling"),
    "_upsample_bicubic2d_aa": ("pool_static", ("vec", "default"), lambda: [sample("vec", _img, [3, 3], False, None)],
                               "antialiased bicubic resampling"),
    "avg_pool1d": ("pool_static", ("default",), lambda: [sample("default", _seq, [3], [2], [1])], "1-d average pool"),
    "avg_pool3d": ("pool_static", ("default",), lambda: [sample("default", _vol, [2, 2, 2])], "3-d average pool"),
    "max_pool1d": ("pool_static", ("default",), lambda: [sample("default", _seq, [3], [2], [1])], "1-d max pool"),
    "max_pool1d_with_indices": ("pool_static", ("default",), lambda: [sample("default", _seq, [2])],
                                "1-d max pool and argmax indices"),
    "max_pool3d": ("pool_static", ("default",), lambda: [sample("default", _vol, [2, 2, 2])], "3-d max pool"),
    "max_pool3d_with_indices": ("pool_static", ("default",), lambda: [sample("default", _vol, [2, 2, 2])],
                                "3-d max pool and argmax indices"),
    "adaptive_avg_pool3d": ("pool_static", ("default",), lambda: [sample("default", _vol, [2, 2, 2])],
                            "3-d adaptive average pool"),
    "adaptive_max_pool1d": ("pool_static", ("default",), lambda: [sample("default", _seq, [4])],
                            "1-d adaptive max pool and indices"),
    "adaptive_max_pool2d": ("pool_static", ("default",), lambda: [sample("default", _img, [3, 2])],
                            "2-d adaptive max pool and indices"),
    "adaptive_max_pool3d": ("pool_static", ("default",), lambda: [sample("default", _vol, [2, 2, 2])],
                            "3-d adaptive max pool and indices"),
    "max_unpool2d": ("pool_static", ("default",), lambda: [sample("default", T(1, 2, 2, 2), _i(1, 2, 2, 2, high=16),
                                                                  [4, 4])], "inverse of 2-d max pooling"),
    "max_unpool3d": ("pool_static", ("default",), lambda: [sample("default", T(1, 1, 2, 2, 2),
                                                                  _i(1, 1, 2, 2, 2, high=64), [4, 4, 4], [2, 2, 2],
                                                                  [0, 0, 0])], "inverse of 3-d max pooling"),
    "im2col": ("pool_static", ("default",), lambda: [sample("default", _img, [2, 2], [1, 1], [0, 0], [1, 1])],
               "sliding local blocks (unfold)"),
    "col2im": ("pool_static", ("default",), lambda: [sample("default", T(1, 8, 12), [4, 5], [2, 2], [1, 1], [0, 0],
                                                            [1, 1])], "sum of sliding local blocks (fold)"),
    "pixel_shuffle": ("shape", ("default",), lambda: [sample("default", T(1, 8, 2, 3), 2)], "depth to space"),
    "pixel_unshuffle": ("shape", ("default",), lambda: [sample("default", T(1, 2, 4, 6), 2)], "space to depth"),
    "channel_shuffle": ("shape", ("default",), lambda: [sample("default", T(1, 6, 2, 2), 3)], "channel shuffle"),
    "native_channel_shuffle": ("shape", ("default",), lambda: [sample("default", T(1, 6, 2, 2), 2)],
                               "channel shuffle"),
    "group_norm": ("norm_static", ("default",), lambda: [sample("default", T(2, 4, 3, 3), 2, T(4), T(4), 1e-5)],
                   "group normalisation"),
    "native_group_norm": ("norm_static", ("default",), lambda: [sample("default", T(2, 4, 3, 3), T(4), T(4), 2, 4, 9,
                                                                       2, 1e-5)], "(group norm, mean, rstd)"),
    "instance_norm": ("norm_static", ("default",), lambda: [sample("default", T(2, 3, 4, 4), T(3), T(3), None, None,
                                                                   True, 0.1, 1e-5, False)],
                      "instance normalisation (statistics of each sample)"),
    "rms_norm": ("norm_static", ("default",), lambda: [sample("default", _x3, [4], T(4), 1e-6)], "RMS normalisation"),
    "conv3d": ("conv_static", ("default", "padding"), lambda: [sample("default", _vol, T(3, 2, 2, 2, 2), T(3))],
               "3-d convolution"),
    "conv_transpose1d": ("conv_static", ("default",), lambda: [sample("default", _seq, T(3, 2, 3), T(2), [2], [1])],
                         "1-d transposed convolution"),
    "conv_transpose3d": ("conv_static", ("input",), lambda: [sample("input", _vol, T(2, 2, 2, 2, 2))],
                         "3-d transposed convolution"),
    "glu": ("shape", ("default",), lambda: [sample("default", T(3, 4), 1)], "a * sigmoid(b), halves along dim"),
    "prelu": ("elementwise_static", ("default",), lambda: [sample("default", T(2, 3, 4), T(3))],
              "x if x > 0 else weight * x, weight per channel"),
    "_prelu_kernel": ("elementwise_static", ("default",), lambda: [sample("default", T(2, 3, 4), T(3, 1))],
                      "PReLU's kernel"),
    "cosine_similarity": ("reduction", ("default",), lambda: [sample("default", _x, T(3, 5), 1)],
                          "cosine of the angle along dim"),
    "pairwise_distance": ("reduction", ("default",), lambda: [sample("default", _x, T(3, 5))], "p-norm of a - b"),
    "grid_sampler_2d": ("pool_static", ("default",), lambda: [sample("default", _img, T(1, 3, 3, 2, dist="unit"), 0, 0,
                                                                     False)], "sample an image at grid points"),
    "affine_grid_generator": ("shape", ("default",), lambda: [sample("default", T(2, 2, 3), [2, 1, 4, 5], False)],
                              "sampling grid of an affine map"),
    # losses
    "cross_entropy_loss": ("loss", ("default",), lambda: [sample("default", _x, _i(3, high=5)),
                                                           sample("default", _x, T(3, 5, dist="unit01"), None, 2,
                                                                  -100, 0.1)],
                           "cross entropy of logits (class indices or probabilities)"),
    "nll_loss": ("loss", ("default",), lambda: [sample("default", _x, _i(3, high=5))], "negative log likelihood"),
    "nll_loss_forward": ("loss", ("default",), lambda: [sample("default", _x, _i(3, high=5), None, 1, -100)],
                         "(negative log likelihood, total weight)"),
    "nll_loss2d_forward": ("loss", ("default",), lambda: [sample("default", _img, _i(1, 4, 5, high=2), None, 1, -100)],
                           "(2-d negative log likelihood, total weight)"),
    "mse_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), 2)], "mean squared error"),
    "l1_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5))], "mean absolute error"),
    "smooth_l1_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), 1, 0.5)], "smooth L1"),
    "huber_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), 1, 0.5)], "Huber loss"),
    "binary_cross_entropy": ("loss", ("default",), lambda: [sample("default", T(3, 5, dist="unit01"),
                                                                   T(3, 5, dist="unit01"))], "binary cross entropy"),
    "binary_cross_entropy_with_logits": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5, dist="unit01"))],
                                         "binary cross entropy of logits"),
    "kl_div": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5, dist="unit01"), 1, log_target=False)],
               "Kullback-Leibler divergence"),
    "soft_margin_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5))], "soft margin loss"),
    "margin_ranking_loss": ("loss", ("default",), lambda: [sample("default", T(4), T(4), T(4), 0.5)],
                            "margin ranking loss"),
    "hinge_embedding_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), 1.0)],
                             "hinge embedding loss"),
    "poisson_nll_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5, dist="pos"), True, False, 1e-8,
                                                               1)], "Poisson negative log likelihood"),
    "cosine_embedding_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), T(3))],
                              "cosine embedding loss"),
    "triplet_margin_loss": ("loss", ("default",), lambda: [sample("default", _x, T(3, 5), T(3, 5))],
                            "triplet margin loss"),
    "multilabel_margin_loss": ("loss", ("default",), lambda: [sample("default", _x, _i(3, 5, high=5), 1)],
                               "multi-label margin loss"),
    "multilabel_margin_loss_forward": ("loss", ("default",), lambda: [sample("default", _x, _i(3, 5, high=5), 1)],
                                       "(multi-label margin loss, is_target)"),
    "multi_margin_loss": ("loss", ("default",), lambda: [sample("default", _x, _i(3, high=5))], "multi-class margin"),
    "frexp": ("elementwise_static", ("Tensor",), lambda: [sample("Tensor", _x)], "(mantissa, exponent)"),
    "_softmax_backward_data": ("reduction", ("default",), lambda: [sample("default", _x, T(3, 5), 1, torch.float32)],
                               "softmax's gradient"),
    "_log_softmax_backward_data": ("reduction", ("default",), lambda: [sample("default", _x, T(3, 5), 1,
                                                                              torch.float32)],
                                   "log-softmax's gradient"),
    "quantile": ("reduction", ("default", "scalar"), lambda: [sample("scalar", _x, 0.3, 1)], "q-th quantile"),
    "nanquantile": ("reduction", ("default", "scalar"), lambda: [sample("scalar", _x, 0.6)], "quantile ignoring NaN"),
    "renorm": ("reduction", ("default",), lambda: [sample("default", _x, 2, 0, 1.0)],
               "sub-tensors rescaled to a max p-norm"),
    "float_power": ("elementwise_static", ("Tensor_Tensor", "Tensor_Scalar", "Scalar"),
                    lambda: [sample("Tensor_Tensor", T(3, 4, dist="pos"), T(4))], "a ** b in float64"),
    "vander": ("shape", ("default",), lambda: [sample("default", T(4), 3)], "Vandermonde matrix"),
    "trapezoid": ("reduction", ("x", "dx"), lambda: [sample("dx", _x, dx=0.5, dim=1)], "trapezoid rule along dim"),
    "cumulative_trapezoid": ("reduction", ("x", "dx"), lambda: [sample("dx", _x)], "cumulative trapezoid rule"),
    "cartesian_prod": ("shape", ("default",), lambda: [sample("default", [T(2), T(3)])], "cartesian product"),
}
# kinds the padding analysis has no rule for (its `elementwise`, `conv` and `pool` rules would apply)
_STATIC_KINDS = {"elementwise_static": "misc", "gemm_static": "linalg", "pool_static": "window",
                 "norm_static": "norm", "conv_static": "window"}

for _name, (_kind, _ovl, _samples, _doc) in STATIC.items():
    _checked(_name, _ovl)
    _shapes = ("static shapes, or dynamic sizes to a fixed size or by a scale whose double is k/16"
               if "upsample" in _name else "dynamic sizes where each output size is an input's")
    _register(_name, _STATIC_KINDS.get(_kind, _kind), _ovl, _samples, f"{_doc} (ATen {_name}; {_shapes})",
              _static_infer, (0, 8))
