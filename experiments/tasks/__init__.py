"""Tasks shared by the backends: countdown (the CPU testbed's synthetic tasks and their exact verifier) and arithmetic
(the real model's generated arithmetic, scored by the kit's math reward)."""
