"""Test harness shipped with the package: the seeded fuzzer (``fuzz.py``) and the corpus of bad
inputs (``corpus.py``) the reliability tests run, usable from the command line too."""
