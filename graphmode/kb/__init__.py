"""The knowledge base: every measurement, recorded against recipe, model and hardware.

    store        the SQLite file (schema, migrations, concurrent writers, export / import)
    fingerprint  hardware and model fingerprints, and how alike two of them are
    measure      p50 / p99 / P99/P50, plan memory, and the recipe's contract applied to them
    record       what bench, profile, verify, tune and serve write (`record`, `ServeRecorder`)
    recommend    the best measured recipe for a model on a target
    draft        `recipe init` / `graphmode.compile(model)`: a recipe for a model without one
    render       recipe YAML with a comment saying where each value came from
"""
from graphmode.kb.store import KbError, KnowledgeBase

__all__ = ["KbError", "KnowledgeBase"]
