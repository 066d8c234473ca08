"""A codec stage's model: the codec loaded by family (`codecs.py`: SNAC, XCodec2) and its batched, deterministic
decode of code windows."""
