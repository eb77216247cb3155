"""omni-pipeline's monitoring mixin: alert rules and Grafana dashboards from one source.

Like the kubernetes-mixin, everything a Prometheus or Grafana user installs is generated
from this package by ``monitoring/generate.py`` and committed; ``--check`` fails when a
committed file is stale.
"""
