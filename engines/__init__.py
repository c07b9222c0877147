"""The compute of rlstage, free of Prefect: algorithms, models, rollout, rewards, training."""

from rlstage.engines import lean_imports

lean_imports.install()
