"""Floor 7, the `llm-appliance` command: parses arguments and calls the floors below; nothing imports it."""
