"""Floor 3, the spec resolved against the facts: the exact argv, the memory budget, warnings (plan, pure);
validate, the one place that reads model files and probes the machine for it; and resolved, the Appliance
every later floor reads, and its JSON snapshot. Imports the floors below."""
