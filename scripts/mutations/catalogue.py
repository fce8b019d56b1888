"""Every security mutation, by control area, in the order the report lists them."""

from __future__ import annotations

from mutations import (
    auth,
    floods,
    head,
    http3,
    intake,
    lifecycle,
    limits,
    routes,
    strip,
    timeouts,
    tls,
)
from mutations.spec import Mutation

SECURITY: list[Mutation] = [
    *auth.MUTATIONS,
    *tls.MUTATIONS,
    *http3.QUIC,
    *limits.HEADER_LIMITS,
    *limits.BODY_LIMITS,
    *head.WIRE_SAFETY,
    *head.PSEUDO_HEADER_RULES,
    *head.HTTP1_HEAD_RULES,
    *head.CONTRACT_RULES,
    *timeouts.STALL_CLOCK,
    *timeouts.HEAD_TIMER,
    *timeouts.IDLE_TIMERS,
    *floods.RAPID_RESET,
    *floods.FLOOD_GUARDS,
    *floods.CONCURRENCY_CAPS,
    *limits.BODY_BUDGETS,
    *lifecycle.GATES,
    *lifecycle.DRAIN,
    *intake.MUTATIONS,
    *strip.REQUEST_STRIP,
    *strip.RESPONSE_STRIP,
    *routes.MUTATIONS,
    *limits.ENGINE_SIDE,
    *http3.QPACK,
]
