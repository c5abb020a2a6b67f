"""Floor 0, the operating system: where the appliance lives on a machine (paths), the one way to run a
command (run) and the one way to write a file (files). Imports nothing of the appliance."""
