"""Runtime contract monitoring: probes, health score, SLA drift and Prometheus metrics.

    from graphmode.monitor import monitored
    model = monitored(graphmode.compile(bundle, recipe), metrics=True)
    model(**inputs); model.metrics()["contract"]; model.monitor.metrics.text()
"""
from graphmode.monitor.contract import ContractMonitor, MonitoredModel, attach, bucket_label, monitored
from graphmode.monitor.drift import (DriftEvent, Renegotiator, SlaDriftProbe, SlaTarget, TokenBucket, quantile,
                                     sla_bounds, sla_target, window_misses)
from graphmode.monitor.prom import VIOLATION_KINDS, PromMetrics

__all__ = ["ContractMonitor", "MonitoredModel", "attach", "monitored", "bucket_label", "PromMetrics",
           "VIOLATION_KINDS", "SlaDriftProbe", "SlaTarget", "sla_bounds", "sla_target", "window_misses", "DriftEvent",
           "TokenBucket",
           "Renegotiator", "quantile"]
