"""The health daemon: probes, detectors, restart policy and the Prometheus exporter (issue 4)."""
