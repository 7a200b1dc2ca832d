"""Recipes: a typed, versioned, statically verified contract for one deployment.

    recipe = load_recipe("examples/recipes/minilm_cpu.yaml")       # layer 1: schema
    report = validate(recipe, target)                                # layers 2 and 3
    report.raise_for_errors()        # RecipeErrors (exit 2) or ConstraintError (exit 1)

Modules, each importing only modules listed before it (never this package's names):
  limits (dtype tables, documented ranges), lines (field paths -> YAML lines),
  hashing (content hash), symbolic (`${...}` values), buckets (synthesis, per-recipe views),
  schema (pydantic: the recipe as data), loader (YAML -> Recipe, field-level errors),
  resolve (bind target-relative values), diff (diff, merge), facts (ModelFacts),
  smt (sympy -> Z3), constraints (proofs), semantics (cross-field rules),
  targets (which target a recipe is checked on), validate (the three layers, one report).
"""
from graphmode.recipe.buckets import Synthesis, synthesize_buckets
from graphmode.recipe.constraints import ConstraintModel, Proof, build_constraint_model, prove_all
from graphmode.recipe.diff import Change, diff_recipes, merge_recipes
from graphmode.recipe.facts import ModelFacts, dim_symbol, dim_symbols, estimate_facts, kv_cache_bytes
from graphmode.recipe.hashing import recipe_hash
from graphmode.recipe.loader import load_recipe, parse_yaml
from graphmode.recipe.resolve import resolve
from graphmode.recipe.schema import Recipe
from graphmode.recipe.semantics import Environment, check_semantics, detect_environment
from graphmode.recipe.targets import pick_target
from graphmode.recipe.validate import ValidationReport, validate

__all__ = ["Recipe", "load_recipe", "parse_yaml", "resolve", "validate", "ValidationReport", "recipe_hash",
           "diff_recipes", "merge_recipes", "Change", "synthesize_buckets", "Synthesis", "ModelFacts",
           "estimate_facts", "kv_cache_bytes", "dim_symbol", "dim_symbols", "ConstraintModel",
           "build_constraint_model", "prove_all", "Proof", "check_semantics", "Environment",
           "detect_environment", "pick_target"]
