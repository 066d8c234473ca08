"""The pipeline call: loading a diffusers pipeline, the runner, the extensions around its call, its components,
inputs, timings and output checks."""
