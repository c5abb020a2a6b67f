"""Floor 6, measuring: bench (the prompt suite against the real server, with and without the draft) and
tune (the search over the speculative settings), their chart and baseline. Imports the floors below.

Within it, each module imports only those above it in this list:
  config   a server configuration and the one mapping between it and the spec; the errors
  suite    the prompt suite, the long-context document, the requests (`Prepared`)
  server   a llama-server of its own for one configuration (`TempServer`), /proc sampling
  progress what a long measurement shows meanwhile: a line per sample, the count, the time left
  measure  the measurement of one configuration: the SSE client, samples, statistics
  search   tune's search, pure (a measurement is handed in)
  report   the bench table and JSON, the tune report, the baseline file, `tune --write`'s rewrite
  chart    the bench chart (PNG)
  bench    `llm-appliance bench`: glue
  tune     `llm-appliance tune`: glue
"""
