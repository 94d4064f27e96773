"""Policies shared by several backends (layout: the testbed's tiny models, the toy Qwen2, SmolLM2)."""
