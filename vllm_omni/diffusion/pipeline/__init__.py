"""The pipeline call: the runner and the extensions around it."""
