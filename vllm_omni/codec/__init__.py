"""Speech on a codec: the family table (`families.py`: each codec-token TTS family's prompt format, code layout,
voices, chunk sizes and sampling defaults, in one place) and the codec's decoder (`pipeline/`)."""
