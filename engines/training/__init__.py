"""The training engines: the actor (``actor``; ZeRO in ``actor_deepspeed``) and the critic (``critic``) on the shared
mini-batch loop (``batching``), model inputs and forwards (``forward``), the pickle-free trainer state
(``checkpoint``) and the supervised warm start (``sft``).
"""
