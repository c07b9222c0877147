"""Each worker class implements its roles (workers/roles.py) with the same signatures, and a group call names
a role's method, so a misspelt one fails where the stage names it, before any Ray call."""

from __future__ import annotations

import inspect

import pytest

from rlstage.workers import roles
from rlstage.workers.policy import PolicyWorker
from rlstage.workers.rollout import RolloutWorker


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    names = {n for klass in protocol.__mro__ if klass.__module__ == roles.__name__ for n, v in vars(klass).items() if inspect.isfunction(v) and not n.startswith("_")}
    return {n: inspect.signature(getattr(protocol, n)) for n in names}


@pytest.mark.parametrize(("worker", "role"), [(PolicyWorker, roles.Trainer), (RolloutWorker, roles.Rollout)])
def test_a_worker_implements_its_role(worker, role):
    for name, declared in _methods(role).items():
        assert hasattr(worker, name), f"{worker.__name__} lacks {role.__name__}.{name}"
        got = inspect.signature(getattr(worker, name))
        # ray.remote(cls) adds a tracing keyword to the class's own methods: not part of the role
        got = got.replace(parameters=[p for p in got.parameters.values() if not p.name.startswith("_ray")])
        assert list(got.parameters) == list(declared.parameters), (name, got, declared)
        assert [p.default for p in got.parameters.values()] == [p.default for p in declared.parameters.values()], name


def test_a_group_call_names_a_role_method():
    assert roles.method_name(roles.Trainer.log_probs) == "log_probs"
    with pytest.raises(AttributeError):
        roles.Trainer.log_prob  # noqa: B018  a misspelling fails here, not in a Ray actor
    with pytest.raises(TypeError, match="not a method of a role"):
        roles.method_name(PolicyWorker.log_probs)
