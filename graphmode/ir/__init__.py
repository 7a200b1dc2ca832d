"""The graphmode IR: typed values, immutable nodes, the core op set, text/JSON forms,
verifier and reference interpreter."""
from graphmode.ir.graph import Graph, Node, clean_name
from graphmode.ir.interpreter import bind_dims, interpret
from graphmode.ir.ops import OPS, OpSpec, get_op
from graphmode.ir.parser import parse_graph, parse_type
from graphmode.ir.printer import print_graph
from graphmode.ir.serialize import graph_from_json, graph_to_json, load_graph, save_graph
from graphmode.ir.types import DTYPES, TensorType, Value, dim_str, eval_dim, normalize_dim, sym
from graphmode.ir.verifier import verify_graph

__all__ = ["Graph", "Node", "clean_name", "bind_dims", "interpret", "OPS", "OpSpec", "get_op", "parse_graph",
           "parse_type", "print_graph", "graph_from_json", "graph_to_json", "load_graph", "save_graph", "DTYPES",
           "TensorType", "Value", "dim_str", "eval_dim", "normalize_dim", "sym", "verify_graph"]
