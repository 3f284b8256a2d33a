"""Bridges to other libraries. Each submodule imports its library itself: `piattn.integrations.hf` needs
transformers (the `hf` extra)."""
