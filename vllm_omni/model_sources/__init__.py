"""Model sources made local on the driver: the one diffusers folder every stage and replica loads."""
