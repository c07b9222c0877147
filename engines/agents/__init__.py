"""Multi-turn tool calling: the per-request state machine (``loop``), the policies that generate its turns
(``policies``) and the tools, their registry and the calculator (``tools``).
"""
