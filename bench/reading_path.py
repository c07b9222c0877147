"""The lines a newcomer reads to follow one training iteration end to end, counted from the source.

The path is declared once here (PATH: each file and the symbols on it, ``Class.method`` for one method, None for the
whole file); docs/concepts.md's reading list names the same files (tests/docs/test_docs.py checks it).
A symbol's lines run from its first decorator to its last line, comments and docstrings included.

    python bench/reading_path.py          # the table, and the total
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# In reading order: the loop, the stages' contracts, their bodies, how they run, the math.
PATH: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("flows/iteration.py", None),
    (
        "schemas/stages.py",
        ("StageInputs", "RolloutInputs", "RewardInputs", "FilterGroupsInputs", "AdvantageInputs", "CriticInputs",
         "UpdateInputs", "EvalInputs", "StageSpec", "SPECS"),
    ),  # fmt: skip
    (
        "tasks/stages.py",
        ("StageOutput", "run_stage", "execute", "data_prep", "rollout", "generate_round", "_complete", "reward",
         "score_round", "filter_groups", "_forwards", "advantage", "critic_update", "hold_policy", "update", "evaluate"),
    ),  # fmt: skip
    (
        "flows/training.py",
        ("StageTasks.__init__", "StageTasks.__call__", "StageTasks.ahead", "iteration_flow", "run_training", "_run_iterations"),
    ),
    ("engines/experience.py", ("Samples", "line_up", "Forwards", "Experience", "compute_experience")),
    ("engines/training/actor.py", ("TorchActor.update", "TorchActor._with_is_weights", "TorchActor._micro_step")),
)


# Read beside the path when one wants it: which actor serves a call (the stage bodies name the role's method).
BESIDE: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    (
        "workers/group.py",
        ("PolicyGroup.call", "PolicyGroup.call_all", "PolicyGroup.acquire", "PolicyGroup.acquire_rollout",
         "PolicyGroup.generate_ids", "PolicyGroup.update", "PolicyGroup.commit"),
    ),  # fmt: skip
)


def _nodes(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        out[f"{node.name}.{sub.name}"] = sub
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def _span(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def measure(path=PATH, root: Path = ROOT) -> list[tuple[str, int]]:
    """Each file of ``path`` and the lines of it a reader follows."""
    rows = []
    for rel, symbols in path:
        source = (root / rel).read_text()
        if symbols is None:
            rows.append((rel, len(source.splitlines())))
            continue
        nodes = _nodes(ast.parse(source))
        missing = [s for s in symbols if s not in nodes]
        if missing:
            raise SystemExit(f"bench/reading_path.py: {rel} has no {', '.join(missing)} (update PATH)")
        rows.append((rel, sum(_span(nodes[s]) for s in symbols)))
    return rows


def main() -> int:
    rows = measure()
    for rel, n in rows:
        print(f"{n:>6}  {rel}")
    print(f"{sum(n for _, n in rows):>6}  in {len(rows)} files")
    for rel, n in measure(BESIDE):
        print(f"{n:>6}  {rel} (beside the path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
