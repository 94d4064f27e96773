"""Rewards shared by the backends: math (the ``\boxed{}`` answer checked by math-verify; OpenRLHF loads the file by
path)."""
