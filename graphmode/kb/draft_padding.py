"""How a draft settles padding: a dim unsafe to pad gets exact buckets or an eager fallback, and
one padded safely by masking along a query x key mask sends masked requests off a bucket to
eager (graphmode/kb/draft.py drafts the rest of the recipe)."""
from __future__ import annotations

from typing import Any, Callable

MAX_EXACT = 64                 # an unsafe-to-pad dim gets every value as a bucket up to this many values
MAX_EXACT_PLANS = 64           # ... and at most this many where a dim unsafe to pad takes every value
EXACT_PLANS = 16               # past it: values of such a dim that recur become plans (dims.D.exact_plans)


def settle_padding(data: dict, notes: dict, load: Callable[[dict], Any], graph: Any, cap: Any, src: Any,
                   ranges: dict[str, tuple[int, int]]) -> Any:
    """Decide the draft with the verdict; a dim whose padding is unsafe gets exact buckets
    (or on_violation: eager when it has more than MAX_EXACT values, more than the dim's
    max_buckets (`recipe init --max-buckets`), or when the draft would hold more than
    MAX_EXACT_PLANS plans: a CNN's h and w, 54 values each, made 5,832 plans for warm-up to
    build, and a MoE LM's batch 1-4 x seq 1-63, 252 plans a tensor-parallel group built at start;
    then its values that recur become plans). `load` makes the draft's data a recipe. Returns
    the verdict."""
    from graphmode.verdict import ContractRefused, decide
    for _ in range(2):
        v = decide(load(data), graph, cap, src, data["exe_mode"])
        unsafe = [i for i in v.refusals if i.kind == "padding"]
        other = [i for i in v.refusals if i.kind != "padding"]
        if other:
            raise ContractRefused(other)
        if not unsafe:
            _query_key_eager(data, notes, v)
            return v
        for issue in unsafe:
            d = issue.where.split(".", 1)[1]
            lo, hi = ranges[d]
            at = f" ({issue.loc})" if issue.loc else ""
            reason = issue.message.split(": ", 1)[-1]
            plans = len(load(data).buckets()) // len(load(data).dim_buckets()[d])
            values, most = hi - lo + 1, data["dims"][d].get("max_buckets")
            if values <= min(MAX_EXACT, most or MAX_EXACT) and plans * values <= MAX_EXACT_PLANS:
                data["dims"][d] = {"min": lo, "max": hi}
                notes[f"dims.{d}"] = (notes[f"dims.{d}"].split("; ")[0] + f"; every value a bucket ({values} "
                                      f"plans): padding {d} is unsafe for this model: {reason}{at}")
            else:       # the buckets the draft chose, refined by the values requests send
                data["on_violation"] = "eager"
                data["dims"][d] = {**data["dims"][d], "exact_plans": EXACT_PLANS}
                why = (f"[{lo}, {hi}] has too many values for exact buckets" if values > MAX_EXACT else
                       f"[{lo}, {hi}] has more values than its max_buckets {most}" if most and values > most else
                       f"every value of [{lo}, {hi}] a bucket would make {plans * values} plans")
                notes["on_violation"] = (f"padding {d} is unsafe for this model ({reason}{at}), and {why}: requests "
                                         f"off a bucket run eagerly, and up to {EXACT_PLANS} values of {d} that recur "
                                         f"become plans of their own (dims.{d}.exact_plans)")
    raise ContractRefused(v.refusals)


def _query_key_eager(data: dict, notes: dict, verdict: Any) -> None:
    """A dim padded safely by masking along which the model builds a query x key mask from its
    mask (DeBERTa's, a causal triangle under a softmax written out): a request whose mask holds a
    pad value there and whose extent is not a bucket is not padded (runtime/shaping.py
    pad_hazard). A draft that refused it refused the most common request there is, a tokenizer's
    padded batch: such requests run eagerly instead, and lengths that recur get plans."""
    dims = data.get("dims") or {}
    qk = [d for d in getattr(verdict, "query_key_dims", None) or [] if d in dims and set(dims[d]) != {"min", "max"}]
    if data.get("on_violation") == "eager":
        return
    if not qk:
        _whole_row_eager(data, notes, verdict)
        return
    data["on_violation"] = "eager"
    d = qk[0]
    for q in qk:          # a tokenizer's padded batches at a length that recurs: a plan of its own, unpadded
        dims[q] = {**dims[q], "exact_plans": dims[q].get("exact_plans") or EXACT_PLANS}
    notes["on_violation"] = (f"padding {d} is safe by masking, but this model builds a query x key mask from its "
                             f"mask: a request whose mask holds its pad value and whose {d} is not a bucket value "
                             "runs eagerly (padding could change its padded positions' outputs), until that value "
                             f"recurs: up to {EXACT_PLANS} values of {d} become plans of their own (dims.{d}."
                             "exact_plans); unmasked requests and bucket values run in graph mode")


def _whole_row_eager(data: dict, notes: dict, verdict: Any) -> None:
    """A dim padded safely by masking: a request whose mask hides a whole row (an empty text in a
    tokenizer's batch) is not padded, since that row's outputs read its padding. A draft with
    on_violation: error refused that ordinary batch at every length off a bucket (trial Y: ELECTRA,
    ALBERT, MPNet, XLM-R, T5); it runs eagerly instead, every other request in graph mode."""
    dims = data.get("dims") or {}
    masked = [d for d in getattr(verdict, "masked_dims", None) or [] if d in dims and set(dims[d]) != {"min", "max"}]
    if not masked:
        return
    data["on_violation"] = "eager"
    d = masked[0]
    notes["on_violation"] = (f"padding {d} is safe by masking, but a request whose mask hides a whole row (an empty "
                             f"text in a batch) and whose {d} is not a bucket value runs eagerly (that row's outputs "
                             "would read its padding); every other request runs in graph mode")
