"""Public entry points: `Omni`, `AsyncOmni` and the command line."""
