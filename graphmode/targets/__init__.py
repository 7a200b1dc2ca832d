"""Hardware targets: description files, the registry, `host` detection, the roofline cost model."""
from graphmode.targets.cost import (Calibration, OpCost, OpPrediction, Prediction, arithmetic_intensity,
                                    elementwise_cost, matmul_cost, predict_op, predict_op_seconds,
                                    predict_seconds, ridge_point)
from graphmode.targets.registry import (bank_ids, check_target, get_target, list_targets, load_target_file,
                                        resolve_group, target_from_dict)
from graphmode.targets.schema import Target

__all__ = ["Calibration", "OpCost", "OpPrediction", "Prediction", "Target", "arithmetic_intensity",
           "bank_ids", "check_target", "elementwise_cost", "get_target", "list_targets", "load_target_file",
           "matmul_cost", "predict_op", "predict_op_seconds", "predict_seconds", "resolve_group",
           "ridge_point", "target_from_dict"]
