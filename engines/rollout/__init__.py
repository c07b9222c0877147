"""The rollout engines: Hugging Face ``generate`` (``hf``, with the ``SamplingParams`` / ``Completion`` contract),
vLLM (``vllm_engine``; the plugin vLLM's own processes load, ``vllm_plugin``) and the registry a config names them
by (``engines``: ``rollout.engine``).
"""
