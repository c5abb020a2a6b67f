"""Floor 2, what the machine and the model files say: GGUF headers, vocabularies, the llama-server flag
dialect, NVML, gathered into MachineFacts. Imports system and spec."""
