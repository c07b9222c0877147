"""Rewards: the rule-based reward functions, their registry and the sandboxed scorer (``rules``), and learned
rewards, a reward model or a scoring endpoint (``reward_model``).
"""
