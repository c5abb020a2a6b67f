"""Floor 5, the health daemon: probes, pure detectors, the restart policy, the exporter, the versions; and the
entry points of the units and of `up` (service), which started by root become the service user first
(privileges). Imports the floors below (runtime's notify, server API and launcher; render, to compare the
applied ruleset)."""
