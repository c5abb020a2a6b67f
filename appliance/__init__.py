"""llm-appliance: one TOML spec to a hardened, speculative-decoding llama-server service."""

__version__ = "0.1.0"
