"""A loaded diffusers pipeline: loading and running it, its components, inputs, timings, output checks."""
