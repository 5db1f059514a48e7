"""The text path: RLVR for causal language models through the same core (docs/text.md)."""
