"""The replica health check's failure type (cluster.serving.ingress.model_group_health), on real Ray actors.

Serve's controller reads a RayActorError raised by a replica's check_health as the replica's
own crash and replaces it at once, dropping every request in flight on it. A dead model worker
reaches the check as exactly that error (the coordinator's call to it failed); the check must
turn it into a plain failure, which counts toward the failure threshold instead.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving.ingress import ModelGroupUnhealthy, model_group_health


def _actors():
    import ray

    @ray.remote(num_cpus=0)
    class Member:
        def ping(self) -> bool:
            return True

    @ray.remote(num_cpus=0)
    class Group:
        def __init__(self, member):
            self.member = member

        async def health(self) -> bool:
            await self.member.ping.remote()
            return True

    return Member, Group


def test_a_dead_worker_fails_the_check_without_a_ray_actor_error(ray_session):
    import ray
    from ray.exceptions import RayActorError

    member_cls, group_cls = _actors()
    member = member_cls.remote()
    group = group_cls.remote(member)
    asyncio.run(model_group_health(group.health.remote(), 30))  # healthy: no error
    ray.kill(member, no_restart=True)
    with pytest.raises(RayActorError):  # what Serve would see without the conversion
        ray.get(group.health.remote(), timeout=30)
    with pytest.raises(ModelGroupUnhealthy, match="model group health check failed") as raised:
        asyncio.run(model_group_health(group.health.remote(), 30))
    assert not isinstance(raised.value, RayActorError)
    ray.kill(group)


def test_a_check_that_does_not_answer_in_time_fails(ray_session):
    async def never() -> None:
        await asyncio.sleep(60)

    async def check() -> None:
        await model_group_health(asyncio.ensure_future(never()), 0.1)

    with pytest.raises(ModelGroupUnhealthy, match="TimeoutError"):
        asyncio.run(check())
