"""The prompts: data sources and their registry (``datasets``), which prompts an iteration trains on (``cursor``) and
DAPO's dynamic sampling of groups (``dynamic_sampling``).
"""
