"""Floor 6, a fleet of appliances behind HAProxy: the fleet file (model, loading with located problems, the
checks across hosts), each host's spec as the fleet derives it, and the fleet's own files (haproxy.cfg,
Prometheus file_sd targets, scrape jobs, rules). Imports the floors below: spec loading, validate and
resolve, the render pipeline."""
