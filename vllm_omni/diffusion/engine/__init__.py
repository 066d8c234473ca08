"""One replica's engine loop: requests, batch scheduler, request and step modes, control verbs."""
