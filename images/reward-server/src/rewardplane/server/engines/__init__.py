"""The engines that run the model (transformers, vLLM) and what the server needs of them."""
