"""Settings shared by the integration tests: a run of the tiny kit that takes seconds."""


def tiny_overrides() -> list[str]:
    return [
        "kit.train_size=400",
        "kit.test_size=40",
        "kit.hidden_size=32",
        "kit.num_layers=1",
        "kit.num_heads=2",
        "kit.intermediate_size=64",
        "sft.steps=20",
        "sft.batch_size=32",
        "sft.target_accuracy=null",
        "data.prompts_per_iteration=8",
        "rollout.n=4",
        "rollout.batch_size=64",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=8",
        "trainer.iterations=2",
        "tracking.rollout_sample_rows=4",
    ]
