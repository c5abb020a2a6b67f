"""Floor 2, the spec resolved against the facts: the exact argv, the memory budget, warnings (plan, pure),
and validate, the one place that reads model files and probes the machine for it. Imports the floors below."""
