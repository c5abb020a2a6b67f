"""Floor 2, what the machine and the model files say: GGUF headers, vocabularies, the llama-server flag
dialect, NVML, gathered into MachineFacts; and API key files as llama-server and Prometheus read them (keys).
Imports system and spec."""
