"""Floor 6, provisioning: install/uninstall, the engine build, the demo models. Imports the floors below."""
