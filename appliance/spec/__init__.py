"""Floor 1, the spec as written: the pydantic model and its constants, TOML loading with line numbers,
located problems and the checks that need only the spec. Imports system."""
