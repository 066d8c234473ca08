"""One pipeline call on several ranks: the rank group, CFG-parallel, VAE patch parallel."""
