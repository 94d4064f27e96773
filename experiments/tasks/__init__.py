"""Tasks shared by the backends: countdown (the CPU testbed's synthetic tasks and their exact verifier)."""
