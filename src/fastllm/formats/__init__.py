"""Model files: safetensors checkpoints (read and written without the
safetensors package) and llama.cpp GGUF files, imported as HF folders."""
