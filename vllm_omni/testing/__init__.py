"""Test and demo helpers that ship with the package (tiny offline models)."""
