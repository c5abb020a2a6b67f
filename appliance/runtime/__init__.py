"""Floor 4, what runs as the service: the launcher (llama-server under systemd), sd_notify, the server's
HTTP API, and the entry points of the units and of `up`. Imports the floors below and health."""
