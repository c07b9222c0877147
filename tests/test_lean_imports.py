"""engines/lean_imports.py: a process that loads a model skips scikit-learn, which still imports when asked."""

import subprocess
import sys

PROBE = """
import sys
import rlstage.engines
from transformers import LlamaForCausalLM
import transformers.generation.candidate_generator as generation
print("sklearn" in sys.modules, hasattr(generation, "roc_curve"))
import sklearn.metrics
print(sklearn.metrics.roc_curve.__name__)
"""


def test_loading_a_model_imports_no_scikit_learn_and_a_user_still_can():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "roc_curve"]
