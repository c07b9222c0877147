"""engines/lean_imports.py: a process that loads and saves a model imports neither scikit-learn nor DeepSpeed,
and both still import, and work, when asked."""

import subprocess
import sys

PROBE = """
import sys, tempfile
import rlstage.engines
from transformers import LlamaConfig, LlamaForCausalLM
import transformers.generation.candidate_generator as generation
model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
model.save_pretrained(tempfile.mkdtemp())
print("sklearn" in sys.modules, hasattr(generation, "roc_curve"), "deepspeed" in sys.modules)
import sklearn.metrics
from accelerate.utils.other import extract_model_from_parallel
import deepspeed
print(sklearn.metrics.roc_curve.__name__, extract_model_from_parallel(model) is model)
"""


def test_loading_and_saving_a_model_imports_no_scikit_learn_nor_deepspeed_and_a_user_still_can():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "roc_curve", "True"]
