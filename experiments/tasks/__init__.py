"""Tasks shared by several backends (layout: countdown for the CPU testbed, arithmetic for the real model)."""
