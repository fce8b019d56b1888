"""`Lifecycle.readiness()`: one answer, with its reason, in a fixed order of precedence."""

from __future__ import annotations

from pylon.lifecycle import Lifecycle, Phase


def test_readiness_reasons_in_order() -> None:
    lifecycle = Lifecycle()
    assert lifecycle.readiness() == (False, "engine_not_ready")
    lifecycle.models.apply(["m"])
    assert lifecycle.readiness() == (False, "engine_not_ready")  # the gate comes first
    lifecycle.mark_ready()
    assert lifecycle.readiness() == (True, "ready")
    lifecycle.models.apply([])
    assert lifecycle.readiness() == (False, "no_models")
    lifecycle.models.apply(["m"])
    assert lifecycle.readiness() == (True, "ready")
    told: list[str] = []
    lifecycle.on_drain(lambda: told.append(lifecycle.readiness()[1]))
    lifecycle.drain()
    assert told == ["draining"]  # already flipped when the connections are told
    assert lifecycle.readiness() == (False, "draining")
    lifecycle.mark_ready()  # a bring-up that ends during the drain changes nothing
    assert lifecycle.phase is Phase.DRAINING


def test_draining_wins_before_the_gate_passed() -> None:
    lifecycle = Lifecycle()
    lifecycle.drain()
    assert lifecycle.readiness() == (False, "draining")
