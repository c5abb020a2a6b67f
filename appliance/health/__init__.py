"""Floor 4, the health daemon: probes, pure detectors, the restart policy, the exporter, the versions.
Imports the floors below and runtime's notify and server API."""
