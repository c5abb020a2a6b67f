"""Floor 3, the spec resolved against the facts. Pure: devices (which GPUs each model uses, whether the draft
is in use), budget (memory per GPU), argv (the command line in the binary's dialect), plan (all three and
the warnings); validate, the one place that reads model files and probes the machine for them, with the key
files checked as their readers read them (secrets); resolved, the Appliance every later floor reads, and its
JSON snapshot. Imports the floors below."""
