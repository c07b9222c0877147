"""Names of the stages and of their artifacts' main files."""

STAGES = ("data_prep", "rollout", "reward", "advantage", "critic", "update", "eval")

# The Parquet file each stage commits (the update stage also commits a model directory).
STAGE_FILES = {
    "rollout": "rollouts.parquet",
    "reward": "rewards.parquet",
    "advantage": "experience.parquet",
    "critic": "metrics.parquet",
    "update": "metrics.parquet",
    "eval": "eval.parquet",
}
