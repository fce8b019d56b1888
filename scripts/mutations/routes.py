"""Routes served, per backend: a scheduled route missing from a backend's table, an unknown
route forwarded unsteered, the missing-model refusal, and the strict reading of `stream`."""

from __future__ import annotations

from mutations.anchors import DropEntry, Never, ReplaceExpr, ReplaceStatements
from mutations.spec import BODY, PLAN, TRANSPORTS, Mutation, per_transport

VLLM = "pylon/adapters/vllm.py"
PRIORITY = "pylon/core/priority.py"
ROUTES_T = "tests/unit/test_routes.py"
PLAN_T = "tests/unit/test_plan.py"
BODY_T = "tests/unit/test_body.py"
SERVED_T = "tests/integration/test_routes_served.py"

MUTATIONS = [
    Mutation(
        "routes served",
        "vllm /pooling missing from the steered routes",
        DropEntry(VLLM, "ROUTES", '("POST", "/pooling")'),
        {
            "core": (
                f"{ROUTES_T}::test_each_backend_serves_exactly_its_golden_routes[vllm]",
                f"{ROUTES_T}::test_every_served_route_carries_pylons_priority[vllm-POST-/pooling-*]",
            ),
            **per_transport(f"{SERVED_T}::test_vllm_pooling_route_gets_pylons_priority"),
        },
    ),
    Mutation(
        "routes served",
        "a route pylon does not steer is forwarded unsteered",
        ReplaceStatements(
            PLAN,
            "Planner.plan",
            """
            raise RouteError(
                f"{request.method} {request.path} is not a route pylon serves toward this engine"
            )
            """,
            "route = Route(schedules=False, body_model=False, streams=True)",
        ),
        {
            "core": (f"{ROUTES_T}::test_a_route_pylon_does_not_steer_is_refused[*]",),
            **per_transport(f"{SERVED_T}::test_a_route_pylon_does_not_steer_is_refused"),
        },
    ),
    Mutation(
        "routes served",
        "no body priority on the routes the engine schedules",
        ReplaceExpr(PLAN, "Planner._rewrite_body", "route.schedules", "False"),
        {
            "core": (f"{ROUTES_T}::test_every_served_route_carries_pylons_priority[*]",),
            **per_transport(f"{SERVED_T}::test_vllm_pooling_route_gets_pylons_priority"),
        },
    ),
    Mutation(
        "body model",
        "a body naming no model is forwarded (the engine serves its base model)",
        Never(PLAN, "_check_model", "view.model_count == 0 and required"),
        {
            "core": (
                f"{PLAN_T}::test_a_body_without_model_is_refused[*]",
                f"{ROUTES_T}::test_a_scheduled_route_needs_the_x_model_model[*]",
            ),
            **per_transport(f"{SERVED_T}::test_a_body_naming_no_model_is_refused"),
        },
    ),
    Mutation(
        "body model",
        "a lora_path naming another adapter is forwarded (SGLang serves that adapter)",
        Never(PLAN, "_check_model", "value != model"),
        {
            "core": (f"{PLAN_T}::test_a_lora_path_naming_another_model_is_refused[*]",),
            **per_transport(f"{SERVED_T}::test_a_lora_path_naming_another_model_is_refused"),
        },
    ),
    Mutation(
        "body fields",
        'stream read leniently ("stream": 1 forwarded as a non-stream)',
        ReplaceExpr(BODY, "read_stream", "_STREAM_TEXTS.get(raw)", 'raw == b"true"'),
        {
            "core": (
                f"{BODY_T}::test_pylon_reads_stream_as_the_engine_does_or_refuses",
                f"{PLAN_T}::test_a_stream_an_engine_could_read_otherwise_is_refused[*]",
            ),
            **per_transport(
                f"{SERVED_T}::test_a_stream_the_engine_could_read_otherwise_is_refused"
            ),
        },
    ),
    Mutation(
        "body fields",
        "stream read on routes whose engine request has none (embeddings timed as a stream)",
        ReplaceExpr(
            PLAN,
            "Planner.plan",
            "stream and route.streams and "
            "(not route.stream_keys or has_top_level_key(body, route.stream_keys))",
            "stream",
        ),
        {
            "core": (f"{ROUTES_T}::test_stream_is_read_only_where_the_engine_reads_it[*]",),
            **per_transport(f"{SERVED_T}::test_stream_on_a_route_that_never_streams_is_one_answer"),
        },
    ),
    Mutation(
        "body fields",
        "vllm /invocations reads stream whatever request type the body runs as",
        ReplaceExpr(PLAN, "Planner.plan", "has_top_level_key(body, route.stream_keys)", "True"),
        {
            "core": (f"{ROUTES_T}::test_vllm_invocations_streams_only_as_chat_or_completions[*]",),
            **{
                t: (
                    f"{SERVED_T}::test_stream_on_a_route_that_never_streams_is_one_answer"
                    f"[vllm-/invocations-{t}]",
                )
                for t in TRANSPORTS
            },
        },
    ),
    Mutation(
        "body fields",
        "routes with no stream marked as reading it (SCHEDULED_NO_STREAM)",
        ReplaceExpr(PRIORITY, "SCHEDULED_NO_STREAM", "False", "True"),
        {
            "core": (f"{ROUTES_T}::test_stream_is_read_only_where_the_engine_reads_it[*]",),
            **per_transport(f"{SERVED_T}::test_stream_on_a_route_that_never_streams_is_one_answer"),
        },
    ),
]
