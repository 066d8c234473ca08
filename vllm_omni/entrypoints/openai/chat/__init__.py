"""Chat completions of a diffusion model: an adapter onto the Images and Videos APIs."""
