"""Floor 0, the operating system: where the appliance lives on a machine (paths), the one way it runs
another program (run) and the one way it writes a file (files). Imports nothing of the appliance."""
