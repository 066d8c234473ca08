"""The OpenAI-compatible HTTP server: the shared serving base here, one folder per API (images/, videos/, chat/) and
the operator's routes (admin/)."""
