"""The policy model as the trainers and the rollout engines both hold it: the tiny kit (``tinykit``: a character
tokenizer and a tiny Llama), the tokenizer and its chat template (``chat``), LoRA adapters (``lora``) and where a
model's weights are (``device``).
"""
