"""Floor 4, files from the resolved appliance: render (pure, jinja2, {path: text}), check (the tools that
read them, on a private copy, before anything is written) and apply (writes them under a root, reports what
changed, reloads what must). Imports the floors below."""
