"""Engine: `AsyncOmniEngine` routes requests to one `StageRuntime` per stage."""
