"""Reading models from disk: Hugging Face checkpoint directories (safetensors, .bin), GGUF files,
dummy weights, and tokenizer and chat-template files, each checked before use."""
