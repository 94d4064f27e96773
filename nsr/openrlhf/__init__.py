"""Adapter of the NSR objectives into OpenRLHF 0.11.2 (the only package here that imports openrlhf)."""
