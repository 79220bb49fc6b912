"""Names and the registry: names survive restarts; every task of a tree sees the tree's
registry."""

from __future__ import annotations

from typing import Any

import pytest

from actors import Actor, NameTaken, Registry, current_registry
from supervisors import (
    ChildSpec,
    ChildStartFailed,
    Restart,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import crash, worker_spec

FLAGS = SupervisorFlags(intensity=100)


class WhoIs(Actor):
    """Answers ``whereis(name)`` from inside the tree."""

    async def receive(self, message: Any) -> Any:
        match message:
            case ("whereis", str(name)):
                return current_registry().whereis(name)
            case "registry":
                return current_registry()
        return await super().receive(message)


def test_registry_basics() -> None:
    registry = Registry()
    assert registry.whereis("a") is None
    marker: Any = object()
    registry.register("a", marker)
    registry.register("a", marker)  # idempotent for the same ref
    with pytest.raises(NameTaken):
        registry.register("a", object())  # type: ignore[arg-type]
    assert registry.names() == ["a"] and len(registry) == 1
    registry.unregister("a")
    registry.unregister("a")
    assert registry.whereis("a") is None


async def test_names_survive_restarts() -> None:
    registry = Registry()
    specs = [worker_spec("w", name="svc"), ChildSpec("who", WhoIs)]
    async with open_supervisor(specs, FLAGS, registry=registry) as sup:
        ref = await sup.child("w")
        assert current_registry() is registry
        assert registry.whereis("svc") == ref
        for _ in range(3):
            await crash(ref, sup)
            named = current_registry().whereis("svc")
            assert named == ref
            assert named is not None and await named.ask("ping") == "pong"
        who = await sup.child("who")
        assert await who.ask(("whereis", "svc")) == ref
        assert await who.ask("registry") is registry
    assert registry.whereis("svc") is None  # unregistered when the tree stopped
    assert current_registry() is not registry


async def test_each_tree_has_its_own_registry() -> None:
    async with (
        open_supervisor([worker_spec("w", name="svc")], name="one") as one,
        open_supervisor([worker_spec("w", name="svc")], name="two") as two,
    ):
        # The inner block's registry is current here; each tree registered its own child.
        assert current_registry().whereis("svc") == await two.child("w")
        assert await one.child("w") != await two.child("w")


async def test_named_grandchild_is_visible_from_the_root() -> None:
    inner = [worker_spec("deep", name="deep-svc")]

    def child_supervisor() -> Supervisor:
        return Supervisor(inner, FLAGS, name="inner")

    specs = [ChildSpec("inner", child_supervisor, kind="supervisor"), ChildSpec("who", WhoIs)]
    async with open_supervisor(specs, FLAGS) as sup:
        inner_sup = SupervisorRef(await sup.child("inner"))
        deep = await inner_sup.child("deep")
        assert current_registry().whereis("deep-svc") == deep
        who = await sup.child("who")
        assert await who.ask(("whereis", "deep-svc")) == deep


async def test_names_survive_a_killed_child_supervisor() -> None:
    """A child supervisor killed (brutal_kill, or past its shutdown timeout) cannot unregister
    its children's names in a hook; they must still be free for its next incarnation."""
    inner = [worker_spec("deep", name="deep-svc")]

    def child_supervisor() -> Supervisor:
        return Supervisor(inner, FLAGS, name="inner")

    spec = ChildSpec("inner", child_supervisor, kind="supervisor", shutdown="brutal_kill")
    async with open_supervisor([spec], FLAGS) as sup:
        first = current_registry().whereis("deep-svc")
        await sup.terminate_child("inner")
        assert current_registry().whereis("deep-svc") is None
        await sup.restart_child("inner")
        second = current_registry().whereis("deep-svc")
        assert second is not None and second != first
        assert await second.ask("ping") == "pong"


async def test_a_taken_name_fails_the_start() -> None:
    async with open_supervisor([worker_spec("a", name="svc")], FLAGS) as sup:
        with pytest.raises(ChildStartFailed) as info:
            await sup.start_child(worker_spec("b", name="svc", restart=Restart.TEMPORARY))
        assert isinstance(info.value.cause, NameTaken)
        assert [c.id for c in await sup.which_children()] == ["a"]
        assert await (await sup.child("a")).ask("ping") == "pong"  # the supervisor goes on
