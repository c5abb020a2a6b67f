"""Floor 6, measuring: bench (the prompt suite against the real server, with and without the draft) and
tune (the search over the speculative settings), their chart and baseline. Imports the floors below."""
