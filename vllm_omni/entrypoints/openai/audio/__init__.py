"""The audio APIs (``/v1/audio/...``): encoding.py turns samples into each of OpenAI's six audio formats, at once or as
a stream."""
