"""Floor 6, provisioning: install/uninstall, who owns what under /var/lib/llm-appliance (layout), the engine
build, the demo models. Imports the floors below."""
