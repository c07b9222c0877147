"""The rollout engines: the interface every one implements and the records it takes and returns (``base``:
``RolloutEngine``, ``SamplingParams``, ``Completion``), Hugging Face ``generate`` (``hf``), vLLM (``vllm_engine``; the
plugin vLLM's own processes load, ``vllm_plugin``) and the registry a config names them by (``engines``:
``rollout.engine``).
"""
