"""Floor 3, files from a plan: render (pure, jinja2, {path: text}) and apply (writes them under a root,
reports what changed, reloads what must). Imports the floors below."""
