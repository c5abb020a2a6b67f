"""Floor 0, the operating system: where the appliance lives on a machine (paths), the one way to run a
command (run), the one way to write a file (files), and the service user (users: what it could change or
read, and dropping to it); and the names every floor above shares with the outside, beside the paths: the
health daemon's metric names (metric_names). Imports nothing of the appliance above it."""
