"""Data: tokenizers, text loaders that pack documents into training sequences, and the long-range tasks.

Submodules load on demand (`from piattn.data import listops`), so importing one task costs nothing else.
"""
