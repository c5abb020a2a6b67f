"""Floor 4, what runs as the server: the launcher (llama-server under systemd), sd_notify, the server's HTTP
API. Imports the floors below."""
