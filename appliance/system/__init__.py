"""Floor 0, the operating system: where the appliance lives on a machine (paths). Imports nothing of the
appliance."""
